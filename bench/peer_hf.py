"""The same workload through Hugging Face transformers `generate` (static batches of 16, the way
people batch with it) vs this engine's continuous batching. Both fp32 on the same CPU threads."""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch
from tqdm import tqdm

from bench.batching import run_engine
from bench.workload import Request, make_workload
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.hf_export import export_hf_folder
from common.model.loader import load_model


def hf_generate_tok_s(folder: str, workload: list[Request], batch: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"  # decoder-only generation pads on the left
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    useful = 0
    bar = tqdm(total=len(workload), desc="hf generate", unit="req", leave=False)
    t0 = time.perf_counter()
    for i in range(0, len(workload), batch):
        group = workload[i : i + batch]
        longest = max(r.max_tokens for r in group)
        enc = tok([r.prompt for r in group], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        assert out.shape[1] - enc["input_ids"].shape[1] == longest
        useful += sum(r.max_tokens for r in group)  # tokens past a request's own length are padding
        bar.update(len(group))
    elapsed = time.perf_counter() - t0
    bar.close()
    return {"tok_s": useful / elapsed, "seconds": elapsed}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, tok = load_model(args.model)
    workload = make_workload(tok, n=args.requests, seed=args.seed)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=args.max_batch, max_num_batched_tokens=1024))
    run_engine(engine, workload[:2], "warmup")
    ours = run_engine(engine, workload, "splitserve engine")
    with tempfile.TemporaryDirectory() as d:
        export_hf_folder(model, tok, d)
        theirs = hf_generate_tok_s(d, workload, args.max_batch)
    return {
        "requests": len(workload),
        "ours_tok_s": round(ours["tok_s"], 2),
        "hf_tok_s": round(theirs["tok_s"], 2),
        "ratio": round(ours["tok_s"] / theirs["tok_s"], 3),
        "threads": torch.get_num_threads(),
    }
