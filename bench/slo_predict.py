"""`splitserve bench slo-predict`: how well SLO-aware admission predicts a request's TTFT and TPOT
(router/slo.py) from what the engine publishes about its own speed (common/engine/speed.py), on the real
model.

TTFT: one engine in this process serves prompts one at a time (no queue), their sizes cycling through
`SIZES` so that short prompts outnumber long ones, as in chat traffic. Before each request the router's
`predict_ttft_ms` reads the engine's published load twice: as it is (the fit of a prompt step's time as
fixed + per token, once the steps have spread in size), and with the fit removed (TTFT = tokens /
prefill_tps, the recent steps' prompt tokens per second: what it predicted before the fit). Each
prediction is divided by the request's measured TTFT (add_request to the first token).

TPOT: `RUNNING` sequences decode (cycling 0, 1, 3, 7), and a probe request joins them; before it is added,
`predict_tpot_ms` reads the load as it is (the fit of a decode step's time as fixed + per sequence) and
with the fit removed (the recent decode step x (running + 1) / running: what it predicted before). Each is
divided by the probe's measured TPOT (its tokens' spacing, from its second token on).

Figures (JSON): per prompt size and per running count, `fit_over_actual` and `old_over_actual`
(bench/rounds.py `spread`: median, min, max and interquartile range over the `--rounds` x `PER_ROUND`
requests after the warm-up), the fitted terms at the end, and the load average. 1.0 is a perfect
prediction; above it a placement is refused that would have met its target; below it one is taken that
will miss it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.rounds import load_avg, spread
from common.sampling_params import SamplingParams

SIZES = (24, 24, 96, 24, 400)  # prompt tokens, cycled: three short ones to a medium and a long one
RUNNING = (0, 1, 3, 7)  # sequences decoding when the TPOT probe joins
PER_ROUND = 10
WARMUP = 10
PROBE_TOKENS = 12


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import asdict

    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.model.loader import load_model
    from router.slo import predict_tpot_ms, predict_ttft_ms

    load_before, t_start = load_avg(), time.perf_counter()
    model, tok = load_model(args.model)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=max(RUNNING) + 1, max_num_batched_tokens=512))
    counter = iter(range(10**9))
    vocab = model.config.vocab_size

    def fresh(n: int) -> list[int]:  # token ids never sent before: never a prefix-cache hit
        return [100 + next(counter) % (vocab - 200) for _ in range(n)]

    total = WARMUP + args.rounds * PER_ROUND
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if not args.json:
            print(f"\r  request {done}/{2 * total}", end="\n" if done == 2 * total else "", flush=True)

    ttft: dict[int, dict[str, list[float]]] = {n: {"fit": [], "old": []} for n in sorted(set(SIZES))}
    for i in range(total):
        n = SIZES[i % len(SIZES)]
        load = asdict(engine.load())
        fit = predict_ttft_ms(load, n, local=False)
        old = predict_ttft_ms({**load, "prefill_ms_per_token": 0.0}, n, local=False)
        t0 = time.perf_counter()
        engine.add_request(fresh(n), SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        actual_ms = (time.perf_counter() - t0) * 1000.0
        if i >= WARMUP and fit is not None and old is not None:
            ttft[n]["fit"].append(fit / actual_ms)
            ttft[n]["old"].append(old / actual_ms)
        tick()

    tpot: dict[int, dict[str, list[float]]] = {r: {"fit": [], "old": []} for r in RUNNING}
    long = SamplingParams(max_tokens=4096, ignore_eos=True)  # decoding until finished below
    for i in range(total):
        r = RUNNING[i % len(RUNNING)]
        background = [engine.add_request(fresh(32), long) for _ in range(r)]
        while engine.load().running < r or engine.load().waiting:
            engine.step()
        engine.step()  # every background sequence decoding: the load shows a decode step at this batch
        load = asdict(engine.load())
        fit = predict_tpot_ms(load)
        old = predict_tpot_ms({**load, "decode_step_fixed_ms": 0.0, "decode_ms_per_seq": 0.0})
        probe = engine.add_request(fresh(32), SamplingParams(max_tokens=PROBE_TOKENS, ignore_eos=True))
        stamps: list[float] = []
        while len(stamps) < PROBE_TOKENS:
            out = engine.step()
            now = time.perf_counter()
            stamps += [now for o in out.outputs if o.request_id == probe for _ in o.token_ids]
        for rid in background:
            engine.finish(rid, "abort")
        while engine.has_unfinished():
            engine.step()
        actual_ms = (stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1000.0  # from its second token on
        if i >= WARMUP and fit is not None and old is not None:
            tpot[r]["fit"].append(fit / actual_ms)
            tpot[r]["old"].append(old / actual_ms)
        tick()

    def figures(d: dict[int, dict[str, list[float]]]) -> dict[str, Any]:
        return {
            str(k): {"requests": len(v["fit"]), "fit_over_actual": spread(v["fit"]) if v["fit"] else None,
                     "old_over_actual": spread(v["old"]) if v["old"] else None}
            for k, v in d.items()
        }  # fmt: skip

    speed = engine.speed
    return {
        "ttft_by_prompt_tokens": figures(ttft),
        "tpot_by_running": figures(tpot),
        "prefill_step_ms": round(speed.prefill_step_ms, 2),
        "prefill_ms_per_token": round(speed.prefill_ms_per_token, 4),
        "prefill_tps": round(speed.prefill_tps, 1),
        "decode_step_fixed_ms": round(speed.decode_step_fixed_ms, 2),
        "decode_ms_per_seq": round(speed.decode_ms_per_seq, 4),
        "rounds": args.rounds,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "load_before": load_before,
        "load_after": load_avg(),
    }
