"""`splitserve bench planner`: the planner's two laws (planner/policy.py, the reactive `Planner`;
planner/forecast.py, the `ForecastPlanner`) against the best fixed split, on one bursty trace replayed in
virtual time over a simulated fleet (bench/fleet_model.py: per-worker continuous batching timed by a sim
profile's roofline: `--planner-profile`, llama3-8b-h100 by default).

The trace (`--planner-minutes`, 60 by default, after 15 minutes of warm-up at the opening rate that no
figure counts): a low plateau (a quarter of `--planner-peak-rps`) with a 2-minute burst at 2.5x, a cosine
ramp up to the peak, a peak plateau, a ramp down to half the peak, and a plateau there with a 2-minute burst
at 2x; each stretch a fixed share of the trace. Poisson arrivals; prompts lognormal around 1024 tokens
(128..8192), outputs lognormal around 192 (16..1024); all drawn from --seed. Both sides replay the same
requests and are judged against the same targets.

- The planner run: the fleet starts at the planner's minimum at the warm-up's start; every
  `--planner-interval-s` the planner gets the signals the live reader builds (planner/signals.py) from the
  virtual fleet: p90 TTFT of the first tokens and p90 TPOT of the requests finished since the last read,
  the ready workers of each role, the prompts queued on prefill workers, the sequences waiting for decode
  admission and the decode workers' KV occupancy; and the utilization signals: the prompt tokens per
  second since the last read (counted at the first token, as the router's counter is), the prefill
  workers' measured speed (the engine's EWMA of its steps' tokens per second) and queued prompt tokens,
  the decode sequences admitted against `decode_max_seqs`, and the requests finished per second (the
  TPOT histogram's count). Its decision is applied at once (new workers ready after
  `--planner-startup-s`, removed ones drain). For `--planner-outage-min` minutes in the peak plateau the
  signals are missing (the planner gets None, as from a failed read).
- The forecast law's runs: the same signals plus the arrivals between two reads (the router's arrivals
  counter). Its capacity table is the steady table (below: `--planner-capacity-out` writes it). Yesterday,
  the same trace shape drawn with seed + YESTERDAY_SEED, is replayed first under the law with nothing
  recorded, its clock one period (`forecast_period_s`) behind today's; today is then forecast from the
  law's own record of it; and today once more with an empty record (`forecast_first_day`, the first day).
- The best fixed split: the fewest workers (prefill + decode, each at most the planner's per-role maximum)
  whose run meets the SLO in at least 95% of the windows. Found by search, not by trying every split: the
  fewest prefill workers whose TTFT meets target in 95% of windows with the most decode workers, the
  fewest decode workers whose TPOT does with the most prefill workers, then that pair and, while it falls
  short, pairs of one more worker (every run is in `sweep`).

Figures (JSON; the top-level ones are `--planner-law`'s, forecast by default, and `laws` has each law's:
`forecast`, `forecast_first_day`, `reactive`):
- `slo_windows_met`: the planner run's share of 1-minute windows (by arrival) whose requests' TTFT p90 and
  TPOT p90 are within target (a request not finished when the replay ends counts as over target);
  goal >= 0.95.
- `worker_minutes_ratio`: the planner's worker-minutes (starting and draining workers included) over the
  best fixed split's, over the trace; goal <= 0.8.
- `flips_per_10min_steady`: direction changes of either role's decided count per 10 minutes of the steady
  stretches (the plateaus, less the bursts), counting a change only when the change before it, of the same
  role, was in the same stretch (a scale-down after a burst answers the burst, not a flip); goal <= 1.
- `below_min_during_outage`: whether the ready workers of a role were below its minimum at any instant of
  the outage; goal false.

`--planner-frontier` (`frontier` in the JSON, a plot in planner_frontier.png): where SLO windows and
worker-minutes trade on this trace. The same requests replayed under other settings of the planner (its
utilization targets, a floor at the capacity the first burst needs, a shorter start-up) and under three
schedules that read no signal but know the rate ahead: the whole trace's, yesterday's (the same shape drawn
with another seed, counted per minute: a forecast from a day that repeats) and the ramps' without the
bursts. A schedule asks, at every decision, for the most workers that the rates of the next start-up plus
interval need by a steady table: for each rate on a grid (eighths of the peak), the fewest prefill
workers that meet the TTFT target in every window of 10 minutes at that constant rate (with the most
decode workers), and the fewest decode workers that meet TPOT's (with the most prefill workers). Each
point: `slo_windows_met`, `worker_minutes_ratio` (over the same best fixed split), the windows missed and
`flips_per_10min_steady` (a schedule's asks counted as the planner's decisions are).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from bench.fleet_model import Fleet, FleetConfig
from bench.plots import pyplot, save
from bench.rounds import load_avg
from common.engine.sim_profile import SimProfile
from planner.forecast import CapacityRow, CapacityTable, ForecastConfig, ForecastPlanner, RateLog
from planner.policy import Decision, Planner, PlannerConfig, RoleSignals, Signals

PROFILE = "llama3-8b-h100"
WARMUP_S = 900.0
DRAIN_S = 180.0  # the replay runs this long past the trace, so late requests finish and count
SLO_GOAL = 0.95


@dataclass(frozen=True)
class Stretch:
    start: float
    end: float
    kind: str  # "steady", "ramp" or "burst"


def with_lengths(rng: np.random.Generator, times: Any) -> list[tuple[float, int, int]]:
    """(arrival, prompt tokens, output tokens) for each arrival time: prompts lognormal around 1024
    tokens (128..8192), outputs around 192 (16..1024), together at most 8192."""
    outputs = np.clip(rng.lognormal(math.log(192), 0.7, len(times)), 16, 1024).astype(int)
    prompts = np.clip(rng.lognormal(math.log(1024), 0.8, len(times)), 128, 8192).astype(int)
    prompts = np.minimum(prompts, 8192 - outputs)
    return [(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs, strict=True)]


@dataclass(frozen=True)
class Trace:
    """The rate over time (module doc) and the requests drawn from it."""

    minutes: float
    peak_rps: float
    seed: int
    stretches: tuple[Stretch, ...] = field(init=False)
    arrivals: list[tuple[float, int, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.minutes >= 12:
            raise ValueError(f"the trace needs 12 minutes or more, got {self.minutes}")
        if not self.peak_rps > 0:
            raise ValueError(f"the peak rate must be positive, got {self.peak_rps}")
        T = self.minutes * 60
        b1, b2 = T / 12, T * 5 / 6
        burst = min(120.0, T / 20)
        stretches = (
            Stretch(-WARMUP_S, 0, "steady"),
            Stretch(0, b1, "steady"),
            Stretch(b1, b1 + burst, "burst"),
            Stretch(b1 + burst, T / 6, "steady"),
            Stretch(T / 6, T / 3, "ramp"),
            Stretch(T / 3, T * 7 / 12, "steady"),
            Stretch(T * 7 / 12, T * 3 / 4, "ramp"),
            Stretch(T * 3 / 4, b2, "steady"),
            Stretch(b2, b2 + burst, "burst"),
            Stretch(b2 + burst, T, "steady"),
        )
        object.__setattr__(self, "stretches", stretches)
        object.__setattr__(self, "arrivals", self._draw())

    @property
    def duration_s(self) -> float:
        return self.minutes * 60

    def rate(self, t: float) -> float:
        base = self.base_rate(t)
        for s in self.stretches:
            if s.kind == "burst" and s.start <= t < s.end:
                return base * (2.5 if t < self.duration_s / 2 else 2.0)
        return base

    def base_rate(self, t: float) -> float:
        """The rate without the bursts: the plateaus and ramps alone."""
        T, peak = self.duration_s, self.peak_rps
        low, high, mid = 0.25 * peak, peak, 0.5 * peak

        def ramp(a: float, b: float, t0: float, t1: float) -> float:
            x = (t - t0) / (t1 - t0)
            return a + (b - a) * (1 - math.cos(math.pi * x)) / 2

        if t < T / 6:
            base = low
        elif t < T / 3:
            base = ramp(low, high, T / 6, T / 3)
        elif t < T * 7 / 12:
            base = high
        elif t < T * 3 / 4:
            base = ramp(high, mid, T * 7 / 12, T * 3 / 4)
        else:
            base = mid
        return base

    def _draw(self) -> list[tuple[float, int, int]]:
        """Poisson arrivals by thinning at the highest rate; prompt and output lengths (module doc)."""
        rng = np.random.default_rng(self.seed)
        top = 2.5 * self.peak_rps
        span = self.duration_s + WARMUP_S
        gaps = rng.exponential(1 / top, size=int(span * top * 1.2) + 100)
        times = np.cumsum(gaps) - WARMUP_S
        times = times[times < self.duration_s]
        keep = rng.random(len(times)) * top < np.array([self.rate(t) for t in times])
        return with_lengths(rng, times[keep])

    def steady(self) -> list[Stretch]:
        return [s for s in self.stretches if s.kind == "steady" and s.start >= 0]

    def in_kind(self, t: float, kind: str) -> bool:
        return any(s.kind == kind and s.start <= t < s.end for s in self.stretches)


def p90(xs: list[float]) -> float | None:
    """The nearest-rank 90th percentile (an infinite value, an unfinished request, stays infinite)."""
    if not xs:
        return None
    return sorted(xs)[math.ceil(0.9 * len(xs)) - 1]


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    tpot_s: float


class HasDuration(Protocol):
    @property
    def duration_s(self) -> float: ...


def windows(fleet: Fleet, trace: HasDuration, targets: Targets) -> list[dict[str, Any]]:
    """Per 1-minute window of arrivals in [0, trace end): TTFT and TPOT p90 and whether both are within
    target (an unfinished request counts as infinitely late)."""
    n = math.ceil(trace.duration_s / 60)
    ttft: list[list[float]] = [[] for _ in range(n)]
    tpot: list[list[float]] = [[] for _ in range(n)]
    for r in fleet.requests:
        if r.arrival < 0:
            continue
        i = int(r.arrival // 60)
        ttft[i].append(math.inf if r.ttft is None else r.ttft)
        tpot[i].append(math.inf if r.tpot is None else r.tpot)
    out = []
    for i in range(n):
        a, b = p90(ttft[i]), p90(tpot[i])
        ok_a = a is None or a <= targets.ttft_s
        ok_b = b is None or b <= targets.tpot_s
        out.append({"minute": i, "ttft_p90_s": a, "tpot_p90_s": b, "ttft_ok": ok_a, "tpot_ok": ok_b})
    return out


def failed(ws: list[dict[str, Any]]) -> list[int]:
    """The minutes whose TTFT or TPOT p90 missed its target."""
    return [w["minute"] for w in ws if not (w["ttft_ok"] and w["tpot_ok"])]


def share(ws: list[dict[str, Any]], *keys: str) -> float:
    return sum(all(w[k] for k in keys) for w in ws) / len(ws)


def run_fixed(cfg: FleetConfig, trace: Trace, targets: Targets, prefill: int, decode: int) -> dict[str, Any]:
    fleet = Fleet(cfg, prefill, decode, at=-WARMUP_S)
    fleet.run(trace.arrivals, trace.duration_s + DRAIN_S)
    ws = windows(fleet, trace, targets)
    return {
        "prefill": prefill,
        "decode": decode,
        "workers": prefill + decode,
        "slo_windows_met": round(share(ws, "ttft_ok", "tpot_ok"), 4),
        "ttft_windows_met": round(share(ws, "ttft_ok"), 4),
        "tpot_windows_met": round(share(ws, "tpot_ok"), 4),
        "worker_minutes": round(fleet.worker_seconds(0, trace.duration_s) / 60, 1),
        "_windows": ws,
    }


def fewest(hi: int, good: Callable[[int], bool]) -> int | None:
    """The smallest n in 1..hi with good(n), by bisection (good is monotonic); None if none."""
    lo, found = 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if good(mid):
            found, hi = mid, mid - 1
        else:
            lo = mid + 1
    return found


def best_fixed(
    evaluate: Callable[[int, int], dict[str, Any]], max_prefill: int, max_decode: int
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The fewest-worker split meeting the SLO goal (module doc), and every run the search made."""
    runs: dict[tuple[int, int], dict[str, Any]] = {}

    def ev(p: int, d: int) -> dict[str, Any]:
        if (p, d) not in runs:
            runs[(p, d)] = evaluate(p, d)
        return runs[(p, d)]

    p_min = fewest(max_prefill, lambda p: ev(p, max_decode)["ttft_windows_met"] >= SLO_GOAL)
    d_min = fewest(max_decode, lambda d: ev(max_prefill, d)["tpot_windows_met"] >= SLO_GOAL)
    best = None
    if p_min is not None and d_min is not None:
        for extra in range(max_prefill + max_decode - p_min - d_min + 1):
            pairs = [(p_min + k, d_min + extra - k) for k in range(extra + 1)]
            pairs = [(p, d) for p, d in pairs if p <= max_prefill and d <= max_decode]
            met = [ev(p, d) for p, d in pairs if ev(p, d)["slo_windows_met"] >= SLO_GOAL]
            if met:
                best = max(met, key=lambda r: r["slo_windows_met"])
                break
    table = sorted(runs.values(), key=lambda r: (r["workers"], r["prefill"]))
    return best, table


class PlannerRun:
    """The real Planner deciding every interval from the virtual fleet's signals (module doc)."""

    def __init__(
        self, config: PlannerConfig, outage: tuple[float, float],
        law: Callable[[Signals | None, float], Decision] | None = None,
    ) -> None:  # fmt: skip
        self.planner = Planner(config)
        self.step = law or self.planner.step  # the reactive law unless another is given (the forecast's)
        self.config = config
        self.outage = outage
        self.decisions: list[tuple[float, int, int, bool]] = []  # when, prefill, decode, during the outage
        self._tokens: tuple[float, int] | None = None  # the prompt-token counter at the previous read
        self._arrivals: tuple[float, int] | None = None  # the arrivals counter at the previous read

    def tick(self, now: float, fleet: Fleet) -> None:
        in_outage = self.outage[0] <= now < self.outage[1]
        signals = None
        if not in_outage:  # a failed read leaves the router's histograms to the next read: keep them
            ttfts, tpots = fleet.take_signals()
            # the prompt tokens' rate between two reads, as planner/signals.py takes it from the counter
            before, self._tokens = self._tokens, (now, fleet.prompt_tokens)
            span = None if before is None else now - before[0]
            rate = None if before is None or not span else (fleet.prompt_tokens - before[1]) / span
            done = None if not span else len(tpots) / span  # the TPOT histogram's count, per second
            prefill = RoleSignals(
                len(fleet.ready("prefill")), p90(ttfts), fleet.waiting("prefill"),
                demand=rate, per_worker=fleet.prefill_capacity(), queued_tokens=fleet.queued_tokens(),
            )  # fmt: skip
            decode = RoleSignals(
                len(fleet.ready("decode")), p90(tpots), fleet.waiting("decode"), fleet.kv_used(),
                demand=float(fleet.running()), per_worker=float(fleet.cfg.decode_max_seqs),
                finished_per_s=done,
            )  # fmt: skip
            # the router's arrivals counter between two reads (a read after the outage spans it)
            seen, self._arrivals = self._arrivals, (now, len(fleet.requests))
            arrivals = (
                None if seen is None or now <= seen[0] else (len(fleet.requests) - seen[1]) / (now - seen[0])
            )
            signals = Signals(now, prefill, decode, arrivals, None if seen is None else now - seen[0])
        d = self.step(signals, now)
        fleet.scale("prefill", d.prefill)
        fleet.scale("decode", d.decode)
        self.decisions.append((now, d.prefill, d.decode, in_outage))


def below_min(fleet: Fleet, config: PlannerConfig, start: float, end: float) -> bool:
    """Whether the ready workers of a role were below its minimum at any instant of [start, end)."""
    before = [c for c in fleet.count_changes if c[0] <= start]
    during = [c for c in fleet.count_changes if start < c[0] < end]
    states = before[-1:] + during
    return any(p < config.min_prefill or d < config.min_decode for _, p, d in states)


def flips(decisions: list[tuple[float, int, int, bool]], trace: Trace) -> tuple[int, float]:
    """Direction changes within a steady stretch (module doc) and the steady minutes."""
    steady = trace.steady()

    def stretch(t: float) -> int | None:
        return next((i for i, s in enumerate(steady) if s.start <= t < s.end), None)

    count = 0
    for role in (1, 2):
        changes: list[tuple[float, int]] = []  # when, direction
        for prev, cur in zip(decisions, decisions[1:], strict=False):
            if cur[role] != prev[role]:
                changes.append((cur[0], 1 if cur[role] > prev[role] else -1))
        for (t0, d0), (t1, d1) in zip(changes, changes[1:], strict=False):
            if d0 != d1 and stretch(t1) is not None and stretch(t0) == stretch(t1):
                count += 1
    return count, sum(s.end - s.start for s in steady) / 60


# ---- the trade-off, measured (--planner-frontier) -------------------------------------------------------

STEADY_WARMUP_S = 120.0
STEADY_S = 600.0


@dataclass(frozen=True)
class Steady:
    """A constant rate for STEADY_S after STEADY_WARMUP_S, the trace's request lengths (Trace._draw)."""

    rate_rps: float
    seed: int
    duration_s: float = STEADY_S

    def arrivals(self) -> list[tuple[float, int, int]]:
        rng = np.random.default_rng(self.seed)
        n = int((self.duration_s + STEADY_WARMUP_S) * self.rate_rps * 1.2) + 100
        times = np.cumsum(rng.exponential(1 / self.rate_rps, size=n)) - STEADY_WARMUP_S
        return with_lengths(rng, times[times < self.duration_s])


def _need_at(
    cfg: FleetConfig, targets: Targets, steady: Steady, max_prefill: int, max_decode: int
) -> tuple[int, int]:
    """steady_need for one rate."""
    arrivals = steady.arrivals()

    def ok(prefill: int, decode: int, key: str) -> bool:
        fleet = Fleet(cfg, prefill, decode, at=-STEADY_WARMUP_S)
        fleet.run(arrivals, steady.duration_s + DRAIN_S)
        return all(w[key] for w in windows(fleet, steady, targets))

    p = fewest(max_prefill, lambda n: ok(n, max_decode, "ttft_ok"))
    d = fewest(max_decode, lambda n: ok(max_prefill, n, "tpot_ok"))
    return p or max_prefill, d or max_decode


def steady_need(
    cfg: FleetConfig, targets: Targets, rates: list[float], max_prefill: int, max_decode: int, seed: int
) -> dict[float, tuple[int, int]]:
    """For each constant rate: the fewest prefill workers (with the most decode ones) that meet the TTFT
    target in every window, and the fewest decode workers (with the most prefill ones) that meet TPOT's;
    a role that cannot, at its maximum."""
    return {rate: _need_at(cfg, targets, Steady(rate, seed), max_prefill, max_decode) for rate in rates}


YESTERDAY_SEED = 100  # yesterday's trace: the same shape, drawn with seed + this


def minute_rates(trace: Trace) -> Callable[[float], float]:
    """The rate a day like `trace` had, minute by minute (its requests counted per minute of arrival,
    warm-up included): what a forecast from yesterday's traffic knows, if today has the same shape."""
    first = -int(WARMUP_S // 60)
    counts = [0] * (math.ceil(trace.duration_s / 60) - first)
    for t, _, _ in trace.arrivals:
        counts[int(t // 60) - first] += 1

    def rate(t: float) -> float:
        return counts[min(max(int(t // 60) - first, 0), len(counts) - 1)] / 60

    return rate


class ScheduledRun:
    """A schedule that knows the rate ahead (the trace's, or its ramps without the bursts): at every tick,
    each role asks for the most workers that the rates of the next `lead_s` need by the steady table (as
    the forecast law reads it, CapacityTable: the first row at or above), so that the workers a rise
    needs were asked for a start-up before it. It knows the rate, not the requests, and reads no
    signal."""

    def __init__(self, rate: Callable[[float], float], table: CapacityTable, lead_s: float) -> None:
        self.rate, self.table, self.lead_s = rate, table, lead_s
        self.decisions: list[tuple[float, int, int, bool]] = []  # as PlannerRun's: when, prefill, decode

    def need_at(self, t: float) -> tuple[int, int]:
        prefill, decode, _ = self.table.need(self.rate(t))
        return prefill, decode

    def tick(self, now: float, fleet: Fleet) -> None:
        ahead = [self.need_at(now + k * 5.0) for k in range(int(self.lead_s // 5) + 1)]
        prefill, decode = max(p for p, _ in ahead), max(d for _, d in ahead)
        fleet.scale("prefill", prefill)
        fleet.scale("decode", decode)
        self.decisions.append((now, prefill, decode, False))


def replay_planner(
    cfg: FleetConfig, trace: Trace, pcfg: PlannerConfig, outage: tuple[float, float], interval_s: float
) -> tuple[Fleet, PlannerRun]:
    pr = PlannerRun(pcfg, outage)
    fleet = Fleet(cfg, pcfg.min_prefill, pcfg.min_decode, at=-WARMUP_S)
    fleet.run(trace.arrivals, trace.duration_s + DRAIN_S, pr.tick, interval_s)
    return fleet, pr


def table_rates(trace: Trace) -> list[float]:
    """The steady table's grid: eighths of the peak and the trace's highest rate, from its lowest up."""
    low = trace.rate(0.0)
    top = max(trace.rate(t) for t in np.linspace(0, trace.duration_s, 2000))
    rates = sorted({round(trace.peak_rps * k / 8, 6) for k in range(1, 9)} | {round(top, 6)})
    return [r for r in rates if r >= low - 1e-9]


def capacity_table(need: dict[float, tuple[int, int]]) -> CapacityTable:
    return CapacityTable(CapacityRow(rate, p, d) for rate, (p, d) in need.items())


def forecast_period_s(trace: Trace, interval_s: float) -> float:
    """The forecast law's period in the replay: warm-up, trace and drain, in whole minutes (a replay's
    clock is its virtual time plus WARMUP_S, so each day's starts at a period's start)."""
    return 60.0 * math.ceil((WARMUP_S + trace.duration_s + DRAIN_S + interval_s) / 60)


def replay_forecast(
    cfg: FleetConfig, trace: Trace, pcfg: PlannerConfig, table: CapacityTable, log: RateLog, day: int,
    outage: tuple[float, float], interval_s: float,
) -> tuple[Fleet, PlannerRun, ForecastPlanner]:  # fmt: skip
    """The forecast law (planner/forecast.py) on `day` of `log`'s period: it forecasts from day - 1's
    record, and records this day's arrivals into the log."""
    law = ForecastPlanner(pcfg, table, log, ForecastConfig(lead_s=cfg.startup_s + interval_s))
    offset = WARMUP_S + day * log.period_s
    pr = PlannerRun(pcfg, outage, lambda signals, now: law.step(signals, now, now + offset))
    fleet = Fleet(cfg, pcfg.min_prefill, pcfg.min_decode, at=-WARMUP_S)
    fleet.run(trace.arrivals, trace.duration_s + DRAIN_S, pr.tick, interval_s)
    return fleet, pr, law


def frontier(
    cfg: FleetConfig, trace: Trace, targets: Targets, pcfg: PlannerConfig, outage: tuple[float, float],
    interval_s: float, fixed_wm: float, planner: tuple[Fleet, PlannerRun],
    need: dict[float, tuple[int, int]], laws: list[tuple[str, Fleet, PlannerRun]],
) -> dict[str, Any]:  # fmt: skip
    """The same trace under other settings of the reactive law and under three schedules that know the rate
    ahead: where SLO windows and worker-minutes trade (module doc, --planner-frontier). `planner`: the
    reactive law's own replay, with the defaults; `need`: the steady table (table_rates); `laws`: other
    replays already made (the forecast law's), as points."""
    low = trace.rate(0.0)
    burst_p, burst_d = max(pd for r, pd in need.items() if r <= 2.5 * low + 1e-9)

    def point(label: str, fleet: Fleet, decisions: list[tuple[float, int, int, bool]]) -> dict[str, Any]:
        ws = windows(fleet, trace, targets)
        n_flips, steady_min = flips([d for d in decisions if d[0] >= 0], trace)
        return {
            "label": label,
            "slo_windows_met": round(share(ws, "ttft_ok", "tpot_ok"), 4),
            "worker_minutes_ratio": round(fleet.worker_seconds(0, trace.duration_s) / 60 / fixed_wm, 3),
            "failed_windows": failed(ws),
            "flips_per_10min_steady": round(n_flips / steady_min * 10, 3),
        }

    points = [point("the reactive law (defaults)", planner[0], planner[1].decisions)]
    points += [point(label, fleet, pr.decisions) for label, fleet, pr in laws]
    floor = {"min_prefill": burst_p, "min_decode": burst_d}
    variants: list[tuple[str, dict[str, Any], float]] = [
        ("up 0.85 / down 0.7", {"up_target": 0.85, "down_target": 0.7}, cfg.startup_s),
        ("up 0.9 / down 0.75", {"up_target": 0.9, "down_target": 0.75}, cfg.startup_s),
        (f"floor {burst_p} + {burst_d} (the low burst's need)", floor, cfg.startup_s),
        (f"floor {burst_p} + {burst_d}, up 0.9 / down 0.75", {**floor, "up_target": 0.9, "down_target": 0.75},
         cfg.startup_s),
        ("start-up 20 s", {}, 20.0),
        ("start-up 10 s", {}, 10.0),
    ]  # fmt: skip
    for label, overrides, startup in variants:
        vcfg = FleetConfig(cfg.profile, startup_s=startup)
        vp = PlannerConfig(**{**asdict(pcfg), **overrides})
        fleet, pr = replay_planner(vcfg, trace, vp, outage, interval_s)
        points.append(point(label, fleet, pr.decisions))
    yesterday = minute_rates(Trace(trace.minutes, trace.peak_rps, trace.seed + YESTERDAY_SEED))
    for label, rate in (
        ("schedule that knows the rate", trace.rate),
        ("schedule from yesterday's rates", yesterday),
        ("schedule that knows the ramps, not the bursts", trace.base_rate),
    ):
        sched = ScheduledRun(rate, capacity_table(need), cfg.startup_s + interval_s)
        fleet = Fleet(cfg, *sched.need_at(-WARMUP_S), at=-WARMUP_S)
        fleet.run(trace.arrivals, trace.duration_s + DRAIN_S, sched.tick, interval_s)
        points.append(point(label, fleet, sched.decisions))
    return {
        "points": points,
        "steady_need": [{"rate_rps": r, "prefill": p, "decode": d} for r, (p, d) in sorted(need.items())],
    }


def plot_frontier(points: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.fill_between([0.5, 0.8], SLO_GOAL, 1.02, color="tab:green", alpha=0.12, label="both goals")
    placed: list[tuple[float, float]] = []
    for i, p in enumerate(points):
        x, y = p["worker_minutes_ratio"], p["slo_windows_met"]
        ax.scatter([x], [y], s=40, color=f"C{i % 10}", zorder=3)
        # a label on the line of an earlier point's label (one starting up to a label's length to the left,
        # or close to the right) goes a line lower for each, not over it
        near = sum(-0.08 < x - a < 0.3 and abs(y - b) < 0.008 for a, b in placed)
        ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(6, 4 - 11 * near), fontsize=8)
        placed.append((x, y))
    ax.axhline(SLO_GOAL, color="tab:green", lw=0.8, ls="--")
    ax.axvline(0.8, color="tab:green", lw=0.8, ls="--")
    ax.axvline(1.0, color="grey", lw=0.8, ls=":", label="the best fixed split's worker-minutes")
    xs = [p["worker_minutes_ratio"] for p in points]
    ys = [p["slo_windows_met"] for p in points]
    ax.set(
        xlim=(min(0.55, min(xs) - 0.05), max(xs) + 0.25), ylim=(min(0.8, min(ys) - 0.02), 1.02),
        xlabel="worker-minutes / the best fixed split's", ylabel="share of 1-minute windows meeting the SLO",
        title="SLO windows against worker-minutes: the planner's two laws and three schedules",
    )  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    save(fig, path, dpi=110)


def plot(trace: Trace, planner_fleet: Fleet, fixed: dict[str, Any], planned: list[dict[str, Any]],
         targets: Targets, outage: tuple[float, float], path: str, law: str = "planner") -> None:  # fmt: skip
    plt = pyplot()

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    T = trace.duration_s
    ts = [c[0] / 60 for c in planner_fleet.count_changes if c[0] <= T] + [T / 60]
    ps = [c[1] for c in planner_fleet.count_changes if c[0] <= T]
    ds = [c[2] for c in planner_fleet.count_changes if c[0] <= T]
    ax1.step(ts, ps + ps[-1:], where="post", label=f"{law}: prefill ready", color="tab:blue")
    ax1.step(ts, ds + ds[-1:], where="post", label=f"{law}: decode ready", color="tab:orange")
    ax1.axhline(
        fixed["prefill"], ls="--", color="tab:blue", alpha=0.6, label=f"fixed: {fixed['prefill']} prefill"
    )
    ax1.axhline(
        fixed["decode"], ls="--", color="tab:orange", alpha=0.6, label=f"fixed: {fixed['decode']} decode"
    )
    ax1.set(ylabel="workers", title="Workers over time (left) and arrival rate (right)")
    grid = np.linspace(-WARMUP_S, T, 800)
    rate = ax1.twinx()
    rate.plot(grid / 60, [trace.rate(t) for t in grid], color="grey", alpha=0.5, label="arrival rate")
    rate.set_ylabel("requests/s")
    ax1.legend(loc="upper left", fontsize=8)
    panels = ((ax2, "ttft_p90_s", targets.ttft_s, "TTFT"), (ax3, "tpot_p90_s", targets.tpot_s, "TPOT"))
    for ax, key, target, name in panels:
        for ws, label, style in ((planned, law, "-"), (fixed["_windows"], "best fixed split", "--")):
            xs = [w["minute"] + 0.5 for w in ws]
            ys = [min(w[key], 10 * target) / target if w[key] is not None else np.nan for w in ws]
            ax.plot(xs, ys, style, marker=".", label=label)
        ax.axhline(1.0, color="red", lw=1, label="target")
        ax.set(ylabel=f"{name} p90 / target (at most 10)", yscale="log")
        ax.legend(loc="upper left", fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.axvspan(outage[0] / 60, outage[1] / 60, color="red", alpha=0.08)
        for s in trace.stretches:
            if s.kind == "burst":
                ax.axvspan(s.start / 60, s.end / 60, color="purple", alpha=0.08)
        ax.grid(alpha=0.3)
    ax3.set_xlabel("minutes (shaded: bursts purple, metrics outage red)")
    save(fig, path, dpi=110)


def figures(
    fleet: Fleet, pr: PlannerRun, trace: Trace, targets: Targets, pcfg: PlannerConfig,
    outage: tuple[float, float], fixed_wm: float | None,
) -> dict[str, Any]:  # fmt: skip
    """One law's replay judged: the JSON's figures (module doc) and its details (`planner`)."""
    planned = windows(fleet, trace, targets)
    wm = fleet.worker_seconds(0, trace.duration_s) / 60
    n_flips, steady_min = flips([d for d in pr.decisions if d[0] >= 0], trace)
    counted = [d for d in pr.decisions if 0 <= d[0] < trace.duration_s]
    return {
        "slo_windows_met": round(share(planned, "ttft_ok", "tpot_ok"), 4),
        "worker_minutes_ratio": round(wm / fixed_wm, 3) if fixed_wm else None,
        "flips_per_10min_steady": round(n_flips / steady_min * 10, 3),
        "below_min_during_outage": below_min(fleet, pcfg, *outage),
        "planner": {
            "worker_minutes": round(wm, 1),
            "ttft_windows_met": round(share(planned, "ttft_ok"), 4),
            "tpot_windows_met": round(share(planned, "tpot_ok"), 4),
            "decisions": len(counted),
            "count_changes": sum(
                (a[1], a[2]) != (b[1], b[2]) for a, b in zip(counted, counted[1:], strict=False)
            ),
            "flips_steady": n_flips,
            "steady_minutes": round(steady_min, 1),
            "max_prefill_ready": max(c[1] for c in fleet.count_changes),
            "max_decode_ready": max(c[2] for c in fleet.count_changes),
            "outage_min": [round(outage[0] / 60, 2), round(outage[1] / 60, 2)],
            "failed_windows": failed(planned),
        },
        "_windows": planned,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before, wall0 = load_avg(), time.perf_counter()
    profile_name = getattr(args, "planner_profile", None) or PROFILE
    profile = SimProfile.load(profile_name)
    cfg = FleetConfig(profile, startup_s=args.planner_startup_s)
    targets = Targets(args.planner_ttft_s, args.planner_tpot_s)
    pcfg = PlannerConfig(
        ttft_target_s=targets.ttft_s, tpot_target_s=targets.tpot_s, budget=args.planner_budget,
        max_prefill=args.planner_max_role, max_decode=args.planner_max_role,
    )  # fmt: skip
    if not args.planner_interval_s > 0:
        raise ValueError("--planner-interval-s must be positive")
    if not args.planner_outage_min >= 0:
        raise ValueError("--planner-outage-min must not be negative")
    trace = Trace(args.planner_minutes, args.planner_peak_rps, args.seed)
    steady_peak = next(s for s in trace.stretches if s.kind == "steady" and s.start >= trace.duration_s / 3)
    outage = (steady_peak.start + (steady_peak.end - steady_peak.start) / 3, 0.0)
    outage = (outage[0], outage[0] + args.planner_outage_min * 60)
    if not outage[1] <= steady_peak.end:
        raise ValueError("--planner-outage-min: the outage must fit in the peak plateau's last two thirds")

    interval = args.planner_interval_s
    reactive = replay_planner(cfg, trace, pcfg, outage, interval)
    need = steady_need(cfg, targets, table_rates(trace), pcfg.max_prefill, pcfg.max_decode, trace.seed)
    table = capacity_table(need)
    if getattr(args, "planner_capacity_out", None):
        os.makedirs(os.path.dirname(os.path.abspath(args.planner_capacity_out)), exist_ok=True)
        table.save(args.planner_capacity_out)
    # the forecast law: yesterday (the same shape, drawn with another seed) recorded by the law itself with
    # nothing to forecast from, then today forecast from that record; and today with an empty record
    log = RateLog(forecast_period_s(trace, interval))
    yesterday = Trace(trace.minutes, trace.peak_rps, trace.seed + YESTERDAY_SEED)
    replay_forecast(cfg, yesterday, pcfg, table, log, 0, outage, interval)
    forecast = replay_forecast(cfg, trace, pcfg, table, log, 1, outage, interval)
    first_day = replay_forecast(cfg, trace, pcfg, table, RateLog(log.period_s), 0, outage, interval)

    best, sweep = best_fixed(
        lambda p, d: run_fixed(cfg, trace, targets, p, d), pcfg.max_prefill, pcfg.max_decode
    )
    fixed_wm = best["worker_minutes"] if best else None
    laws = {
        "forecast": figures(forecast[0], forecast[1], trace, targets, pcfg, outage, fixed_wm),
        "forecast_first_day": figures(first_day[0], first_day[1], trace, targets, pcfg, outage, fixed_wm),
        "reactive": figures(reactive[0], reactive[1], trace, targets, pcfg, outage, fixed_wm),
    }
    law = args.planner_law
    fleet, chosen = (forecast[0], laws["forecast"]) if law == "forecast" else (reactive[0], laws["reactive"])
    path = os.path.join(args.out, "planner.png")
    if best is not None:
        plot(trace, fleet, best, chosen.pop("_windows"), targets, outage, path, f"{law} law")
    for figs in laws.values():
        figs.pop("_windows", None)
    trade: dict[str, Any] | None = None
    if getattr(args, "planner_frontier", False) and best is not None:
        trade = frontier(
            cfg, trace, targets, pcfg, outage, interval, best["worker_minutes"], reactive, need,
            [("the forecast law (yesterday recorded)", forecast[0], forecast[1]),
             ("the forecast law, first day (nothing recorded)", first_day[0], first_day[1])],
        )  # fmt: skip
        trade["plot"] = os.path.join(args.out, "planner_frontier.png")
        plot_frontier(trade["points"], trade["plot"])
    top = {k: chosen[k] for k in ("slo_windows_met", "worker_minutes_ratio", "flips_per_10min_steady",
                                  "below_min_during_outage")}  # fmt: skip
    return {
        **top,
        "law": law,
        "goals": {
            "slo_windows_met": ">= 0.95",
            "worker_minutes_ratio": "<= 0.8",
            "flips_per_10min_steady": "<= 1",
            "below_min_during_outage": False,
        },  # fmt: skip
        "planner": chosen["planner"],
        "laws": {
            name: {
                **{k: v for k, v in figs.items() if k != "planner"},
                "failed_windows": figs["planner"]["failed_windows"],
            }
            for name, figs in laws.items()
        },
        "capacity_table": table.as_json()["rows"],
        "best_fixed": None if best is None else {k: v for k, v in best.items() if not k.startswith("_")},
        "sweep": [{k: v for k, v in r.items() if not k.startswith("_")} for r in sweep],
        "requests": len(trace.arrivals),
        "profile": profile_name,
        "targets": {"ttft_s": targets.ttft_s, "tpot_s": targets.tpot_s},
        "virtual_minutes": trace.minutes,
        "peak_rps": trace.peak_rps,
        "interval_s": args.planner_interval_s,
        "startup_s": args.planner_startup_s,
        "plot": path if best is not None else None,
        "frontier": trade,
        "wall_s": round(time.perf_counter() - wall0, 1),
        "load_before": load_before,
        "load_after": load_avg(),
    }
