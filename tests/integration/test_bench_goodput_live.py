"""`bench goodput` end to end, tiny: 2 simulated GPUs (colocated on 2 decode services against 1P1D), real
Redis, sim-fleet and router processes, two rates of a few requests each."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import pytest

from bench.goodput import run

pytestmark = pytest.mark.services


def test_goodput_bench_compares_colocated_and_split_on_the_same_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the logs it keeps: under tmp_path, not /tmp
    args = argparse.Namespace(
        engine="sim", goodput_profile="llama3-8b-h100", goodput_gpus=2, goodput_workload="summarization",
        goodput_splits="", goodput_duration_s=2.0, goodput_min_requests=4, goodput_start_rate=1.0,
        goodput_max_rate=2.0, goodput_target=0.9, goodput_resolution=0.25, goodput_drain_s=2.0,
        goodput_max_num_seqs=32, goodput_time_scale=1.0, goodput_max_batched_tokens=None, model=None, seed=0,
        goodput_procs="service",
        request_timeout_s=60.0, slo_ttft_ms=20_000.0, slo_tpot_ms=2_000.0, out=str(tmp_path),
    )  # fmt: skip
    out = run(args)
    assert list(out["points"]) == ["colocated", "1P1D"]
    for name, points in out["points"].items():
        assert [p["rate"] for p in points] == [1.0, 2.0], name  # up to the cap, then done
        for p in points:
            # every request served on the configuration's own route (local / split), none failed
            assert p["routes_ok"] and p["errors"] == 0, (name, p)
            assert p["requests"] == 4 and p["idle_after"], (name, p)
            assert p["ttft_p50_ms"] > 0 and p["tpot_p50_ms"] > 0
    # objectives far above what a lightly loaded sim needs: every request meets them on both sides
    assert out["attainment_table"] == {"colocated": {"1": 1.0, "2": 1.0}, "1P1D": {"1": 1.0, "2": 1.0}}
    assert out["max_rate"] == {"colocated": 2.0, "1P1D": 2.0}
    assert out["lowest_failing_rate"] == {"colocated": None, "1P1D": None}  # none failed up to the cap
    assert out["goodput_ratio"] == 1.0 and out["best_split"] == "1P1D"
    assert out["slo_defaults"]["tpot_ms"] < out["slo_tpot_ms"]  # the given objective, not the default
    assert len(out["load_before"]) == 3 and len(out["load_after"]) == 3
    assert os.path.getsize(out["plot"]) > 0
