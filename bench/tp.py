"""Tensor parallelism on this machine: one engine at TP=1 against TP=2 (`--tensor-parallel-size`).

The same chat prompts, greedy, through an engine at TP=1 with one thread, TP=1 with two threads (the
same cores TP=2 uses) and TP=2 with one thread per rank, in rounds that alternate the three. Reported:
each side's time per engine step (median over rounds, with the spread), the share of a TP=2 step rank 0
spends in its collectives (all-reduce after attention and after the MLP, the logits gather; waiting
for the other rank included), and `greedy_equal`: TP=2 produced exactly TP=1's tokens. On a 2-core CPU
with a 135M model, TP=2 is expected to be slower: the point here is that it is exact, and what its
communication costs; on GPUs `scripts/gpu_check.sh` is where speed would be measured.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.rounds import alternate, load_avg, spread
from bench.workload import QUESTIONS
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.loader import load_model
from common.sampling_params import SamplingParams


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load_avg()
    model, tok = load_model(args.model, dtype=torch.float32)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(min(args.requests, 8))]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    params = SamplingParams(max_tokens=args.answer_tokens, ignore_eos=True)
    sides = {
        "tp1": EngineConfig(num_threads=1, max_num_seqs=8),
        "tp1_2threads": EngineConfig(num_threads=2, max_num_seqs=8),
        "tp2": EngineConfig(num_threads=1, max_num_seqs=8, tensor_parallel_size=2),
    }
    engines = {name: LLMEngine(model, tok, cfg) for name, cfg in sides.items()}
    tokens: dict[str, list[list[int]]] = {}
    comm = engines["tp2"].tp_workers.comm if engines["tp2"].tp_workers is not None else None

    def side(name: str) -> dict[str, float]:
        engine = engines[name]
        torch.set_num_threads(engine.config.num_threads or 1)
        if comm is not None:
            comm.seconds, comm.calls = 0.0, 0
        t0 = time.perf_counter()
        rids = [engine.add_request(p, params) for p in prompts]
        out: dict[str, list[int]] = {r: [] for r in rids}
        steps = 0
        while engine.has_unfinished():
            for o in engine.step().outputs:
                out[o.request_id] += o.token_ids
            steps += 1
        elapsed = time.perf_counter() - t0
        tokens[name] = [out[r] for r in rids]
        result = {"step_ms": 1000 * elapsed / steps, "steps": float(steps)}
        if name == "tp2" and comm is not None:
            result["comm_share"] = comm.seconds / elapsed
            result["comm_calls_per_step"] = comm.calls / steps
        return result

    try:
        results = alternate({n: (lambda n=n: side(n)) for n in sides}, args.rounds)  # type: ignore[misc]
    finally:
        for engine in engines.values():
            engine.close()
    out: dict[str, Any] = {"prompts": len(prompts), "answer_tokens": args.answer_tokens}
    out["rounds"] = args.rounds
    for name, rs in results.items():
        s = spread([r["step_ms"] for r in rs])
        out[f"{name}_step_ms"], out[f"{name}_step_ms_spread"] = s["median"], [s["min"], s["max"]]
    tp2 = results["tp2"]
    share = spread([r["comm_share"] for r in tp2])
    out["tp2_comm_share"], out["tp2_comm_share_spread"] = share["median"], [share["min"], share["max"]]
    out["tp2_comm_calls_per_step"] = tp2[0]["comm_calls_per_step"]
    out["tp2_vs_tp1_step_ratio"] = round(out["tp2_step_ms"] / out["tp1_step_ms"], 3)
    out["greedy_equal"] = tokens["tp2"] == tokens["tp1"]
    out["splits_1_to_2_and_2_to_1"] = "not yet: KV transfer with TP > 1 is refused (issue 16, items 2-3)"
    out["load_before"], out["load_after"] = load_before, load_avg()
    return out
