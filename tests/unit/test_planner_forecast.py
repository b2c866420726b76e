"""The forecast law's rules (planner/forecast.py): the capacity table, the rate log, and the law itself —
sizing ahead from the previous period, the correction that only adds, the latency net, the outage, the
floor, the budget, no flip on noise. The rate log in a real Redis: tests/integration/test_planner_live.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from planner.forecast import CapacityRow, CapacityTable, ForecastConfig, ForecastPlanner, RateLog
from planner.main import forecast_from_args
from planner.policy import PlannerConfig, RoleSignals, Signals

TABLE = CapacityTable(
    [CapacityRow(25.0, 2, 1), CapacityRow(50.0, 3, 2), CapacityRow(75.0, 4, 2), CapacityRow(100.0, 5, 3)]
)
PERIOD = 3600.0  # an hour's period keeps the numbers small; the law is the same for a day


def signals(
    at: float, rps: float | None, span: float = 15.0, workers: tuple[int, int] = (8, 8),
    ttft: float | None = 0.2, tpot: float | None = 0.02,
) -> Signals:  # fmt: skip
    return Signals(
        at,
        RoleSignals(workers[0], ttft),
        RoleSignals(workers[1], tpot),
        rps,
        span if rps is not None else None,
    )


def yesterday(rate: Callable[[float], float]) -> RateLog:
    """A log whose period 0 saw rate(t) requests/s at each second t (recorded in 15 s reads)."""
    log = RateLog(PERIOD)
    t = 0.0
    while t < PERIOD:
        log.add(t, t + 15.0, rate(t) * 15.0)
        t += 15.0
    return log


def law(log: RateLog | None = None, **overrides: float) -> ForecastPlanner:
    return ForecastPlanner(
        PlannerConfig(**overrides), TABLE, log or RateLog(PERIOD), ForecastConfig(lead_s=75.0)
    )


# ---- the capacity table ---------------------------------------------------------------------------------


def test_a_rate_takes_the_first_row_at_or_above_it_and_beyond_the_last_says_so() -> None:
    assert TABLE.need(10.0) == (2, 1, False)
    assert TABLE.need(25.0) == (2, 1, False)
    assert TABLE.need(25.1) == (3, 2, False)
    assert TABLE.need(100.0) == (5, 3, False)
    assert TABLE.need(140.0) == (5, 3, True)


def test_a_higher_rate_never_needs_fewer_workers() -> None:
    t = CapacityTable([CapacityRow(10, 1, 3), CapacityRow(20, 2, 1), CapacityRow(30, 1, 4)])
    assert [(r.prefill, r.decode) for r in t.rows] == [(1, 3), (2, 3), (2, 4)]


@pytest.mark.parametrize(
    "data,says",
    [
        ({"rows": []}, "no rows"),
        ([{"rate_rps": 1, "prefill": 1}], "exactly rate_rps, prefill and decode"),
        ([{"rate_rps": 1, "prefill": 1.5, "decode": 1}], "whole numbers"),
        ([{"rate_rps": True, "prefill": 1, "decode": 1}], "rate_rps is a number"),
        ([{"rate_rps": 0, "prefill": 1, "decode": 1}], "positive"),
        ([{"rate_rps": 5, "prefill": 0, "decode": 1}], "at least one worker"),
        ([{"rate_rps": 5, "prefill": 1, "decode": 1}] * 2, "two rows"),
        ("25: 2, 1", "a capacity table is"),
    ],
)
def test_a_bad_table_is_a_clear_error(data: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        CapacityTable.from_json(data)


def test_a_table_file_round_trips_and_a_broken_one_names_itself(tmp_path: Path) -> None:
    path = tmp_path / "capacity.json"
    TABLE.save(str(path))
    assert CapacityTable.load(str(path)).rows == TABLE.rows
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"capacity table {path}"):
        CapacityTable.load(str(path))
    with pytest.raises(ValueError, match="No such file"):
        CapacityTable.load(str(tmp_path / "missing.json"))


# ---- the rate log ---------------------------------------------------------------------------------------


def test_a_read_is_spread_evenly_over_the_minutes_it_covers() -> None:
    log = RateLog(PERIOD)
    touched = log.add(30.0, 120.0, 90.0)  # 1 request/s over [0:30, 2:00)
    assert touched == [(0, 0), (0, 1)]
    assert log.periods[0][0] == pytest.approx([30.0, 30.0])
    assert log.periods[0][1] == pytest.approx([60.0, 60.0])
    assert log.rate(0, 1) == pytest.approx(1.0)
    assert log.rate(0, 0) == pytest.approx(1.0)  # half a minute observed is enough (MIN_COVER)
    log.add(200.0, 210.0, 50.0)  # 10 s of minute 3: too little to forecast from
    assert log.rate(0, 3) is None


def test_the_forecast_is_the_previous_periods_same_minute() -> None:
    log = yesterday(lambda t: 40.0 if 600 <= t < 720 else 20.0)
    assert log.forecast(PERIOD + 5.0) == pytest.approx(20.0)
    assert log.forecast(PERIOD + 650.0) == pytest.approx(40.0)
    assert log.forecast(650.0) is None  # period -1 was never seen
    # the highest over the lead: a burst 60 s ahead is in it
    assert log.forecast_ahead(PERIOD + 550.0, 75.0) == pytest.approx(40.0)
    assert log.forecast_ahead(PERIOD + 500.0, 75.0) == pytest.approx(20.0)


def test_a_read_across_a_period_boundary_fills_both_and_old_periods_go() -> None:
    log = RateLog(PERIOD, keep=2)
    assert log.add(PERIOD - 30.0, PERIOD + 30.0, 60.0) == [(0, 59), (1, 0)]
    log.add(2 * PERIOD, 2 * PERIOD + 60.0, 60.0)
    assert sorted(log.periods) == [1, 2]  # period 0 is older than the two kept
    assert log.add(10.0, 10.0, 5.0) == [] and log.add(10.0, 20.0, float("nan")) == []


def test_the_period_must_be_whole_minutes_and_two_are_kept_at_least() -> None:
    with pytest.raises(ValueError, match="whole number of minutes"):
        RateLog(90.0)
    with pytest.raises(ValueError, match="at least two periods"):
        RateLog(PERIOD, keep=1)


# ---- the law --------------------------------------------------------------------------------------------


def test_it_asks_for_a_forecast_rise_a_lead_ahead_and_gives_it_back_after() -> None:
    law_ = law(yesterday(lambda t: 80.0 if 600 <= t < 720 else 20.0))
    steps = {}
    for now in range(0, 900, 15):
        d = law_.step(signals(now, 20.0 if not 600 <= now < 720 else 80.0), now, PERIOD + now)
        steps[now] = (d.prefill, d.decode)
    assert steps[510] == (2, 1)  # 90 s before: not yet
    assert steps[525] == (5, 3)  # 75 s before the burst (start-up + one interval): its workers asked for
    assert steps[705] == (5, 3)
    assert steps[720] == (2, 1)  # the burst's last minute is past; nothing seen above the forecast


def test_with_nothing_recorded_it_keeps_the_floor_and_corrects_from_what_it_sees() -> None:
    law_ = law()
    d = law_.step(signals(0.0, 20.0), 0.0, 0.0)
    assert (d.prefill, d.decode) == (2, 1)  # the table's row for 20/s (seen, nothing forecast)
    assert d.inputs["forecast_rps"] is None and d.inputs["seen_rps"] == 20.0
    d = law_.step(signals(15.0, 60.0), 15.0, 15.0)  # the window (30 s) holds 20 and 60: 40/s
    assert (d.prefill, d.decode) == (3, 2)
    d = law_.step(signals(30.0, 60.0), 30.0, 30.0)  # 60/s
    assert (d.prefill, d.decode) == (4, 2) and "over the forecast" in d.reason
    # held for hold_s (120 s) after the last reading that asked, then back to what the rate needs
    for now in range(45, 150, 15):
        d = law_.step(signals(now, 10.0), now, now)
        assert (d.prefill, d.decode) == (4, 2), now
    d = law_.step(signals(150.0, 10.0), 150.0, 150.0)  # 45's reading (30 and 45: 35/s) still holds
    assert (d.prefill, d.decode) == (3, 2)
    d = law_.step(signals(165.0, 10.0), 165.0, 165.0)
    assert (d.prefill, d.decode) == (2, 1)


def test_a_rate_within_the_margin_of_the_forecast_adds_nothing() -> None:
    """The seen rate wanders around a table row's edge (noise); with a forecast of that rate it never
    corrects, so the count does not flip between two rows."""
    law_ = law(yesterday(lambda t: 25.0))
    counts = set()
    for i, now in enumerate(range(0, 1200, 15)):
        seen = 25.0 * (1.12 if (i // 4) % 2 else 0.88)  # a minute at +12 %, one at -12 %: under the margin
        d = law_.step(signals(now, seen), now, PERIOD + now)
        counts.add((d.prefill, d.decode))
    assert counts == {(2, 1)}


def test_a_forecast_within_its_counts_noise_over_a_row_is_that_rows() -> None:
    """Yesterday's minute is one Poisson draw: 25.9/s (1,554 requests, sigma ~39) against the 25/s row is
    within two standard deviations of it; 28/s is not."""
    d = law(yesterday(lambda t: 25.9)).step(signals(0.0, 25.0), 0.0, PERIOD)
    assert (d.prefill, d.decode) == (2, 1) and d.inputs["forecast_rps"] == pytest.approx(25.9)
    d = law(yesterday(lambda t: 28.0)).step(signals(0.0, 25.0), 0.0, PERIOD)
    assert (d.prefill, d.decode) == (3, 2)
    exact = ForecastPlanner(PlannerConfig(), TABLE, yesterday(lambda t: 25.9), ForecastConfig(noise_sigmas=0))
    d = exact.step(signals(0.0, 25.0), 0.0, PERIOD)
    assert (d.prefill, d.decode) == (3, 2)


def test_a_burst_yesterday_had_is_no_correction() -> None:
    """The rate seen is compared with the forecast of the minutes it was seen over, not only ahead: the
    end of a forecast burst is not taken for a new one."""
    law_ = law(yesterday(lambda t: 80.0 if 600 <= t < 720 else 20.0))
    for now in range(0, 900, 15):
        d = law_.step(signals(now, 80.0 if 600 <= now < 720 else 20.0), now, PERIOD + now)
        assert "over the forecast" not in d.reason, (now, d.reason)
        assert d.inputs["correction"] == {"prefill": 0, "decode": 0}
    stale = law_.step(signals(900.0, 20.0), 931.0, PERIOD + 931.0)  # read more than stale_s (30 s) ago
    assert "signals missing or stale" in stale.reason


def test_latency_over_target_all_window_with_every_worker_ready_adds_one_then_gives_it_back() -> None:
    law_ = law(yesterday(lambda t: 20.0))
    slow = dict(workers=(2, 1), ttft=3.0)
    d = None
    for now in range(0, 60, 15):
        d = law_.step(signals(now, 20.0, **slow), now, PERIOD + now)  # type: ignore[arg-type]
    assert d is not None and d.prefill == 3 and "one more" in d.reason
    assert d.inputs["extra"]["prefill"] == 1 and d.decode == 1
    # the new worker is starting (2 ready of 3): readings on fewer workers than asked are no evidence
    for now in range(60, 180, 15):
        d = law_.step(signals(now, 20.0, **slow), now, PERIOD + now)  # type: ignore[arg-type]
    assert d.prefill == 3
    # within target: one fewer after hold_s (120 s) without a reading over
    for now in range(180, 285, 15):  # the last reading over target was at 165
        d = law_.step(signals(now, 20.0, workers=(3, 1)), now, PERIOD + now)
        assert d.prefill == 3, now
    d = law_.step(signals(285.0, 20.0, workers=(3, 1)), 285.0, PERIOD + 285.0)
    assert d.prefill == 2 and "one extra fewer" in d.reason


def test_an_outage_follows_the_forecast_up_and_never_goes_below_the_last_decision() -> None:
    law_ = law(yesterday(lambda t: 80.0 if t >= 600 else 50.0))
    d = law_.step(signals(0.0, 50.0), 0.0, PERIOD)
    assert (d.prefill, d.decode) == (3, 2)
    d = law_.step(None, 45.0, PERIOD + 45.0)
    assert (d.prefill, d.decode) == (3, 2) and "signals missing" in d.reason
    d = law_.step(None, 540.0, PERIOD + 540.0)  # the forecast rise ahead: asked for, outage or not
    assert (d.prefill, d.decode) == (5, 3)
    law2 = law(yesterday(lambda t: 80.0 if t < 600 else 20.0))
    law2.step(signals(590.0, 80.0), 590.0, PERIOD + 590.0)
    d = law2.step(None, 700.0, PERIOD + 700.0)  # the forecast falls, but an outage is no evidence of it
    assert (d.prefill, d.decode) == (5, 3)
    d = law2.step(signals(715.0, 20.0), 715.0, PERIOD + 715.0)  # signals back: it follows the forecast
    assert (d.prefill, d.decode) == (2, 1)


def test_never_below_the_minimum_nor_above_the_maximum_or_the_budget() -> None:
    d = law(min_prefill=3, min_decode=2).step(signals(0.0, None), 0.0, 0.0)
    assert (d.prefill, d.decode) == (3, 2)
    d = law(max_prefill=4).step(signals(0.0, 500.0), 0.0, 0.0)
    assert (d.prefill, d.decode) == (4, 3) and d.inputs["beyond_table"] is True
    # over the budget, the role further under its latency target gives way
    d = law(budget=6).step(signals(0.0, 100.0, tpot=0.01, ttft=0.9), 0.0, 0.0)
    assert (d.prefill, d.decode) == (5, 1)
    d = law(budget=6).step(signals(0.0, 100.0, tpot=0.049, ttft=0.1), 0.0, 0.0)
    assert (d.prefill, d.decode) == (3, 3)


def test_what_it_reads_is_recorded_for_the_next_period() -> None:
    log = RateLog(PERIOD)
    law_ = law(log)
    for now in range(15, int(PERIOD) + 1, 15):
        law_.step(signals(now, 30.0), now, float(now))
    assert law_.touched == [(0, 59)]
    assert log.forecast(PERIOD + 100.0) == pytest.approx(30.0)
    d = law_.step(signals(PERIOD + 100.0, 30.0), PERIOD + 100.0, PERIOD + 100.0)
    assert d.inputs["forecast_rps"] == pytest.approx(30.0) and (d.prefill, d.decode) == (3, 2)


def test_bad_settings_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lead_s"):
        ForecastConfig(lead_s=-1)
    with pytest.raises(ValueError, match="margin"):
        ForecastConfig(margin=-0.1)
    with pytest.raises(ValueError, match="noise_sigmas"):
        ForecastConfig(noise_sigmas=-1)

    class Args:
        law, capacity_table = "forecast", None
        forecast_lead_s, forecast_period_s = 75.0, 86400.0

    with pytest.raises(ValueError, match="needs --capacity-table"):
        forecast_from_args(Args(), PlannerConfig(), True)  # type: ignore[arg-type]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TABLE.as_json()))
    Args.capacity_table = str(path)  # type: ignore[assignment]
    assert forecast_from_args(Args(), PlannerConfig(), True) is not None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs --router-url or --discover-routers"):
        forecast_from_args(Args(), PlannerConfig(), False)  # type: ignore[arg-type]
    Args.law = "guess"
    with pytest.raises(ValueError, match="reactive or forecast"):
        forecast_from_args(Args(), PlannerConfig(), True)  # type: ignore[arg-type]
