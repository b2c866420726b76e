"""What the planner reads: each role's workers and their load from the worker registry (Redis: what the
services heartbeat every second), and the router's TTFT and TPOT histograms from its /metrics, as the
p90 of what was observed since the previous read (bucket deltas, interpolated as Prometheus'
histogram_quantile does). A read that fails is None: the planner then holds its last decision."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from common.cluster.state import ClusterState
from planner.policy import RoleSignals, Signals

log = logging.getLogger("splitserve.planner")
Buckets = dict[float, float]  # upper bound -> cumulative count


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of a cumulative histogram (None when it holds nothing); linear within a bucket,
    the largest finite bound for the +Inf bucket."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def parse_histograms(text: str, names: tuple[str, ...]) -> dict[str, Buckets]:
    """Cumulative buckets of each named histogram, summed over its labels (routes)."""
    out: dict[str, Buckets] = {name: {} for name in names}
    for family in text_string_to_metric_families(text):
        if family.name not in out:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                out[family.name][le] = out[family.name].get(le, 0.0) + sample.value
    return out


class SignalReader:
    TTFT, TPOT = "splitserve_router_ttft_seconds", "splitserve_router_tpot_seconds"

    def __init__(self, redis_url: str, router_url: str | None, api_key: str | None = None) -> None:
        self.state = ClusterState.from_url(redis_url)
        self.router_url = router_url.rstrip("/") if router_url else None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._previous: dict[str, Buckets] | None = None

    async def read(self) -> Signals | None:
        try:
            roles = {role: await self._role(role) for role in ("prefill", "decode")}
            latency = await self._latency()
        except Exception as e:  # noqa: BLE001 - any failure to read is an outage: hold, say why
            log.warning("signals unavailable (%s): holding", type(e).__name__)
            return None
        return Signals(
            time.monotonic(),
            RoleSignals(roles["prefill"][0], latency.get(self.TTFT), roles["prefill"][1]),
            RoleSignals(roles["decode"][0], latency.get(self.TPOT), roles["decode"][1], roles["decode"][2]),
        )

    async def _role(self, role: str) -> tuple[int, int, float]:
        workers = await self.state.registry.alive(role)
        waiting = sum(int(w.load.get("waiting", 0)) for w in workers)
        total = sum(int(w.load.get("total_blocks", 0)) for w in workers)
        free = sum(int(w.load.get("free_blocks", 0)) for w in workers)
        return len(workers), waiting, (total - free) / total if total else 0.0

    async def _latency(self) -> dict[str, float]:
        """p90 TTFT and TPOT since the previous read; empty without a router or before two reads."""
        if self.router_url is None:
            return {}
        async with httpx.AsyncClient(timeout=5.0) as client:
            r = await client.get(self.router_url + "/metrics", headers=self.headers)
            r.raise_for_status()
        now = parse_histograms(r.text, (self.TTFT, self.TPOT))
        before, self._previous = self._previous, now
        if before is None:
            return {}
        out = {}
        for name, buckets in now.items():
            delta = {le: c - before.get(name, {}).get(le, 0.0) for le, c in buckets.items()}
            p90 = histogram_quantile(0.9, delta)
            if p90 is not None:
                out[name] = p90
        return out

    async def close(self) -> None:
        await self.state.close()


def describe(signals: Signals | None) -> dict[str, Any]:
    return {} if signals is None else {"prefill": vars(signals.prefill), "decode": vars(signals.decode)}
