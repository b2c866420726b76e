"""The same workload through Hugging Face transformers `generate` (static batches of 16, the way
people batch with it) vs this engine's continuous batching. Both on the same device in the same dtype:
fp32 on the CPU's threads, bf16 on a GPU (where ours runs the Triton kernels and CUDA graphs)."""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch
from tqdm import tqdm

from bench.batching import bench_config, load_for_bench, run_engine
from bench.workload import Request, make_workload
from common.engine.device import Placement
from common.engine.llm_engine import LLMEngine
from common.model.hf_export import export_hf_folder


def hf_generate_tok_s(
    folder: str, workload: list[Request], batch: int, placement: Placement
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"  # decoder-only generation pads on the left
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=placement.dtype)
    model = model.to(placement.device).eval()
    useful = 0
    bar = tqdm(total=len(workload), desc="hf generate", unit="req", leave=False)
    t0 = time.perf_counter()
    for i in range(0, len(workload), batch):
        group = workload[i : i + batch]
        longest = max(r.max_tokens for r in group)
        enc = tok([r.prompt for r in group], return_tensors="pt", padding=True, add_special_tokens=False)
        enc = enc.to(placement.device)
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
    model, tok, placement = load_for_bench(args)
    workload = make_workload(tok, n=args.requests, seed=args.seed)
    engine = LLMEngine(model, tok, bench_config(args), placement)
    run_engine(engine, workload[:2], "warmup")
    ours = run_engine(engine, workload, "splitserve engine")
    del engine
    with tempfile.TemporaryDirectory() as d:
        export_hf_folder(model.to("cpu"), tok, d)
        hf_generate_tok_s(d, workload[:2], args.max_batch, placement)  # warm-up, as ours had
        theirs = hf_generate_tok_s(d, workload, args.max_batch, placement)
    return {
        **placement.describe(),
        "requests": len(workload),
        "ours_tok_s": round(ours["tok_s"], 2),
        "hf_tok_s": round(theirs["tok_s"], 2),
        "ratio": round(ours["tok_s"] / theirs["tok_s"], 3),
        "threads": torch.get_num_threads(),
    }
