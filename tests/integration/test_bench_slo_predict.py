"""The `slo-predict` benchmark (on the tiny test model): the real engine publishes its speed, the router's
predictions read it, and every prompt size and every running count gets its ratios."""

from __future__ import annotations

import argparse

from bench.slo_predict import PER_ROUND, RUNNING, SIZES, WARMUP, run
from tests.support.tiny_model import tiny_model_path


def test_slo_predict_reports_both_predictions_for_every_prompt_size_and_batch(tiny) -> None:  # type: ignore[no-untyped-def]
    out = run(argparse.Namespace(model=tiny_model_path(), rounds=1, json=True))
    measured = range(WARMUP, WARMUP + PER_ROUND)
    for key, cycle in (("ttft_by_prompt_tokens", SIZES), ("tpot_by_running", RUNNING)):
        kinds = [cycle[i % len(cycle)] for i in measured]
        assert set(out[key]) == {str(k) for k in cycle}, out[key]
        for k, figures in out[key].items():
            assert figures["requests"] == kinds.count(int(k)), (key, k, figures)
            for which in ("fit_over_actual", "old_over_actual"):
                s = figures[which]
                assert 0 < s["min"] <= s["median"] <= s["max"], (key, k, which, s)
    assert out["prefill_tps"] > 0 and out["prefill_ms_per_token"] >= 0 and out["prefill_step_ms"] >= 0
    assert out["decode_step_fixed_ms"] >= 0 and out["decode_ms_per_seq"] >= 0
    assert len(out["load_before"]) == 3 and len(out["load_after"]) == 3
