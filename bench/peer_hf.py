"""The same workload through Hugging Face transformers `generate` (static batches of 16, the way
people batch with it) vs this engine's continuous batching. Both on the same device in the same dtype:
fp32 on the CPU's threads, bf16 on a GPU (where ours runs the Triton kernels and CUDA graphs)."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from tqdm import tqdm

from bench.batching import bench_config, load_for_bench, run_engine
from bench.rounds import alternate, load_avg, median, ratio_keys, ratio_stats
from bench.workload import Request, make_workload
from common.engine.device import Placement
from common.engine.llm_engine import LLMEngine
from common.model.hf_export import export_hf_folder


def load_hf(folder: str, placement: Placement) -> tuple[Any, Any]:
    """(model, tokenizer) of transformers from an exported folder, on the placement's device and dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"  # decoder-only generation pads on the left
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=placement.dtype)
    return model.to(placement.device).eval(), tok


def hf_generate_tok_s(
    model: Any, tok: Any, workload: list[Request], batch: int, placement: Placement
) -> dict[str, float]:
    """The workload through `generate` in static batches of `batch`: useful tok/s, and the load-independent
    steps (one per token of a batch's longest request) and tokens computed (padding included)."""
    useful = steps = computed = 0
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
        steps, computed = steps + longest, computed + longest * len(group)
        bar.update(len(group))
    elapsed = time.perf_counter() - t0
    bar.close()
    return {"tok_s": useful / elapsed, "seconds": elapsed, "steps": steps, "tokens_computed": computed}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides loaded side by side run the whole workload in turn, in --rounds rounds (ours, hf;
    hf, ours; ...): the ratio is the median of the per-round ratios."""
    load_before = load_avg()
    model, tok, placement = load_for_bench(args)
    workload = make_workload(tok, n=args.requests, seed=args.seed)
    with tempfile.TemporaryDirectory() as d:
        export_hf_folder(model, tok, d)  # still on the CPU: the engine moves it to the device
        hf_model, hf_tok = load_hf(d, placement)
        engine = LLMEngine(model, tok, bench_config(args), placement)
        run_engine(engine, workload[:2], "warmup")
        hf_generate_tok_s(hf_model, hf_tok, workload[:2], args.max_batch, placement)  # warm-up, as ours had
        sides: dict[str, Callable[[], dict[str, float]]] = {
            "ours": partial(run_engine, engine, workload, "splitserve engine"),
            "hf": partial(hf_generate_tok_s, hf_model, hf_tok, workload, args.max_batch, placement),
        }
        per_round = alternate(sides, args.rounds)
    load_after = load_avg()
    ours, theirs = [r["tok_s"] for r in per_round["ours"]], [r["tok_s"] for r in per_round["hf"]]
    ratio = ratio_stats(ours, theirs)
    output_tokens = sum(r.max_tokens for r in workload)
    ours_steps = round(median([r["steps"] for r in per_round["ours"]]))
    hf_last = per_round["hf"][-1]
    return {
        **placement.describe(),
        "requests": len(workload),
        "ours_tok_s": round(median(ours), 2),
        "hf_tok_s": round(median(theirs), 2),
        **ratio_keys(ratio),
        "rounds": args.rounds,
        "ours_tok_s_rounds": [round(x, 2) for x in ours],
        "hf_tok_s_rounds": [round(x, 2) for x in theirs],
        # load-independent: the same every round and on any machine
        "output_tokens": output_tokens,
        "ours_steps": ours_steps,
        "ours_tokens_per_step": round(output_tokens / ours_steps, 3),
        "hf_steps": int(hf_last["steps"]),
        "hf_tokens_per_step": round(output_tokens / hf_last["steps"], 3),
        "hf_tokens_computed": int(hf_last["tokens_computed"]),
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": load_after,
    }
