"""Decode at batch 1 against the memory roofline: every weight byte is read once per step."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.rounds import alternate, load_avg, median, ratio_stats
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.loader import load_model
from common.sampling_params import SamplingParams


def memory_bandwidth_gb_s(mib: int = 512, repeats: int = 5) -> float:
    """Best-of read+write bandwidth of a large tensor copy (bytes moved = 2 x size)."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def decode_step_seconds(engine: LLMEngine, steps: int = 40) -> float:
    engine.add_request(list(range(100, 164)), SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    engine.step()
    engine.step()
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The copy bandwidth and the batch-1 step alternated in rounds (each round: 40 steps, the median
    step); the ratio is the median over rounds of roofline / step, with its spread."""
    load_before = load_avg()
    model, tok = load_model(args.model)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    decode_step_seconds(engine, steps=4)  # warm-up
    sides = alternate(
        {"bandwidth": memory_bandwidth_gb_s, "step": lambda: decode_step_seconds(engine)},
        args.rounds,
        progress="roofline",
    )
    bw, step = median(sides["bandwidth"]), median(sides["step"])
    # roofline / step per round: the bytes over each round's bandwidth, over that round's step
    ratios = ratio_stats([weight_bytes / (b * 1e9) for b in sides["bandwidth"]], sides["step"])
    return {
        "weight_mb": round(weight_bytes / 2**20, 1),
        "memory_gb_s": round(bw, 2),
        "roofline_ms": round(weight_bytes / (bw * 1e9) * 1e3, 2),
        "decode_step_ms_b1": round(step * 1e3, 2),
        "ratio_to_roofline": ratios["median"],
        "ratio_min": ratios["min"],
        "ratio_max": ratios["max"],
        "ratio_iqr": ratios["iqr"],
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": load_avg(),
    }
