"""Continuous (iteration-level) vs static batching on the real model, same max batch size."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from tqdm import tqdm

from bench.rounds import alternate, load_avg, median, ratio_keys, ratio_stats
from bench.workload import Request, make_workload
from common.config import EngineConfig
from common.engine.device import Placement
from common.engine.llm_engine import LLMEngine
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.sampling_params import SamplingParams
from common.text.tokenizer import Tokenizer


def run_engine(engine: LLMEngine, workload: list[Request], label: str) -> dict[str, float]:
    """Run the workload to completion; returns tok/s and slot utilization.

    slot_utilization: useful sequence-slots / (max batch * steps), over the steps during which
    requests were waiting, i.e. while the server had work to put in an idle slot. Padding (finished
    members of a static batch) is not useful. utilization_all counts every step, drain tail included.
    """
    max_batch = engine.config.max_num_seqs
    for r in workload:
        engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    useful_sat = steps_sat = useful_all = steps_all = 0
    tokens = 0
    bar = tqdm(total=len(workload), desc=label, unit="req", leave=False)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        waiting = engine.scheduler.num_waiting
        step = engine.step()
        useful = step.num_scheduled - step.num_padding
        useful_all, steps_all = useful_all + useful, steps_all + 1
        if waiting:
            useful_sat, steps_sat = useful_sat + useful, steps_sat + 1
        for o in step.outputs:
            tokens += len(o.token_ids)
            if o.finished:
                bar.update(1)
    elapsed = time.perf_counter() - t0
    bar.close()
    expected = sum(r.max_tokens for r in workload)
    assert tokens == expected, f"{label}: generated {tokens} tokens, expected {expected}"
    engine.block_manager.check_integrity()
    return {
        "tok_s": tokens / elapsed,
        "seconds": elapsed,
        "steps": steps_all,
        "slot_utilization": useful_sat / (max_batch * steps_sat) if steps_sat else 1.0,
        "utilization_all": useful_all / (max_batch * steps_all),
    }


def bench_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The engine config benchmarks share: on --device (default auto), with a KV cache of a fixed size
    (on a GPU too: two engines live in one process, so neither may take the card's free memory)."""
    return EngineConfig(
        device=getattr(args, "device", "auto"),
        kv_cache_memory_mb=getattr(args, "kv_cache_mb", None) or 1024,
        max_num_seqs=args.max_batch,
        max_num_batched_tokens=1024,
        **overrides,
    )


def load_for_bench(args: argparse.Namespace) -> tuple[LlamaForCausalLM, Tokenizer, Placement]:
    placement = Placement.from_config(bench_config(args))
    model, tok = load_model(args.model, dtype=placement.dtype)
    return model, tok, placement


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both policies' engines live side by side and run the whole workload in turn, in --rounds rounds
    (continuous, static; static, continuous; ...): the ratio is the median of the per-round ratios."""
    load_before = load_avg()
    model, tok, placement = load_for_bench(args)
    workload = make_workload(tok, n=args.requests, seed=args.seed)
    sides: dict[str, Callable[[], dict[str, float]]] = {}
    for policy in ("continuous", "static"):
        cfg = bench_config(args, policy="static" if policy == "static" else "fcfs")
        engine = LLMEngine(model, tok, cfg, placement)
        run_engine(engine, workload[:2], f"warmup {policy}")
        sides[policy] = partial(run_engine, engine, workload, policy)
    per_round = alternate(sides, args.rounds)
    load_after = load_avg()
    c, s = per_round["continuous"], per_round["static"]
    c_tok_s, s_tok_s = [r["tok_s"] for r in c], [r["tok_s"] for r in s]
    ratio = ratio_stats(c_tok_s, s_tok_s)
    output_tokens = sum(r.max_tokens for r in workload)
    c_steps, s_steps = round(median([r["steps"] for r in c])), round(median([r["steps"] for r in s]))
    return {
        **placement.describe(),
        "requests": len(workload),
        "output_tokens": output_tokens,
        "max_batch": args.max_batch,
        "continuous_tok_s": round(median(c_tok_s), 2),
        "static_tok_s": round(median(s_tok_s), 2),
        **ratio_keys(ratio),
        "rounds": args.rounds,
        "continuous_tok_s_rounds": [round(x, 2) for x in c_tok_s],
        "static_tok_s_rounds": [round(x, 2) for x in s_tok_s],
        # load-independent: the same every round and on any machine
        "continuous_steps": c_steps,
        "static_steps": s_steps,
        "steps_ratio": round(s_steps / c_steps, 3),
        "continuous_tokens_per_step": round(output_tokens / c_steps, 3),
        "static_tokens_per_step": round(output_tokens / s_steps, 3),
        "slot_utilization_continuous": round(c[-1]["slot_utilization"], 4),
        "slot_utilization_static": round(s[-1]["slot_utilization"], 4),
        "utilization_all_continuous": round(c[-1]["utilization_all"], 4),
        "utilization_all_static": round(s[-1]["utilization_all"], 4),
        "load_before": load_before,
        "load_after": load_after,
    }
