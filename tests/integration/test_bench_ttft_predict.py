"""The `ttft-predict` benchmark (on the tiny test model): the real engine publishes its speed, the router's
prediction reads it, and every prompt size gets its ratios."""

from __future__ import annotations

import argparse

from bench.ttft_predict import PER_ROUND, SIZES, WARMUP, run
from tests.support.tiny_model import tiny_model_path


def test_ttft_predict_reports_both_predictions_for_every_prompt_size(tiny) -> None:  # type: ignore[no-untyped-def]
    out = run(argparse.Namespace(model=tiny_model_path(), rounds=1, json=True))
    sizes = [SIZES[i % len(SIZES)] for i in range(WARMUP, WARMUP + PER_ROUND)]
    assert set(out["by_prompt_tokens"]) == {str(n) for n in SIZES}
    for n, figures in out["by_prompt_tokens"].items():
        assert figures["requests"] == sizes.count(int(n)), (n, figures)
        for key in ("fit_over_actual", "tps_over_actual"):
            s = figures[key]
            assert 0 < s["min"] <= s["median"] <= s["max"], (n, key, s)
    assert out["prefill_tps"] > 0 and out["prefill_ms_per_token"] >= 0 and out["prefill_step_ms"] >= 0
    assert len(out["load_before"]) == 3 and len(out["load_after"]) == 3
