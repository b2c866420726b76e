"""`splitserve bench ttft-predict`: how well SLO-aware admission predicts a prompt's TTFT (router/slo.py),
from what the engine publishes about its own speed (common/engine/speed.py), on the real model.

One engine in this process serves prompts one at a time (no queue), their sizes cycling through
`SIZES` so that short prompts outnumber long ones, as in chat traffic. Before each request the router's
`predict_ttft_ms` reads the engine's published load twice: as it is (the fit of a prompt step's time as
fixed + per token, once the steps have spread in size), and with the fit removed (TTFT = tokens /
prefill_tps, the recent steps' prompt tokens per second: what it predicted before the fit). Each
prediction is divided by the request's measured TTFT (add_request to the first token).

Figures (JSON), per prompt size: `fit_over_actual` and `tps_over_actual` (median, min, max over the
`--rounds` x `PER_ROUND` requests after the warm-up), the fitted terms at the end, and the load average.
1.0 is a perfect prediction; above it a placement is refused that would have met its target; below it one
is taken that will miss it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.rounds import load_avg
from common.sampling_params import SamplingParams

SIZES = (24, 24, 96, 24, 400)  # prompt tokens, cycled: three short ones to a medium and a long one
PER_ROUND = 10
WARMUP = 10


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import asdict

    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.model.loader import load_model
    from router.slo import predict_ttft_ms

    load_before, t_start = load_avg(), time.perf_counter()
    model, tok = load_model(args.model)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=512))
    fresh = iter(range(1000, 10**9))
    vocab = model.config.vocab_size
    ratios: dict[int, dict[str, list[float]]] = {n: {"fit": [], "tps": []} for n in sorted(set(SIZES))}
    total = WARMUP + args.rounds * PER_ROUND
    for i in range(total):
        n = SIZES[i % len(SIZES)]
        load = asdict(engine.load())
        fit = predict_ttft_ms(load, n, local=False)
        tps = predict_ttft_ms({**load, "prefill_ms_per_token": 0.0}, n, local=False)
        ids = [100 + next(fresh) % (vocab - 200) for _ in range(n)]  # never a prefix-cache hit
        t0 = time.perf_counter()
        engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        actual_ms = (time.perf_counter() - t0) * 1000.0
        if i >= WARMUP and fit is not None and tps is not None:
            ratios[n]["fit"].append(fit / actual_ms)
            ratios[n]["tps"].append(tps / actual_ms)
        if not args.json:
            print(f"\r  request {i + 1}/{total}", end="", flush=True)
    if not args.json:
        print()

    def summary(xs: list[float]) -> dict[str, float] | None:
        if not xs:
            return None
        return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}

    return {
        "by_prompt_tokens": {
            str(n): {
                "requests": len(r["fit"]),
                "fit_over_actual": summary(r["fit"]),
                "tps_over_actual": summary(r["tps"]),
            }
            for n, r in ratios.items()
        },  # fmt: skip
        "prefill_step_ms": round(engine.speed.prefill_step_ms, 2),
        "prefill_ms_per_token": round(engine.speed.prefill_ms_per_token, 4),
        "prefill_tps": round(engine.speed.prefill_tps, 1),
        "rounds": args.rounds,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "load_before": load_before,
        "load_after": load_avg(),
    }
