"""The planner's control law: how many prefill and how many decode workers, from signals kept apart.

Prefill pressure is time to first token against its target and the queue of prompts waiting on the
prefill workers; decode pressure is time per output token against its target and the decode workers'
KV occupancy. Each role's pressure `r` is a ratio: 1.0 means exactly at target with the workers it has.

Rules, each with a test (tests/unit/test_planner.py):
- Up: when the smoothed pressure exceeds 1, the role gets ceil(n * r) workers, at most twice as many per
  decision. Smoothed: the largest load (pressure times the workers it was measured on) over `window_s`,
  over the workers the role has now: a burst is not forgotten between two decisions, and a measurement
  taken before a scale-up is not read as if the new workers had been there.
- Down, consolidation-aware: one worker fewer only if the load of n workers spread over n - 1 stays
  under `down_margin` of target, `down_stable_s` long. At n = 2 that is r < 0.35 with the default 0.7:
  a load that sits near half of one worker's target cannot flip between 1 and 2. One at a time: latency
  is far from proportional to load (flat until a worker saturates), so a low reading does not say how
  many fewer would still meet target (several at once was tried on `splitserve bench planner`: it
  swung between the floor and the ceiling).
- No change to a role within `cooldown_s` of its last one (a new worker needs time to show in the
  signals).
- Never below `min_*`, never above `max_*`, never more than `budget` workers in all; over budget, the
  role with less pressure gives way.
- Signals missing or stale (metrics outage): the last decision holds; the floor still applies. An
  outage is no evidence of low load: a role that was low before it waits `down_stable_s` again after
  it before going down.
- Every decision is returned with its inputs (the caller logs it as one JSON line).
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


@dataclass(frozen=True)
class Signals:
    at: float  # when they were read (monotonic seconds)
    prefill: RoleSignals
    decode: RoleSignals


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

    def __post_init__(self) -> None:
        if not 0 < self.down_margin < 1:
            raise ValueError("down_margin must be between 0 and 1")
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


class Planner:
    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()
        self.last: Decision | None = None
        self._history: dict[str, deque[tuple[float, float]]] = {"prefill": deque(), "decode": deque()}
        self._changed_at: dict[str, float] = {"prefill": -math.inf, "decode": -math.inf}
        self._low_since: dict[str, float | None] = {"prefill": None, "decode": None}

    def pressure(self, role: str, s: RoleSignals) -> float:
        """1.0: at target with the workers it has; above: short of workers."""
        cfg = self.config
        target = cfg.ttft_target_s if role == "prefill" else cfg.tpot_target_s
        parts = [s.waiting / (cfg.waiting_per_worker * max(s.workers, 1))]
        if s.latency_s is not None:
            parts.append(s.latency_s / target)
        if role == "decode":
            parts.append(s.kv_used / cfg.kv_target)
        return max(parts)

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
            smooth = max(load for _, load in hist) / max(current, 1)
            n, why = self._role(role, current, raw, smooth, now)
            wanted[role] = n
            inputs[role] = {**asdict(s), "pressure": round(raw, 4), "smoothed": round(smooth, 4)}
            reasons.append(f"{role} {current}->{n} ({why})")
        prefill, decode = self._fit(wanted["prefill"], wanted["decode"], inputs)
        for role, n in (("prefill", prefill), ("decode", decode)):
            if self.last is None or n != getattr(self.last, role):
                self._changed_at[role] = now
        self.last = Decision(now, prefill, decode, "; ".join(reasons), inputs)
        return self.last

    def _role(self, role: str, current: int, raw: float, smooth: float, now: float) -> tuple[int, str]:
        cfg = self.config
        lo, hi = getattr(cfg, f"min_{role}"), getattr(cfg, f"max_{role}")
        if current < lo:
            return lo, "below the minimum"
        if now - self._changed_at[role] < cfg.cooldown_s:
            return min(current, hi), "cooling down after the last change"
        if smooth > 1.0:
            self._low_since[role] = None
            return min(hi, 2 * current, max(current + 1, math.ceil(current * smooth))), "over target"
        if current > lo and smooth * current / (current - 1) < cfg.down_margin:
            since = self._low_since[role]
            if since is None:
                self._low_since[role] = now
                return current, "low: waiting to be sure"
            if now - since >= cfg.down_stable_s:
                self._low_since[role] = None
                return current - 1, "low long enough: one fewer still meets target"
            return current, "low: waiting to be sure"
        self._low_since[role] = None
        return min(current, hi), "within target"

    def _fit(self, prefill: int, decode: int, inputs: dict[str, Any]) -> tuple[int, int]:
        """Within the budget: the role under less pressure gives way, never below its minimum."""
        cfg = self.config
        while prefill + decode > cfg.budget:
            p, d = inputs["prefill"]["smoothed"], inputs["decode"]["smoothed"]
            if (p <= d and prefill > cfg.min_prefill) or decode <= cfg.min_decode:
                prefill -= 1
            else:
                decode -= 1
        return prefill, decode

    def _hold(self, now: float, why: str) -> Decision:
        cfg = self.config
        last = self.last
        self._low_since = {"prefill": None, "decode": None}
        prefill = max(cfg.min_prefill, last.prefill if last else cfg.min_prefill)
        decode = max(cfg.min_decode, last.decode if last else cfg.min_decode)
        self.last = Decision(now, prefill, decode, why, {})
        return self.last
