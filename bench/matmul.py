"""A decode step at batch 1, 4, 8, 13 and 16 with the model's `linear` (1..FEW_ROWS fp32 rows on the CPU as
weight @ x.T) against plain F.linear for every matmul, the two alternated in rounds in one process.

Per batch and side: `batch` requests of a 64-token prompt and 24 output tokens each, started together;
the figure is the median step time after the first 3 steps (the prefill and the batch filling up). The
ratio is the median over the rounds of F.linear's step time over `linear`'s (> 1: `linear` is faster).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

import common.model.llama as llama
from bench.rounds import alternate, load_avg, median, ratio_keys, ratio_stats
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.loader import load_model
from common.sampling_params import SamplingParams

BATCHES = (1, 4, 8, 13, 16)
OUTPUT_TOKENS = 24


def step_ms(engine: LLMEngine, batch: int) -> float:
    for i in range(batch):
        prompt = [100 + (i * 7 + j) % 1000 for j in range(64)]
        engine.add_request(prompt, SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return median(times[3:]) * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load_avg()
    model, tok = load_model(args.model)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=max(BATCHES)))
    ours = llama.linear
    impls: dict[str, Callable[..., torch.Tensor]] = {"f_linear": F.linear, "linear": ours}

    def side(name: str, batch: int) -> float:
        llama.linear = impls[name]  # the model's layers and lm_head look it up at call time
        try:
            return step_ms(engine, batch)
        finally:
            llama.linear = ours

    out: dict[str, Any] = {"few_rows": llama.FEW_ROWS, "output_tokens": OUTPUT_TOKENS}
    side("linear", 2)  # warm-up
    for batch in BATCHES:
        sides: dict[str, Callable[[], float]] = {name: partial(side, name, batch) for name in impls}
        per_round = alternate(sides, args.rounds, f"matmul batch {batch}")
        f_ms, ours_ms = per_round["f_linear"], per_round["linear"]
        out[f"b{batch}_f_linear_step_ms"] = round(median(f_ms), 2)
        out[f"b{batch}_linear_step_ms"] = round(median(ours_ms), 2)
        out |= {f"b{batch}_{k}": v for k, v in ratio_keys(ratio_stats(f_ms, ours_ms)).items()}
    out["threads"] = torch.get_num_threads()
    out["load_before"], out["load_after"] = load_before, load_avg()
    return out
