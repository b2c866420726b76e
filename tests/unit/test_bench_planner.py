"""`splitserve bench planner`'s virtual-time fleet (bench/fleet_model.py) and its figures (bench/planner.py):
the decode runs timed in closed form against the profile's per-step roofline added up step by step, one
request's TTFT and TPOT by hand, a fixed split that meets the SLO under light load and one that cannot,
the real Planner deciding every interval (decision count, the outage rule, draining), the flip count and
the fixed-split search."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.fleet_model import DecodeCost, Fleet, FleetConfig, Request
from bench.planner import (
    DRAIN_S,
    WARMUP_S,
    PlannerRun,
    ScheduledRun,
    Targets,
    Trace,
    below_min,
    best_fixed,
    capacity_table,
    flips,
    forecast_period_s,
    frontier,
    minute_rates,
    p90,
    plot_frontier,
    replay_forecast,
    replay_planner,
    run_fixed,
    share,
    steady_need,
    table_rates,
    windows,
)
from common.engine.sim_profile import SimProfile, step_seconds
from planner.forecast import CapacityRow, CapacityTable, RateLog
from planner.policy import PlannerConfig

PROFILE = SimProfile.load("llama3-8b-h100")
CFG = FleetConfig(PROFILE)
TARGETS = Targets(1.0, 0.05)


@pytest.mark.parametrize("batch,context", [(1, 100), (200, 50), (256, 300_000), (3, 0)])
def test_decode_runs_add_up_the_per_step_roofline(batch: int, context: int) -> None:
    cost = DecodeCost(PROFILE)
    lines = cost.lines(batch, context)
    total, per_token = 0.0, context // batch
    rows = [(1, per_token)] * (batch - 1) + [(1, context - per_token * (batch - 1))]
    for j in range(1, 400):
        total += step_seconds(PROFILE, rows)
        rows = [(1, c + 1) for _, c in rows]
        if j in (1, 7, 399):
            assert cost.run_seconds(lines, j) == pytest.approx(total, rel=1e-9)
    assert cost.step(batch, context) == pytest.approx(cost.run_seconds(lines, 1), rel=1e-12)
    assert cost.run_seconds(lines, 0) == 0.0


def test_the_compute_and_memory_terms_cross_inside_a_run() -> None:
    """A large batch with little context starts compute-bound and becomes memory-bound as its KV grows:
    the closed form switches lines once, where the steps do."""
    cost = DecodeCost(PROFILE)
    a1, b1, a2, b2 = cost.lines(256, 0)
    assert a1 > a2 and b2 > b1  # starts on compute, memory overtakes
    crossing = (a1 - a2) / (b2 - b1)
    j = int(crossing) + 50
    by_step = sum(cost.step(256, 256 * k) for k in range(j))
    assert cost.run_seconds((a1, b1, a2, b2), j) == pytest.approx(by_step, rel=1e-9)


def reference(arrivals: list[tuple[float, int, int]]) -> tuple[dict[int, tuple[float, float]], int]:
    """One prefill and one decode worker stepped one step at a time with step_seconds over the rows:
    each request's (first token, last token), and the decode steps taken."""
    t, firsts = 0.0, {}
    for i, (at, prompt, _) in enumerate(arrivals):  # arrivals far enough apart: one prompt per step
        t = max(t, at) + step_seconds(PROFILE, [(prompt, 0)])
        firsts[i] = t
    kv_in = {i: firsts[i] + CFG.transfer_s(arrivals[i][1]) for i in firsts}
    out: dict[int, tuple[float, float]] = {}
    running: dict[int, list[int]] = {}  # i -> [cached tokens, tokens still to make]
    t, steps = min(kv_in.values()), 0
    while len(out) < len(arrivals):
        for i in sorted(kv_in):
            if kv_in[i] <= t and i not in running and i not in out:
                running[i] = [arrivals[i][1], arrivals[i][2] - 1]
        if not running:
            t = min(v for i, v in kv_in.items() if i not in out)
            continue
        t += step_seconds(PROFILE, [(1, c) for c, _ in running.values()])
        steps += 1
        for i in list(running):
            running[i][0] += 1
            running[i][1] -= 1
            if running[i][1] == 0:
                out[i] = (firsts[i], t)
                del running[i]
    return out, steps


def test_one_worker_each_times_requests_as_the_steps_add_up() -> None:
    """Three requests, the later ones joining the first's decode run part way (their KV arriving mid-run
    ends the run early at a step boundary): TTFT and TPOT as a step-by-step replay gives them."""
    arrivals = [(0.0, 1000, 50), (0.3, 2000, 30), (0.55, 500, 80)]
    fleet = Fleet(CFG, 1, 1)
    fleet.run(arrivals, until=60.0)
    want, steps = reference(arrivals)
    for i, r in enumerate(fleet.requests):
        first, last = want[i]
        assert r.ttft == pytest.approx(first - arrivals[i][0], rel=1e-9)
        assert r.tpot == pytest.approx((last - first) / (arrivals[i][2] - 1), rel=1e-9)
    assert fleet.decode_steps == steps < 50 + 30 + 80 - 3  # the runs overlapped: shared steps


def test_a_fixed_split_meets_the_slo_under_light_load_and_not_when_overloaded() -> None:
    light = Trace(12, 2.0, seed=1)
    r = run_fixed(CFG, light, TARGETS, 1, 1)
    assert r["slo_windows_met"] == 1.0 and r["worker_minutes"] == pytest.approx(2 * 12)
    heavy = Trace(12, 60.0, seed=1)  # bursts at 2.5x of 15/s and a peak of 60/s on one worker each
    r = run_fixed(CFG, heavy, TARGETS, 1, 1)
    assert r["slo_windows_met"] < 0.5, r


def test_the_planner_decides_every_interval_holds_through_the_outage_and_drains() -> None:
    trace = Trace(12, 20.0, seed=2)
    cfg = PlannerConfig(budget=6, max_prefill=4, max_decode=4)
    outage = (300.0, 420.0)
    pr = PlannerRun(cfg, outage)
    fleet = Fleet(CFG, 1, 1, at=-WARMUP_S)
    fleet.run(trace.arrivals, trace.duration_s + DRAIN_S, pr.tick, 15.0)
    assert len(pr.decisions) == int((WARMUP_S + trace.duration_s + DRAIN_S) / 15)
    during = [d for d in pr.decisions if d[3]]
    assert len(during) == 8 and {(p, d) for _, p, d, _ in during} == {during[0][1:3]}
    before = [d for d in pr.decisions if d[0] < outage[0]][-1]
    assert during[0][1:3] == before[1:3]  # held what it had decided last
    assert not below_min(fleet, cfg, *outage)
    assert max(p for _, p, _, _ in pr.decisions) > 1  # the load made it scale
    for w in fleet.workers:  # every worker scaled away finished its work and went
        if w.draining:
            assert w.gone_at is not None and w.empty()
    assert all(r.done_at is not None for r in fleet.requests)
    assert share(windows(fleet, trace, TARGETS), "ttft_ok", "tpot_ok") > 0.5


def test_below_min_sees_a_fleet_under_its_floor() -> None:
    fleet = Fleet(CFG, 2, 1)
    fleet.run([], until=10.0)
    cfg = PlannerConfig(min_prefill=2)
    assert not below_min(fleet, cfg, 5.0, 10.0)
    fleet.now = 6.0
    fleet.scale("prefill", 1)  # an idle worker goes at once
    assert below_min(fleet, cfg, 5.0, 10.0) and not below_min(fleet, cfg, 0.0, 5.0)


def test_a_draining_decode_worker_finishes_its_sequences_and_takes_no_new_ones() -> None:
    fleet = Fleet(CFG, 1, 2)
    fleet.run([(0.0, 1000, 400), (0.0, 1000, 400)], until=1.0)
    busy = [w for w in fleet.workers if w.role == "decode" and w.held]
    assert len(busy) == 2  # one each: the most free blocks
    fleet.scale("decode", 1)
    gone = next(w for w in fleet.workers if w.draining)
    assert gone.gone_at is None and gone not in fleet.ready("decode")
    fleet.run([(2.0, 500, 20)], until=60.0)
    assert gone.gone_at is not None and all(r.done_at is not None for r in fleet.requests)
    assert fleet.worker_seconds(0, 60) == pytest.approx(60 + 60 + gone.gone_at)


def test_flips_count_direction_changes_within_a_steady_stretch() -> None:
    trace = Trace(12, 1.0, seed=0)
    steady = trace.steady()[-1]  # the last plateau, after the second burst
    t0 = steady.start
    decisions = [(t0 - 100, 2, 1, False), (t0 - 50, 3, 1, False)]  # up before the stretch
    decisions += [(t0 + 10, 2, 1, False), (t0 + 20, 3, 1, False), (t0 + 30, 2, 1, False)]
    n, minutes = flips(decisions, trace)
    # down answering the earlier up is no flip; then up, then down again within the stretch: two
    assert n == 2 and minutes == pytest.approx(sum(s.end - s.start for s in trace.steady()) / 60)


def test_best_fixed_search_finds_the_fewest_workers_meeting_the_goal() -> None:
    """A made-up fleet: TTFT needs 3 prefill, TPOT 2 decode, and 3 + 2 together misses by a little, so
    one more worker of either role is needed: the search returns a 6-worker split."""

    def evaluate(p: int, d: int) -> dict[str, object]:
        ttft, tpot = (1.0 if p >= 3 else 0.5), (1.0 if d >= 2 else 0.4)
        both = 0.9 if (p, d) == (3, 2) else min(ttft, tpot)
        return {"prefill": p, "decode": d, "workers": p + d, "slo_windows_met": both,
                "ttft_windows_met": ttft, "tpot_windows_met": tpot}  # fmt: skip

    best, table = best_fixed(evaluate, 8, 8)
    assert best is not None and best["workers"] == 6
    assert len(table) < 16 and all(r["workers"] >= 3 for r in table)
    none, _ = best_fixed(lambda p, d: {**evaluate(p, d), "ttft_windows_met": 0.0}, 8, 8)
    assert none is None


def test_invalid_inputs_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        Fleet(CFG, 0, 1)
    with pytest.raises(ValueError, match="12 minutes"):
        Trace(5, 10.0, seed=0)
    with pytest.raises(ValueError, match="output tokens"):
        Request(0.0, 100, 1)
    with pytest.raises(ValueError, match="decode_max_seqs"):
        FleetConfig(PROFILE, decode_max_seqs=0)
    with pytest.raises(ValueError, match="time order"):
        Fleet(CFG, 1, 1).run([(1.0, 100, 10), (0.5, 100, 10)], until=5.0)


def test_p90_is_nearest_rank_and_keeps_an_unfinished_request_infinite() -> None:
    assert p90([]) is None
    assert p90([float(x) for x in range(1, 11)]) == 9.0
    assert p90([0.1] * 9 + [math.inf]) == 0.1 and p90([0.1] * 8 + [math.inf] * 2) == math.inf


def test_the_fleet_gives_the_utilization_signals_the_live_reader_builds() -> None:
    """The prompt-token counter (at the first token), each prefill worker's measured speed (the engine's
    EWMA over its steps, weight 0.2), the queued prompt tokens and the decode sequences held; and the
    planner run hands them over as the live reader does."""
    fleet = Fleet(CFG, 1, 1)
    assert fleet.prefill_capacity() is None and fleet.prompt_tokens == 0
    fleet.run([(0.0, 4096, 300), (0.001, 2000, 300), (0.002, 3000, 300)], until=0.05)
    assert fleet.queued_tokens() == 4096 + 2000 + 3000  # the first step (the first prompt) still runs
    assert fleet.prompt_tokens == 0  # counted at the first token, as the router does
    fleet.run([], until=2.0)
    assert fleet.queued_tokens() == 0 and fleet.running() == 3
    assert fleet.prompt_tokens == 4096 + 2000 + 3000
    first = 4096 / step_seconds(PROFILE, [(4096, 0)])  # then the two that queued behind it, together
    second = 5000 / step_seconds(PROFILE, [(2000, 0), (3000, 0)])
    speed = fleet.ready("prefill")[0].speed  # the engine's own StepSpeed, fed each step
    assert speed.prefill_tps == pytest.approx(first + 0.2 * (second - first), rel=1e-9)
    pr = PlannerRun(PlannerConfig(), (1e9, 1e9))
    pr.tick(15.0, fleet)
    pr.tick(30.0, fleet)
    inputs = pr.planner.last.inputs if pr.planner.last else {}
    assert inputs["decode"]["demand"] == 3.0 and inputs["decode"]["per_worker"] == CFG.decode_max_seqs
    # two steps are too few for the fit of step time against tokens: capacity is the average until then
    assert inputs["prefill"]["per_worker"] == fleet.prefill_capacity() == speed.prefill_tps
    assert inputs["prefill"]["demand"] == 0.0


def test_the_fleets_prefill_capacity_is_a_full_step_by_the_fit_of_its_steps() -> None:
    """Prompts of spread sizes one at a time: each worker fits its steps' time against their tokens, as
    the engine does, and its capacity is a full step's tokens per second by that fit, above the
    average of its small steps (the profile's roofline has a fixed part: the weights read once)."""
    fleet = Fleet(CFG, 1, 1)
    sizes = [512, 4096, 1024, 256, 2048, 8000]
    fleet.run([(i * 1.0, n, 20) for i, n in enumerate(sizes)], until=len(sizes) + 5.0)
    speed = fleet.ready("prefill")[0].speed
    assert speed.prefill_ms_per_token > 0  # fitted
    full = CFG.prefill_tokens_per_step / step_seconds(PROFILE, [(CFG.prefill_tokens_per_step, 0)])
    assert fleet.prefill_capacity() == pytest.approx(full, rel=0.05)
    assert fleet.prefill_capacity() > speed.prefill_tps


def test_the_steady_table_grows_with_the_rate() -> None:
    """At a low constant rate one worker of each role meets both targets; at a rate past one prefill
    worker's prompt tokens per second (~1,400 tokens a prompt against ~33k tokens/s) it takes two."""
    need = steady_need(CFG, TARGETS, [5.0, 40.0], max_prefill=4, max_decode=4, seed=3)
    assert need[5.0] == (1, 1)
    assert need[40.0][0] >= 2 and need[40.0][1] >= 1
    assert all(1 <= p <= 4 and 1 <= d <= 4 for p, d in need.values())


class _Recorder:
    """What a schedule asked a fleet for (only `scale` is called)."""

    def __init__(self) -> None:
        self.asked: dict[str, int] = {}

    def scale(self, role: str, n: int) -> None:
        self.asked[role] = n


def test_a_schedule_asks_a_start_up_ahead_for_the_next_grid_rate_at_or_above() -> None:
    need = {10.0: (1, 1), 20.0: (2, 1), 30.0: (3, 2)}
    sched = ScheduledRun(lambda t: 10.0 if t < 100 else 25.0, capacity_table(need), lead_s=60.0)
    assert sched.need_at(0.0) == (1, 1) and sched.need_at(100.0) == (3, 2)  # 25 -> the 30 row
    fleet = _Recorder()
    sched.tick(10.0, fleet)  # type: ignore[arg-type]
    assert fleet.asked == {"prefill": 1, "decode": 1}  # the rise at 100 s is more than 60 s away
    sched.tick(45.0, fleet)  # type: ignore[arg-type]
    assert fleet.asked == {"prefill": 3, "decode": 2}  # within 60 s: asked for now
    above = ScheduledRun(lambda t: 99.0, capacity_table(need), lead_s=0.0)
    assert above.need_at(0.0) == (3, 2)  # past the table: its last row


def test_yesterdays_rates_are_its_requests_counted_per_minute_warm_up_included() -> None:
    day = Trace(12, 8.0, seed=5)
    rate = minute_rates(day)
    counted = sum(rate(m * 60.0 + 30) * 60 for m in range(-int(WARMUP_S // 60), 12))
    assert counted == pytest.approx(len(day.arrivals))  # every request in exactly one minute
    burst = [a for a in day.arrivals if 60 <= a[0] < 120]  # the first burst: 60-96 s
    assert rate(60.0) == rate(119.9) == len(burst) / 60
    assert rate(-1e6) == rate(-WARMUP_S) and rate(1e6) == rate(11 * 60.0)  # outside: the nearest minute
    assert rate(60.0) > 1.5 * rate(0.0)  # the burst's minute against the plateau's before it


def test_the_frontier_replays_every_setting_on_the_same_trace(tmp_path: Path) -> None:
    trace = Trace(12, 8.0, seed=4)
    pcfg = PlannerConfig(budget=8, max_prefill=4, max_decode=4)
    planner = replay_planner(CFG, trace, pcfg, (300.0, 360.0), 15.0)
    need = steady_need(CFG, TARGETS, table_rates(trace), pcfg.max_prefill, pcfg.max_decode, trace.seed)
    fleet, pr, _ = replay_forecast(CFG, trace, pcfg, capacity_table(need), RateLog(3600.0), 0, (0, 0), 15.0)
    out = frontier(
        CFG, trace, TARGETS, pcfg, (300.0, 360.0), 15.0, 12 * 8, planner, need, [("forecast", fleet, pr)]
    )
    points = {p["label"]: p for p in out["points"]}
    assert list(points)[:2] == ["the reactive law (defaults)", "forecast"]
    assert len(points) == len(out["points"]) == 11
    assert points["schedule that knows the rate"]["slo_windows_met"] == 1.0  # its table holds every rate
    n, steady_min = flips([d for d in planner[1].decisions if d[0] >= 0], trace)
    assert points["the reactive law (defaults)"]["flips_per_10min_steady"] == round(n / steady_min * 10, 3)
    # flat on every steady stretch, so it never turns within one
    assert points["schedule that knows the ramps, not the bursts"]["flips_per_10min_steady"] == 0
    for p in out["points"]:
        assert 0 <= p["slo_windows_met"] <= 1 and p["worker_minutes_ratio"] > 0
        assert len(p["failed_windows"]) == round((1 - p["slo_windows_met"]) * 12)
    rates = [r["rate_rps"] for r in out["steady_need"]]
    assert rates == sorted(rates) and rates[0] == pytest.approx(trace.rate(0.0)) and rates[-1] == 8.0
    plot_frontier(out["points"], str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_the_forecast_law_records_yesterday_and_asks_for_todays_burst_before_it_comes() -> None:
    """Yesterday (another draw of the same shape), replayed under the forecast law with nothing recorded,
    leaves every arrival in the log; today, forecast from it, the burst's workers are asked for a lead
    (start-up plus interval) before the burst's minute, where the first day asked for them only once it
    saw the burst."""
    trace = Trace(12, 8.0, seed=4)  # the first burst: 60-96 s, 5 requests/s over 2
    table = CapacityTable([CapacityRow(3.0, 1, 1), CapacityRow(8.0, 2, 2)])  # the plateau: 2/s
    pcfg = PlannerConfig(budget=8, max_prefill=4, max_decode=4)
    log = RateLog(forecast_period_s(trace, 15.0))
    yesterday = Trace(12, 8.0, seed=4 + 100)
    _, day0, _ = replay_forecast(CFG, yesterday, pcfg, table, log, 0, (0.0, 0.0), 15.0)
    recorded = sum(slot[0] for slot in log.periods[0].values())
    first_read = day0.decisions[0][0]  # the counter's baseline: what came before it is not counted
    assert recorded == pytest.approx(len([a for a in yesterday.arrivals if a[0] >= first_read]))
    _, today, _ = replay_forecast(CFG, trace, pcfg, table, log, 1, (0.0, 0.0), 15.0)
    _, first, _ = replay_forecast(CFG, trace, pcfg, table, RateLog(log.period_s), 0, (0.0, 0.0), 15.0)
    asked = {t: (p, d) for t, p, d, _ in today.decisions}
    assert asked[-15.0] == (2, 2) and asked[-30.0] == (1, 1)  # 75 s before minute 1 (60 s)
    assert dict((t, (p, d)) for t, p, d, _ in first.decisions)[-15.0] == (1, 1)
    assert max(p for t, p, _, _ in first.decisions if 60 <= t < 120) == 2  # seen, then corrected


def test_the_bench_reports_the_chosen_laws_figures_and_every_laws(tmp_path: Path) -> None:
    """`splitserve bench planner` end to end on a short, light trace: the top-level figures are
    --planner-law's, `laws` has the forecast law's (today, and the first day) and the reactive law's, the
    capacity table is written where asked and is what the JSON says. --planner-profile: a profile file
    (as `splitserve sim-calibrate` writes one) is the fleet's, so the table is that hardware's: a 70B
    model on two H200s needs at least the workers an 8B on one H100 needs at every rate, more at the top."""
    import argparse
    import json
    import shutil

    from bench.planner import run
    from common.engine.sim_profile import PROFILE_DIR

    args = argparse.Namespace(
        out=str(tmp_path), seed=4, planner_minutes=12.0, planner_peak_rps=8.0, planner_interval_s=15.0,
        planner_startup_s=60.0, planner_outage_min=1.0, planner_budget=8, planner_max_role=4,
        planner_ttft_s=1.0, planner_tpot_s=0.05, planner_frontier=False, planner_law="reactive",
        planner_capacity_out=str(tmp_path / "t" / "capacity.json"),
    )  # fmt: skip
    out = run(args)
    assert out["profile"] == "llama3-8b-h100"  # the default
    assert set(out["laws"]) == {"forecast", "forecast_first_day", "reactive"}
    for key in (
        "slo_windows_met",
        "worker_minutes_ratio",
        "flips_per_10min_steady",
        "below_min_during_outage",
    ):
        assert out[key] == out["laws"]["reactive"][key]
    assert (
        out["law"] == "reactive"
        and out["planner"]["failed_windows"] == out["laws"]["reactive"]["failed_windows"]
    )
    written = json.loads((tmp_path / "t" / "capacity.json").read_text())
    assert written["rows"] == out["capacity_table"] and out["capacity_table"][0]["rate_rps"] == 2.0
    assert (tmp_path / "planner.png").stat().st_size > 10_000
    assert out["laws"]["forecast"]["below_min_during_outage"] is False
    given = tmp_path / "mine.json"
    shutil.copy(PROFILE_DIR / "llama3-70b-h200-tp2.json", given)
    args.planner_profile, args.planner_capacity_out, args.planner_law = str(given), None, "forecast"
    large_out = run(args)
    assert large_out["profile"] == str(given)
    small = {r["rate_rps"]: r["prefill"] + r["decode"] for r in out["capacity_table"]}
    large = {r["rate_rps"]: r["prefill"] + r["decode"] for r in large_out["capacity_table"]}
    assert set(small) == set(large)
    assert all(large[rate] >= small[rate] for rate in small)
    assert large[max(small)] > small[max(small)], (small, large)
