"""Cost of the scheduler itself: schedule() + postprocess() against a fake runner, and its share of
a real decode step at batch 16."""

from __future__ import annotations

import argparse
import time
from typing import Any

from common.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from common.engine.sequence import Sequence
from common.kv.block_manager import BlockManager
from common.sampling_params import SamplingParams


def _fake_tokens(out: SchedulerOutput) -> list[int | None]:
    return [7 if s.num_computed_tokens + n == s.num_tokens else None for s, n in out.scheduled]


def scheduler_us_per_step(running: int = 256, waiting: int = 1000, steps: int = 200) -> float:
    bm = BlockManager(num_blocks=running * 64, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=running * 128), bm)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i in range(running + waiting):
        sched.add(Sequence(list(range(i % 50, i % 50 + 100)), params))
    # admit `running` sequences and prefill them, so the timed steps are pure decode with a full queue
    while len(sched.running) < running or any(s.is_prefilling for s in sched.running):
        out = sched.schedule()
        sched.postprocess(out, _fake_tokens(out))
    assert len(sched.waiting) == waiting
    t0 = time.perf_counter()
    for _ in range(steps):
        out = sched.schedule()
        sched.postprocess(out, _fake_tokens(out))
    return (time.perf_counter() - t0) / steps * 1e6


def real_step_overhead(model_path: str | None, batch: int = 16, steps: int = 30) -> dict[str, float]:
    """Time schedule(), model run and postprocess() separately on the real model at batch 16."""
    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.model.loader import load_model

    model, tok = load_model(model_path)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=batch))
    for i in range(batch):
        engine.add_request(
            list(range(100 + i, 164 + i)), SamplingParams(max_tokens=steps + 10, ignore_eos=True)
        )
    engine.step()  # prefill all
    engine.step()
    t_sched = t_run = t_post = 0.0
    for _ in range(steps):
        a = time.perf_counter()
        out = engine.scheduler.schedule()
        b = time.perf_counter()
        sampled = engine.runner.run(out)
        c = time.perf_counter()
        engine.scheduler.postprocess(out, [s.token_id if s is not None else None for s in sampled])
        d = time.perf_counter()
        t_sched, t_run, t_post = t_sched + b - a, t_run + c - b, t_post + d - c
    total = t_sched + t_run + t_post
    return {
        "decode_step_ms_b16": total / steps * 1e3,
        "sched_us_b16": (t_sched + t_post) / steps * 1e6,
        "overhead_fraction": (t_sched + t_post) / total,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    us = min(scheduler_us_per_step() for _ in range(3))
    real = real_step_overhead(args.model)
    return {
        "running": 256,
        "waiting": 1000,
        "us_per_step": round(us, 1),
        "decode_step_ms_b16": round(real["decode_step_ms_b16"], 2),
        "sched_us_b16": round(real["sched_us_b16"], 1),
        "overhead_fraction": round(real["overhead_fraction"], 5),
    }
