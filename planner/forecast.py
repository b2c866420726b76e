"""The forecast law (`splitserve planner --law forecast`): each role sized ahead from the request rate
that the same minute of the previous period had (yesterday's, by default), through a capacity table, and
corrected only upward by what is seen today.

Why: a worker takes its start-up (a minute on a GPU) before it serves. A law that reacts to load pays for
each burst either in windows missed while the workers start, or in headroom kept all day against the next
one (the reactive law, planner/policy.py: bench/planner.py measures both). Traffic that repeats day by day
tells ahead when the bursts come, so the workers can be asked for a start-up before they are needed.

The parts:
- `RateLog`: requests counted per minute of a repeating period (`period_s`, a day), for the last `keep`
  periods; the planner adds each read's arrivals (the router's `splitserve_router_arrivals_total`, its
  delta since the previous read) spread evenly over the minutes that read covered, so a read after a
  metrics outage still fills the outage's minutes. `forecast(t)` is the previous period's rate at the
  same minute; None where that minute was observed for less than half of it (the first day, a gap).
  Live, the log is kept in Redis (`RedisRateLog`), so a restarted planner keeps yesterday.
- `CapacityTable`: for each request rate, the prefill and decode workers that meet the TTFT and TPOT
  targets at that constant rate (a profiling run measures it; `splitserve bench planner
  --planner-capacity-out` writes the simulated fleet's). A rate between two rows takes the higher row's
  workers; a row never needs fewer than the rows below it (taken as the largest up to it).
- `ForecastPlanner`, the law. Each decision, per role, the largest of:
  - the forecast's workers: the table's for the highest forecast rate from now to `lead_s` ahead (a
    worker's start-up plus one interval), so the workers a rise needs are asked for before it. The rate
    less `noise_sigmas` (2) standard deviations of a minute's Poisson count (sqrt(rate / 60)): one day's
    minute at 25.5 requests/s against a row of 25 is noise, not the next row (2 sigma: 5 % at 25/s,
    2.6 % at 100/s), and without it the role flips between two rows from minute to minute;
  - the correction: when the rate seen over the last `rate_window_s` is above the forecast by more than
    `margin` (a burst that yesterday did not have, or no forecast at all), the table's workers for the rate
    seen, held for `hold_s` after the last reading that asked for them (the largest asked in that time):
    it only adds, and it does not chase each reading down and up again;
  plus `extra`, the latency net: one more worker when the role's p90 latency was over target in every
  reading of the last `window_s` with all its workers ready (the table was off, or the requests got
  longer), `window_s` after the role's last change; one fewer again after `hold_s` with no reading over.
  Never below the minimum nor above the maximum; over the budget, the role whose latency is further under
  target gives way.
- A metrics outage (signals missing or stale): the forecast still applies (it reads no metric), the
  correction and extra hold, and no role goes below the last decision (an outage is no evidence of low
  load).
- Every decision carries its inputs: forecast and seen rates, the table's workers for each, the
  correction, the extra, the latencies.

Rules and their tests: tests/unit/test_planner_forecast.py."""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from planner.policy import Decision, PlannerConfig, Signals, within_budget

DAY_S = 86400.0
MIN_COVER = 0.5  # a minute observed for less than this share of it forecasts nothing


# ---- the capacity table ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CapacityRow:
    rate_rps: float
    prefill: int
    decode: int


class CapacityTable:
    """Workers per request rate (module doc)."""

    def __init__(self, rows: Iterable[CapacityRow]) -> None:
        rows = sorted(rows, key=lambda r: r.rate_rps)
        if not rows:
            raise ValueError("the capacity table has no rows")
        for a, b in zip(rows, rows[1:], strict=False):
            if a.rate_rps == b.rate_rps:
                raise ValueError(f"the capacity table has two rows for {a.rate_rps} requests/s")
        for r in rows:
            if not (r.rate_rps > 0 and math.isfinite(r.rate_rps)):
                raise ValueError(f"a capacity table's rate must be a positive number, got {r.rate_rps}")
            if r.prefill < 1 or r.decode < 1:
                raise ValueError(
                    f"the row for {r.rate_rps} requests/s needs at least one worker of each role"
                )
        # a higher rate never needs fewer workers: each row takes the largest of the rows up to it
        p = d = 0
        self.rows: list[CapacityRow] = []
        for r in rows:
            p, d = max(p, r.prefill), max(d, r.decode)
            self.rows.append(CapacityRow(r.rate_rps, p, d))

    def need(self, rate_rps: float) -> tuple[int, int, bool]:
        """(prefill, decode, beyond): the first row at or above the rate; beyond the last row, the last
        row's workers and beyond=True (the table does not say: the latency net and the logs must)."""
        for r in self.rows:
            if r.rate_rps >= rate_rps - 1e-9:
                return r.prefill, r.decode, False
        last = self.rows[-1]
        return last.prefill, last.decode, True

    def as_json(self) -> dict[str, Any]:
        return {
            "rows": [{"rate_rps": r.rate_rps, "prefill": r.prefill, "decode": r.decode} for r in self.rows]
        }

    @classmethod
    def from_json(cls, data: Any) -> CapacityTable:
        rows = data.get("rows") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise ValueError(
                'a capacity table is {"rows": [{"rate_rps": R, "prefill": P, "decode": D}, ...]}'
            )
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or set(row) != {"rate_rps", "prefill", "decode"}:
                raise ValueError(
                    f"capacity table row {i}: needs exactly rate_rps, prefill and decode, got {row!r}"
                )
            if not all(
                isinstance(row[k], int) and not isinstance(row[k], bool) for k in ("prefill", "decode")
            ):
                raise ValueError(f"capacity table row {i}: prefill and decode are whole numbers, got {row!r}")
            if not isinstance(row["rate_rps"], int | float) or isinstance(row["rate_rps"], bool):
                raise ValueError(f"capacity table row {i}: rate_rps is a number, got {row['rate_rps']!r}")
            out.append(CapacityRow(float(row["rate_rps"]), row["prefill"], row["decode"]))
        return cls(out)

    @classmethod
    def load(cls, path: str) -> CapacityTable:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"capacity table {path}: {e}") from e
        try:
            return cls.from_json(data)
        except ValueError as e:
            raise ValueError(f"capacity table {path}: {e}") from e

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.as_json(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)


# ---- the rate log ---------------------------------------------------------------------------------------


class RateLog:
    """Requests per minute of a repeating period, the last `keep` periods (module doc). Times are the
    period's clock: seconds since the epoch live (a day starts at 00:00 UTC)."""

    def __init__(self, period_s: float = DAY_S, keep: int = 2) -> None:
        if not period_s >= 60 or period_s % 60:
            raise ValueError(f"the forecast period must be a whole number of minutes, got {period_s} s")
        if keep < 2:
            raise ValueError(
                "the rate log keeps at least two periods (the one forecast from, the one recorded)"
            )
        self.period_s, self.keep = period_s, keep
        self.minutes_per_period = int(period_s // 60)
        # period index -> minute of the period -> [requests, seconds observed]
        self.periods: dict[int, dict[int, list[float]]] = {}

    def _slot(self, t: float) -> tuple[int, int]:
        period = math.floor(t / self.period_s)
        return period, min(int((t - period * self.period_s) // 60), self.minutes_per_period - 1)

    def add(self, t0: float, t1: float, requests: float) -> list[tuple[int, int]]:
        """Count `requests` that arrived over [t0, t1), spread evenly; returns the (period, minute) slots
        touched (what a store must write)."""
        if not t1 > t0 or requests < 0 or not math.isfinite(requests):
            return []
        per_s = requests / (t1 - t0)
        touched = []
        t = t0
        while t < t1:
            period, minute = self._slot(t)
            end = min(t1, period * self.period_s + (minute + 1) * 60.0)
            if end <= t:  # floating point at a minute's edge
                end = min(t1, t + 1e-6)
            slot = self.periods.setdefault(period, {}).setdefault(minute, [0.0, 0.0])
            slot[0] += per_s * (end - t)
            slot[1] += end - t
            touched.append((period, minute))
            t = end
        for old in [p for p in self.periods if p <= max(self.periods) - self.keep]:
            del self.periods[old]
        return touched

    def rate(self, period: int, minute: int) -> float | None:
        slot = self.periods.get(period, {}).get(minute)
        if slot is None or slot[1] < 60.0 * MIN_COVER:
            return None
        return slot[0] / slot[1]

    def forecast(self, t: float) -> float | None:
        """The previous period's rate at t's minute; None where it was not observed (MIN_COVER)."""
        period, minute = self._slot(t)
        return self.rate(period - 1, minute)

    def forecast_ahead(self, t: float, lead_s: float) -> float | None:
        """The highest forecast over [t, t + lead_s] (each minute it touches); None if none is known."""
        times = [t + 60.0 * k for k in range(int(lead_s // 60) + 1)] + [t + lead_s]
        known = [r for x in times if (r := self.forecast(x)) is not None]
        return max(known) if known else None


class RedisRateLog:
    """The rate log kept in Redis, one hash per period (`{prefix}planner:arrivals:{period_s}:{period}`,
    field: the minute, value: "requests seconds"), expiring after `keep` periods and an hour: a restarted
    planner keeps its forecast (and goes on counting the minute it stopped in), and nothing needs a
    volume."""

    def __init__(self, redis: Any, prefix: str, log: RateLog) -> None:
        self.redis, self.prefix, self.log = redis, prefix, log

    def key(self, period: int) -> str:
        return f"{self.prefix}planner:arrivals:{int(self.log.period_s)}:{period}"

    async def load(self, now: float) -> int:
        """Read the current and earlier kept periods into the log; returns the minutes read."""
        current = math.floor(now / self.log.period_s)
        read = 0
        for period in range(current - self.log.keep + 1, current + 1):
            fields = await self.redis.hgetall(self.key(period))
            for minute, value in fields.items():
                requests, seconds = (
                    float(x) for x in (value.decode() if isinstance(value, bytes) else value).split()
                )
                m = int(minute)
                if 0 <= m < self.log.minutes_per_period and seconds > 0:
                    self.log.periods.setdefault(period, {})[m] = [requests, seconds]
                    read += 1
        return read

    async def save(self, slots: Iterable[tuple[int, int]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for period, minute in sorted(set(slots)):
            slot = self.log.periods.get(period, {}).get(minute)
            if slot is None:
                continue
            pipe.hset(self.key(period), str(minute), f"{slot[0]:.6g} {slot[1]:.6g}")
            pipe.expire(self.key(period), int(self.log.period_s * self.log.keep) + 3600)
        await pipe.execute()


# ---- the law --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForecastConfig:
    lead_s: float = 75.0  # ask this far ahead: a worker's start-up plus one decision interval
    margin: float = 0.15  # the rate seen corrects the forecast when above it by more than this share
    hold_s: float = 120.0  # a correction (and a latency extra) holds this long after it was last needed
    rate_window_s: float = 30.0  # the rate seen: the arrivals of the reads over the last this long
    noise_sigmas: float = 2.0  # the forecast less this many standard deviations of a minute's count

    def __post_init__(self) -> None:
        if not self.lead_s >= 0:
            raise ValueError(f"lead_s must not be negative, got {self.lead_s}")
        if not self.margin >= 0:
            raise ValueError(f"margin must not be negative, got {self.margin}")
        if not self.noise_sigmas >= 0:
            raise ValueError(f"noise_sigmas must not be negative, got {self.noise_sigmas}")
        if not self.hold_s > 0 or not self.rate_window_s > 0:
            raise ValueError("hold_s and rate_window_s must be positive")


ROLES = ("prefill", "decode")


class ForecastPlanner:
    """The forecast law (module doc). `step(signals, now, clock)`: `now` is monotonic seconds (the
    signals' `at`), `clock` the rate log's clock (seconds since the epoch live)."""

    def __init__(
        self,
        config: PlannerConfig,
        table: CapacityTable,
        log: RateLog,
        forecast: ForecastConfig | None = None,
    ) -> None:
        self.config, self.table, self.log = config, table, log
        self.fc = forecast or ForecastConfig()
        self.last: Decision | None = None
        self.touched: list[tuple[int, int]] = []  # the rate log's slots the last step wrote
        self._seen: deque[tuple[float, float, float]] = deque()  # (now, requests, span_s) of recent reads
        self._asked: deque[tuple[float, int, int]] = deque()  # corrections: (now, prefill, decode)
        self._latency: dict[str, deque[tuple[float, bool]]] = {r: deque() for r in ROLES}
        self._extra = dict.fromkeys(ROLES, 0)
        self._extra_at = dict.fromkeys(ROLES, -math.inf)  # when the extra last moved
        self._over_at = dict.fromkeys(ROLES, -math.inf)  # when the latency was last over target
        self._changed_at = dict.fromkeys(ROLES, -math.inf)

    def _clamp(self, role: str, n: int) -> int:
        return max(getattr(self.config, f"min_{role}"), min(getattr(self.config, f"max_{role}"), n))

    def step(self, signals: Signals | None, now: float, clock: float) -> Decision:
        cfg, fc = self.config, self.fc
        self.touched = []
        ahead = self.log.forecast_ahead(clock, fc.lead_s)
        if ahead is None:
            base = {"prefill": cfg.min_prefill, "decode": cfg.min_decode}
            beyond = False
        else:
            # yesterday's minute is one Poisson draw: a rate within noise_sigmas of its count's standard
            # deviation over a row is that row's (else noise alone flips a role between two rows)
            p, d, beyond = self.table.need(max(0.0, ahead - fc.noise_sigmas * math.sqrt(ahead / 60.0)))
            base = {"prefill": p, "decode": d}
        inputs: dict[str, Any] = {"forecast_rps": None if ahead is None else round(ahead, 3),
                                  "forecast_workers": dict(base), "beyond_table": beyond}  # fmt: skip
        outage = signals is None or now - signals.at > cfg.stale_s
        if outage:
            why = "signals missing or stale: the forecast, never below the last decision"
        else:
            assert signals is not None
            why = self._observe(signals, now, clock, ahead, inputs)
        while self._asked and self._asked[0][0] <= now - fc.hold_s:
            self._asked.popleft()
        corr = {"prefill": max((a[1] for a in self._asked), default=0),
                "decode": max((a[2] for a in self._asked), default=0)}  # fmt: skip
        wanted = {}
        for role in ROLES:
            n = self._clamp(role, max(base[role], corr[role]) + self._extra[role])
            if outage and self.last is not None:
                n = max(n, getattr(self.last, role))
            wanted[role] = n
        inputs |= {"correction": corr, "extra": dict(self._extra)}
        prefill, decode = self._fit(wanted["prefill"], wanted["decode"], signals)
        for role, n in (("prefill", prefill), ("decode", decode)):
            if self.last is None or n != getattr(self.last, role):
                self._changed_at[role] = now
        self.last = Decision(now, prefill, decode, why, inputs)
        return self.last

    def _observe(
        self, s: Signals, now: float, clock: float, ahead: float | None, inputs: dict[str, Any]
    ) -> str:
        cfg, fc = self.config, self.fc
        reasons = []
        if s.arrivals_rps is not None and s.span_s:
            requests = s.arrivals_rps * s.span_s
            self.touched = self.log.add(clock - s.span_s, clock, requests)
            self._seen.append((now, requests, s.span_s))
        while self._seen and self._seen[0][0] <= now - fc.rate_window_s:
            self._seen.popleft()
        seen = None
        if self._seen:
            seen = sum(r for _, r, _ in self._seen) / sum(span for _, _, span in self._seen)
            inputs["seen_rps"] = round(seen, 3)
            # against what the forecast said for the same minutes the rate was seen over (and ahead)
            then = self.log.forecast_ahead(clock - fc.rate_window_s, fc.rate_window_s)
            if seen > max(ahead or 0.0, then or 0.0) * (1 + fc.margin):
                p, d, beyond = self.table.need(seen)
                self._asked.append((now, p, d))
                inputs |= {
                    "seen_workers": {"prefill": p, "decode": d},
                    "beyond_table": beyond or inputs["beyond_table"],
                }
                reasons.append(f"seen {seen:.1f}/s is over the forecast: {p} prefill, {d} decode")
        for role, latency, target in (
            ("prefill", s.prefill.latency_s, cfg.ttft_target_s),
            ("decode", s.decode.latency_s, cfg.tpot_target_s),
        ):
            rs = getattr(s, role)
            asked = getattr(self.last, role) if self.last else rs.workers
            hist = self._latency[role]
            if latency is not None:  # an interval in which nothing finished says nothing either way
                over = latency > target
                hist.append((now, over and rs.workers >= asked))
                if over:
                    self._over_at[role] = now
            while hist and hist[0][0] <= now - cfg.window_s:
                hist.popleft()
            pressure = None if latency is None else round(latency / target, 4)
            inputs[role] = {"workers": rs.workers, "latency_s": latency, "pressure": pressure}
            settled = now - max(self._changed_at[role], self._extra_at[role]) >= cfg.window_s
            if len(hist) >= 2 and all(o for _, o in hist) and settled:
                if getattr(self.last, role, 0) < getattr(cfg, f"max_{role}"):
                    self._extra[role] += 1
                    self._extra_at[role] = now
                    hist.clear()
                    reasons.append(f"{role} p90 over target all window with all workers ready: one more")
            elif self._extra[role] and now - max(self._over_at[role], self._extra_at[role]) >= fc.hold_s:
                self._extra[role] -= 1
                self._extra_at[role] = now
                reasons.append(f"{role} within target for {fc.hold_s:.0f} s: one extra fewer")
        return "; ".join(reasons) or "the forecast"

    def _fit(self, prefill: int, decode: int, s: Signals | None) -> tuple[int, int]:
        """Within the budget: the role whose latency is further under its target gives way."""
        cfg = self.config

        def pressure(role: str, target: float) -> float:
            latency = None if s is None else getattr(s, role).latency_s
            return 0.0 if latency is None else latency / target

        p, d = pressure("prefill", cfg.ttft_target_s), pressure("decode", cfg.tpot_target_s)
        return within_budget(cfg, prefill, decode, p, d)
