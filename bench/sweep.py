"""Decode throughput against batch size, and a plot of it: where the knee is."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from tqdm import tqdm

from bench.plots import pyplot, save
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.loader import load_model
from common.sampling_params import SamplingParams

BATCHES = [1, 2, 4, 8, 16, 32, 64]


def decode_tok_s(engine: LLMEngine, batch: int, steps: int = 16, prompt_len: int = 64) -> float:
    for i in range(batch):
        ids = [(100 + 7 * i + j) % 40000 + 10 for j in range(prompt_len)]
        engine.add_request(ids, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    while (
        any(s.is_prefilling or s.num_computed_tokens == 0 for s in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    engine.step()
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished():
        n += len(engine.step().outputs)
    return n / (time.perf_counter() - t0)


def plot(points: dict[int, float], path: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    xs, ys = list(points), list(points.values())
    ax.plot(xs, ys, marker="o", label="throughput (tokens/s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("decode batch size (sequences per step)")
    ax.set_ylabel("output tokens / s")
    # step latency on a second axis: the knee is where latency starts to grow as fast as the batch
    ax2 = ax.twinx()
    ax2.plot(
        xs,
        [1e3 * b / t for b, t in zip(xs, ys, strict=True)],
        marker="s",
        color="tab:orange",
        label="step latency (ms)",
    )
    ax2.set_ylabel("ms per decode step")
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88), fontsize=8)
    ax.set_title("SmolLM2-135M decode throughput vs batch size (CPU, fp32)")
    ax.grid(alpha=0.3)
    save(fig, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, tok = load_model(args.model)
    points = {}
    decode_tok_s(LLMEngine(model, tok, EngineConfig(max_num_seqs=4)), 4, steps=4)  # warm-up
    for b in tqdm(BATCHES, desc="batch sizes", leave=False):
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=b, max_num_batched_tokens=max(512, 64 * b)))
        points[b] = decode_tok_s(engine, b)
    path = os.path.join("docs", "img", "throughput_vs_batch.png")
    plot(points, path)
    return {f"tok_s_b{b}": round(v, 1) for b, v in points.items()} | {"plot": path}
