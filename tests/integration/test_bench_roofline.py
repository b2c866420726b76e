"""The `roofline` benchmark (on the tiny test model): its per-round figures add up to what it reports."""

from __future__ import annotations

import argparse

import pytest

from bench.roofline import run
from tests.support.tiny_model import tiny_model_path


def test_roofline_reports_the_median_of_its_rounds_and_their_spread(tiny) -> None:  # type: ignore[no-untyped-def]
    out = run(argparse.Namespace(model=tiny_model_path(), rounds=2))
    model, _ = tiny
    weight_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    assert out["rounds"] == 2 and out["weight_mb"] == pytest.approx(weight_mb, abs=0.1)  # every weight
    assert out["memory_gb_s"] > 0 and out["decode_step_ms_b1"] > 0
    # roofline_ms is the weight bytes over the median bandwidth
    assert out["roofline_ms"] == pytest.approx(
        out["weight_mb"] * 2**20 / (out["memory_gb_s"] * 1e9) * 1e3, rel=0.01
    )
    # a step reads every weight at least once: it cannot beat the copy by much (2x leaves noise room)
    assert 0 < out["ratio_min"] <= out["ratio_to_roofline"] <= out["ratio_max"] < 2
    assert len(out["load_before"]) == 3 and len(out["load_after"]) == 3
