"""The planner's control law: how many prefill and how many decode workers, from signals kept apart.

Each role has two kinds of signal (RoleSignals; planner/signals.py reads them live, bench/fleet_model.py
computes the same ones from its virtual workers):
- Utilization, the main one: the role's work in workers at full capacity, its `load` (2.4: the work of
  2.4 workers), and `utilization` = load / the workers asked for. Prefill: (prompt tokens per second
  served + queued prompt tokens / `drain_s`) / the tokens per second one worker computes at a full step
  (its measured capacity, planner/signals.py). Decode: (sequences running + those waiting for admission
  x the seconds a sequence holds its slot, running / finished per second by Little's law, / `drain_s`)
  / `max_num_seqs`, or the KV occupancy in workers if higher. Unknown (None) without a router to count
  prompt tokens, before a prefill worker has measured its speed, or without max_num_seqs.
- Latency pressure `r` (p90 TTFT or TPOT over target, queued requests over `waiting_per_worker`, decode
  KV occupancy over `kv_target`; the largest): 1.0 is at target with the workers the role has. It is
  flat until a worker saturates, so it says that a role is short, not by how much, nor that one fewer
  would still do; with utilization known it is the safety net, not the gauge.

Rules, each with a test (tests/unit/test_planner.py):
- Up, sized from demand: ceil(load / `up_target`) workers (0.8) when that is more than the role was
  last asked for; load is the largest over `window_s`, so a burst is not forgotten between two
  decisions. The size is absolute and compared with what was asked for, starting workers included:
  a backlog that the workers already starting will drain asks for nothing more, unless demand grew
  beyond what they cover.
- Up on latency, utilization known: latency over target while utilization asks for no more (a backlog
  draining, or a capacity estimate that is off) adds one worker, and only when the raw pressure was
  over 1 in every reading of the last `window_s` taken with all the workers asked for ready, `window_s`
  after the role's last change (readings taken before new workers came are no evidence that they are
  too few; an interval in which nothing finished is no reading).
- Up on latency, utilization unknown (the law before utilization): when the smoothed pressure exceeds
  1, ceil(n * r) workers, at most twice as many per decision, but not while workers asked for are still
  starting. Smoothed: the largest load (pressure times the workers it was measured on) over `window_s`,
  over the workers asked for.
- Down, with headroom and consolidation-aware: only when, by latency, the load of n workers spread
  over n - 1 stays under `down_margin` (0.7) of target AND, by utilization, fewer workers would stay
  under `down_target` (0.6), both for `down_stable_s` (the largest load seen in that time counts). With
  utilization known the role goes to the fewest workers that keep it under `down_target` (prefill:
  load / m; decode: load x n / m^2, since on m workers each holds n / m times the sequences for up to
  n / m times longer, its steps slowed by their KV reads); with latency alone, one fewer (latency does
  not say how many). `down_target` < `up_target` is the hysteresis: after a scale-down, a scale-up
  needs the load to grow by up_target / down_target (1.33x), so a load near one worker's capacity
  cannot flip between 1 and 2; and the remaining workers keep room for a burst of 1 / down_target.
- No change to a role within `cooldown_s` of its last one (a new worker needs time to show in the
  signals).
- Never below `min_*`, never above `max_*`, never more than `budget` workers in all; over budget, the
  role with less pressure (the larger of smoothed latency pressure and utilization) gives way.
- Signals missing or stale (metrics outage): the last decision holds; the floor still applies. An
  outage is no evidence of low load: a role that was low before it waits `down_stable_s` again after
  it before going down.
- Every decision is returned with its inputs (the caller logs it as one JSON line): the signals, the
  pressures, and the load and utilization when known.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RoleSignals:
    workers: int  # workers of this role alive now
    latency_s: float | None  # p90 TTFT (prefill) or TPOT (decode) over the last window; None: no traffic
    waiting: int = 0  # requests queued on this role's workers
    kv_used: float = 0.0  # decode: fraction of KV blocks in use (0..1)
    # utilization (module doc); None where unknown. prefill: prompt tokens/s served (the router's
    # prompt-token counter, at the first token), tokens/s one worker computes (its measured prefill
    # speed); decode: sequences running (admitted), sequences one worker holds (max_num_seqs)
    demand: float | None = None
    per_worker: float | None = None
    queued_tokens: int = 0  # prefill: prompt tokens queued on the workers (drained within drain_s)
    finished_per_s: float | None = None  # decode: requests finished per second (drains `waiting`)


@dataclass(frozen=True)
class Signals:
    at: float  # when they were read (monotonic seconds)
    prefill: RoleSignals
    decode: RoleSignals
    # requests that arrived per second over the `span_s` seconds before `at` (the router's arrivals
    # counter between two reads); None: unknown. The forecast law (planner/forecast.py) logs and reads it
    arrivals_rps: float | None = None
    span_s: float | None = None
    routers: int | None = None  # routers whose /metrics were read (None: no router read)


@dataclass(frozen=True)
class PlannerConfig:
    ttft_target_s: float = 1.0
    tpot_target_s: float = 0.05
    kv_target: float = 0.8  # decode KV occupancy that counts as "at target"
    waiting_per_worker: float = 4.0  # queued requests per worker that count as "at target"
    min_prefill: int = 1
    min_decode: int = 1
    max_prefill: int = 8
    max_decode: int = 8
    budget: int = 16  # prefill + decode workers at most
    window_s: float = 45.0
    down_margin: float = 0.7
    down_stable_s: float = 120.0
    cooldown_s: float = 30.0
    stale_s: float = 30.0  # signals older than this are an outage
    up_target: float = 0.8  # utilization a scale-up sizes the role for
    down_target: float = 0.6  # utilization the remaining workers must stay under to scale down
    drain_s: float = 60.0  # queued prompt tokens count as demand to drain within this

    def __post_init__(self) -> None:
        if not 0 < self.down_margin < 1:
            raise ValueError("down_margin must be between 0 and 1")
        if not 0 < self.down_target < self.up_target <= 1:
            raise ValueError(
                f"need 0 < down_target < up_target <= 1, got {self.down_target} and {self.up_target}"
            )
        if not self.drain_s > 0:
            raise ValueError(f"drain_s must be positive, got {self.drain_s}")
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if not 0 <= lo <= hi:
                raise ValueError(f"need 0 <= min_{role} <= max_{role}, got {lo} and {hi}")
        if self.min_prefill + self.min_decode > self.budget:
            raise ValueError(f"budget {self.budget} is below min_prefill + min_decode")


@dataclass(frozen=True)
class Decision:
    at: float
    prefill: int
    decode: int
    reason: str  # what moved (or held) the numbers
    inputs: dict[str, Any] = field(default_factory=dict)

    def as_log(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Reading:
    current: int  # what the role was last asked to run
    ready: int  # workers of the role alive now
    pressure: float  # latency pressure, raw
    smooth: float  # latency pressure, the window's largest load over `current`
    load: float | None  # utilization in workers, the window's largest; None: unknown
    sustained: float  # latency pressure, the window's smallest raw reading


def within_budget(
    config: PlannerConfig, prefill: int, decode: int, prefill_pressure: float, decode_pressure: float
) -> tuple[int, int]:
    """Over `config.budget`, the role under less pressure gives way one worker at a time, never below
    its minimum (both laws)."""
    while prefill + decode > config.budget:
        if (
            prefill_pressure <= decode_pressure and prefill > config.min_prefill
        ) or decode <= config.min_decode:
            prefill -= 1
        else:
            decode -= 1
    return prefill, decode


class Planner:
    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()
        self.last: Decision | None = None
        self._history: dict[str, deque[tuple[float, float]]] = {"prefill": deque(), "decode": deque()}
        self._loads: dict[str, deque[tuple[float, float]]] = {"prefill": deque(), "decode": deque()}
        self._raw: dict[str, deque[tuple[float, float, int]]] = {"prefill": deque(), "decode": deque()}
        self._changed_at: dict[str, float] = {"prefill": -math.inf, "decode": -math.inf}
        self._low_since: dict[str, float | None] = {"prefill": None, "decode": None}
        self._low_peak: dict[str, float] = {"prefill": 0.0, "decode": 0.0}

    def pressure(self, role: str, s: RoleSignals) -> float:
        """Latency pressure. 1.0: at target with the workers it has; above: short of workers."""
        cfg = self.config
        target = cfg.ttft_target_s if role == "prefill" else cfg.tpot_target_s
        parts = [s.waiting / (cfg.waiting_per_worker * max(s.workers, 1))]
        if s.latency_s is not None:
            parts.append(s.latency_s / target)
        if role == "decode":
            parts.append(s.kv_used / cfg.kv_target)
        return max(parts)

    def load(self, role: str, s: RoleSignals) -> float | None:
        """The role's work in workers at full capacity (module doc); None when unknown."""
        if s.demand is None or not s.per_worker:
            return None
        if role == "prefill":
            return (s.demand + s.queued_tokens / self.config.drain_s) / s.per_worker
        # the sequences waiting for admission, drained within drain_s: each holds a slot for
        # running / finished_per_s seconds (Little's law), so draining them takes that many more slots
        backlog = 0.0
        if s.waiting and s.finished_per_s:
            backlog = s.waiting * (s.demand / s.finished_per_s) / self.config.drain_s
        return max((s.demand + backlog) / s.per_worker, s.kv_used * s.workers)

    def step(self, signals: Signals | None, now: float) -> Decision:
        cfg = self.config
        if signals is None or now - signals.at > cfg.stale_s:
            return self._hold(now, "signals missing or stale: holding the last decision")
        wanted: dict[str, int] = {}
        inputs: dict[str, Any] = {}
        reasons = []
        for role in ("prefill", "decode"):
            s: RoleSignals = getattr(signals, role)
            # the last decision (what the actuator was told), else what runs now
            current = getattr(self.last, role) if self.last else max(s.workers, getattr(cfg, f"min_{role}"))
            raw = self.pressure(role, s)
            # kept as load (pressure x the workers it was measured on), so that a window measured on
            # one worker count reads right for another: twice the workers, half the pressure
            hist = self._history[role]
            hist.append((now, raw * max(s.workers, 1)))
            while hist and hist[0][0] < now - cfg.window_s:
                hist.popleft()
            smooth = max(v for _, v in hist) / max(current, 1)
            raws = self._raw[role]
            if s.latency_s is not None:  # an interval in which nothing finished says nothing either way
                raws.append((now, raw, s.workers))
            while raws and raws[0][0] < now - cfg.window_s:
                raws.popleft()
            # over target all window, on the workers asked for (not readings from before they came)
            sustained = min((v if w >= current else 0.0 for _, v, w in raws), default=0.0)
            sustained = sustained if len(raws) >= 2 else 0.0
            load = self.load(role, s)
            loads = self._loads[role]
            if load is None:
                loads.clear()
            else:
                loads.append((now, load))
                while loads and loads[0][0] < now - cfg.window_s:
                    loads.popleft()
            peak = max(v for _, v in loads) if loads else None
            n, why = self._role(role, _Reading(current, s.workers, raw, smooth, peak, sustained), now)
            wanted[role] = n
            inputs[role] = {**asdict(s), "pressure": round(raw, 4), "smoothed": round(smooth, 4)}
            if peak is not None:
                inputs[role] |= {"load": round(peak, 4), "utilization": round(peak / max(current, 1), 4)}
            reasons.append(f"{role} {current}->{n} ({why})")
        prefill, decode = self._fit(wanted["prefill"], wanted["decode"], inputs)
        for role, n in (("prefill", prefill), ("decode", decode)):
            if self.last is None or n != getattr(self.last, role):
                self._changed_at[role] = now
        self.last = Decision(now, prefill, decode, "; ".join(reasons), inputs)
        return self.last

    def _role(self, role: str, r: _Reading, now: float) -> tuple[int, str]:
        cfg = self.config
        lo, hi = getattr(cfg, f"min_{role}"), getattr(cfg, f"max_{role}")
        current = r.current
        if current < lo:
            return lo, "below the minimum"
        if now - self._changed_at[role] < cfg.cooldown_s:
            return min(current, hi), "cooling down after the last change"
        if r.load is not None:
            sized = math.ceil(r.load / cfg.up_target - 1e-9)
            if sized > current:
                self._low_since[role] = None
                return min(hi, sized), f"utilization {r.load / max(current, 1):.2f}: sized from demand"
        if r.load is not None and r.smooth > 1.0:
            self._low_since[role] = None
            if r.sustained > 1.0 and r.ready >= current and now - self._changed_at[role] >= cfg.window_s:
                return min(hi, current + 1), "over target all window, utilization below: one more"
            return min(current, hi), "over target, utilization below: the demand-sized workers drain it"
        if r.smooth > 1.0:
            self._low_since[role] = None
            if r.ready < current:
                return min(current, hi), "over target, but workers asked for are still starting"
            return min(hi, 2 * current, max(current + 1, math.ceil(current * r.smooth))), "over target"
        fewer = self._fewer(role, current, lo, r)
        if fewer < current:
            since = self._low_since[role]
            if since is None:
                self._low_since[role], self._low_peak[role] = now, r.load or 0.0
                return current, "low: waiting to be sure"
            self._low_peak[role] = max(self._low_peak[role], r.load or 0.0)
            if now - since >= cfg.down_stable_s:
                self._low_since[role] = None
                if r.load is None:
                    return current - 1, "low long enough: one fewer still meets target"
                n = max(fewer, self._fewer_for(role, self._low_peak[role], current, lo))
                if n >= current:
                    return current, "low, but not all of the last down_stable_s"
                return n, f"low long enough: {n} stay under {cfg.down_target} utilization"
            return current, "low: waiting to be sure"
        self._low_since[role] = None
        return min(current, hi), "within target"

    def _fewer_for(self, role: str, load: float, current: int, lo: int) -> int:
        """The fewest workers (at most `current`) that `load`, measured on `current`, keeps under the down
        target. Decode is projected as load * current / m**2 on m: each of m workers gets current / m
        times the sequences, and each step, longer by their KV reads, keeps them up to that much longer
        (prefill, compute-bound on prompt tokens that arrive whatever runs, is load / m)."""
        for m in range(lo, current):
            if m == 0:  # none at all only for no work at all
                if load <= 0:
                    return 0
                continue
            projected = load / m if role == "prefill" else load * current / (m * m)
            if projected < self.config.down_target:
                return m
        return current

    def _fewer(self, role: str, current: int, lo: int, r: _Reading) -> int:
        """How many the role could run now by both signals (current: none fewer)."""
        cfg = self.config
        if current <= lo or r.smooth * current / (current - 1) >= cfg.down_margin:
            return current
        if r.load is None:
            return current - 1
        return self._fewer_for(role, r.load, current, lo)

    def _fit(self, prefill: int, decode: int, inputs: dict[str, Any]) -> tuple[int, int]:
        """Within the budget: the role under less pressure (smoothed latency or utilization) gives way."""
        p, d = (max(inputs[r]["smoothed"], inputs[r].get("utilization", 0.0)) for r in ("prefill", "decode"))
        return within_budget(self.config, prefill, decode, p, d)

    def _hold(self, now: float, why: str) -> Decision:
        cfg = self.config
        last = self.last
        self._low_since = {"prefill": None, "decode": None}
        prefill = max(cfg.min_prefill, last.prefill if last else cfg.min_prefill)
        decode = max(cfg.min_decode, last.decode if last else cfg.min_decode)
        self.last = Decision(now, prefill, decode, why, {})
        return self.last
