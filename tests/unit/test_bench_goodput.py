"""bench/goodput.py's pure parts: the xPyD layouts, SLO attainment, the rate search and the default
objectives (no process is started here; tests/integration/test_bench_goodput.py runs it end to end)."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.goodput import (
    WORKLOADS,
    Layout,
    attainment,
    default_slos,
    layouts,
    max_rate,
    next_rate,
    parse_layout,
    run,
    slowed,
)
from bench.loadgen import Result, summarize
from common.engine.sim_profile import SimProfile, step_seconds


def test_layouts_are_colocated_and_every_split_of_the_workers() -> None:
    assert [x.name for x in layouts(4, 1)] == ["colocated", "1P3D", "2P2D", "3P1D"]
    assert [x.workers for x in layouts(4, 1)] == [4, 4, 4, 4]
    # TP counts: 8 GPUs of TP 2 are 4 workers, of TP 4 two
    assert [x.name for x in layouts(8, 2)] == ["colocated", "1P3D", "2P2D", "3P1D"]
    assert [x.name for x in layouts(8, 4)] == ["colocated", "1P1D"]
    assert layouts(8, 4)[0] == Layout(0, 2)


@pytest.mark.parametrize(
    ("gpus", "tp", "words"), [(6, 4, "multiple of"), (4, 4, "at least 2 workers"), (0, 1, "at least 1")]
)
def test_layouts_refuse_gpus_that_cannot_be_split(gpus: int, tp: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        layouts(gpus, tp)


def test_parse_layout() -> None:
    assert parse_layout("2P2D", 4) == Layout(2, 2)
    assert parse_layout("1p3d", 4) == Layout(1, 3)
    assert parse_layout("colocated", 4) == Layout(0, 4)
    for bad in ("2P3D", "0P4D", "4P0D", "PD", "2X2D", "2P2"):
        with pytest.raises(ValueError, match="--goodput-splits"):
            parse_layout(bad, 4)


def _r(ttft: float | None, e2e: float | None, out: int, error: str | None = None) -> Result:
    return Result(prompt_tokens=10, ttft=ttft, e2e=e2e, output_tokens=out, error=error)


def test_attainment_counts_requests_meeting_both_objectives() -> None:
    results = [
        _r(0.1, 0.1 + 9 * 0.02, 10),  # TTFT 100 ms, TPOT 20 ms: meets both
        _r(0.3, 0.3 + 9 * 0.02, 10),  # TTFT misses
        _r(0.1, 0.1 + 9 * 0.05, 10),  # TPOT misses
        _r(0.1, 0.1, 1),  # one token: no TPOT, meets it
        _r(None, None, 0, error="HTTP 503"),  # an error misses
    ]
    assert attainment(results, 200, 30) == pytest.approx(2 / 5)
    assert attainment(results, math.inf, 30) == pytest.approx(3 / 5)  # TPOT alone (an error misses)
    assert attainment(results, 200, math.inf) == pytest.approx(3 / 5)  # TTFT alone
    assert attainment([], 200, 30) == 0.0
    # the same definition as the serving bench's goodput
    assert attainment(results, 200, 30) == pytest.approx(
        summarize(results, 1.0, 200, 30)["goodput"], abs=1e-3
    )


def _search(capacity: float, start: float = 1.0, **kw: float) -> tuple[list[float], float | None]:
    """Run next_rate against a system that meets the target exactly below `capacity` req/s."""
    points: dict[float, float] = {}
    while (rate := next_rate(points, start, **kw)) is not None:
        assert rate not in points, "a rate measured twice"
        points[rate] = 1.0 if rate <= capacity else 0.5
        assert len(points) < 20
    return list(points), max_rate(points, 0.9)


def test_rate_search_doubles_then_bisects_near_the_knee() -> None:
    rates, best = _search(5.0)
    assert rates[:4] == [1.0, 2.0, 4.0, 8.0]  # the coarse grid up to the first failure
    assert best is not None and 4.0 <= best <= 5.0
    assert len(rates) == 6  # 8 -> 6 -> 5: within 25 %
    assert best == 5.0


def test_rate_search_goes_down_when_the_start_fails_and_stops_at_the_cap() -> None:
    rates, best = _search(0.3, start=1.0)
    assert rates[:3] == [1.0, 0.5, 0.25]
    assert best is not None and 0.25 <= best <= 0.3
    rates, best = _search(100.0, start=1.0, max_rate_=16.0)
    assert rates == [1.0, 2.0, 4.0, 8.0, 16.0] and best == 16.0  # every rate passed up to the cap
    rates, best = _search(0.01, start=1.0, min_rate=0.2)
    assert best is None and min(rates) >= 0.2  # nothing passes: stops at the floor


def test_max_rate_ignores_a_pass_above_a_failure() -> None:
    assert max_rate({1.0: 0.95, 2.0: 0.8, 3.0: 0.92}, 0.9) == 1.0
    assert max_rate({1.0: 0.5}, 0.9) is None
    assert max_rate({1.0: 0.9, 2.0: 0.91}, 0.9) == 2.0  # exactly the target passes


def test_default_slos_follow_the_profile() -> None:
    profile = SimProfile.load("llama3-70b-h200-tp2")
    w = WORKLOADS["summarization"]
    ttft, tpot = default_slos(profile, w, 512)
    decode = step_seconds(profile, [(1, 1545)] * 32) * 1000
    assert tpot == pytest.approx(1.25 * decode, rel=1e-3)
    # tight: a step carrying a 512-token prefill chunk alone breaks the TPOT objective
    assert step_seconds(profile, [(512, 0)]) * 1000 > tpot
    # three chunks of 512 and one of 1500 - 1536... : the lone prefill of the median prompt, x5
    chunks = [(512, 0), (512, 512), (476, 1024)]
    assert ttft == pytest.approx(5 * sum(step_seconds(profile, [c]) for c in chunks) * 1000, rel=1e-3)
    # a faster GPU, tighter objectives
    fast = default_slos(SimProfile.load("llama3-8b-h100"), w, 512)
    assert fast[0] < ttft and fast[1] < tpot


def test_slowed_profile_scales_every_step_and_keeps_the_kv_capacity() -> None:
    p = SimProfile.load("llama3-70b-h200-tp2")
    q = slowed(p, 2.0)
    for rows in ([(1, 1000)] * 8, [(512, 0)], [(512, 0)] + [(1, 1600)] * 32):
        assert step_seconds(q, rows) == pytest.approx(2 * step_seconds(p, rows), rel=1e-9)
    assert q.kv_blocks(16) == p.kv_blocks(16) and q.model == p.model
    assert slowed(p, 1.0) == p
    # objectives derived from the slowed profile are the original's, scaled
    w = WORKLOADS["chat"]
    assert default_slos(q, w, 512)[1] == pytest.approx(
        2 * default_slos(p, w, 512)[1], abs=0.2
    )  # each rounded to 0.1
    with pytest.raises(ValueError, match="time-scale"):
        slowed(p, 0.0)


def _args(**kw: object) -> argparse.Namespace:
    base = dict(engine="sim", goodput_workload="summarization", goodput_duration_s=15.0,
                goodput_start_rate=1.0, goodput_max_rate=16.0, goodput_target=0.9,
                goodput_profile="llama3-70b-h200-tp2", goodput_gpus=8, goodput_splits="",
                goodput_time_scale=2.0)  # fmt: skip
    return argparse.Namespace(**(base | kw))


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"engine": "torch"}, "only --engine sim"),
        ({"goodput_workload": "code"}, "--goodput-workload"),
        ({"goodput_target": 1.5}, "--goodput-target"),
        ({"goodput_gpus": 7}, "multiple of"),
        ({"goodput_splits": "5P3D"}, "--goodput-splits"),
        ({"goodput_profile": "nope"}, "no such file"),
        ({"goodput_time_scale": -1.0}, "time-scale"),
    ],
)
def test_run_refuses_bad_flags_before_starting_anything(kw: dict[str, object], words: str) -> None:
    with pytest.raises(SystemExit, match=words):
        run(_args(**kw))
