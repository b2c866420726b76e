"""bench fleet's sweep: the rates it parses and the plot it draws (the live fleet runs in
tests/integration/test_sim_services.py and in the bench itself)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fleet import fleet_rates, plot


def test_fleet_rates_one_rate_or_a_sweep() -> None:
    assert fleet_rates(None, 7.0) == [7.0]
    assert fleet_rates("15, 30,60,", 7.0) == [15.0, 30.0, 60.0]
    for bad in ("fast", "30,-1", ","):
        with pytest.raises(SystemExit, match="--fleet-rates"):
            fleet_rates(bad, 7.0)


def test_fleet_plot_draws_a_png(tmp_path: Path) -> None:
    points = [
        {
            "routers": n,
            "offered_rps": r,
            "achieved_rps": min(r, 40.0 * n),
            "e2e_p50_ms": 50.0 * n,
            "e2e_p99_ms": None,
        }
        for n in (1, 2)
        for r in (15.0, 30.0, 60.0)
    ]
    path = tmp_path / "sub" / "fleet.png"
    plot(points, str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_longest_full_gc_pass_is_read_from_the_buckets() -> None:
    from collections import defaultdict

    from bench.fleet import _gc_full_max_ms

    passes: defaultdict[str | float, float] = defaultdict(float)
    assert _gc_full_max_ms(passes) is None  # no full pass
    passes.update({"count2": 3, 0.001: 0, 0.005: 2, 0.01: 2, 0.1: 3, float("inf"): 3})
    assert _gc_full_max_ms(passes) == 100.0  # the third pass fell between 10 and 100 ms
    passes.update({0.1: 2})
    assert _gc_full_max_ms(passes) == float("inf")
