"""What the planner reads: each role's workers and their load from the worker registry (Redis: what the
services heartbeat every second), and the router's TTFT and TPOT histograms from its /metrics, as the
p90 of what was observed since the previous read (bucket deltas, interpolated as Prometheus'
histogram_quantile does). A read that fails is None: the planner then holds its last decision.

The utilization signals (planner/policy.py), from figures the services and the router already export:
- prefill: demand, the router's prompt-token counter (`splitserve_router_prompt_tokens_total`) per second
  since the previous read; per worker, the mean of the prefill workers' capacity: the tokens per second
  of a step at their token budget (`step_tokens`) by their fit of step time against tokens
  (`prefill_step_ms` + `prefill_ms_per_token` x tokens, in the registry load;
  common/cluster/capacity.py), or their measured `prefill_tps` (recent steps' tokens per second) until
  they have fitted; workers not yet measured (0) left out; the backlog, their `queued_tokens`. The
  average alone under-rates a worker whose steps have been small, each mostly a step's fixed cost
  (1.6-1.9x on SmolLM2 on a CPU: ~55 ms a step plus ~1 ms a token, 512-token steps).
- decode: demand, the decode workers' `running` (sequences counted against max_num_seqs); per worker,
  the `max_num_seqs` of their registry capacity (the smallest, if they differ); finished per second, the
  TPOT histogram's count since the previous read (one per finished request).
The arrivals (the forecast law, planner/forecast.py): the router's `splitserve_router_arrivals_total` per
second since the previous read, with the seconds that read spans.
Unknown until two reads, or without a router (no counter): the planner then decides on latency, queues
and KV alone, as before. With several routers (`discover`) every figure is their sum (SignalReader)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import ssl
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from common.cluster.capacity import prefill_capacity
from common.cluster.owners import live_router_urls
from common.cluster.registry import WorkerInfo
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


def parse_counter(text: str, name: str) -> float | None:
    """A counter's total over its labels (`name` without `_total`); None when the text has no such family."""
    found = None
    for family in text_string_to_metric_families(text):
        if family.name == name:
            found = sum(s.value for s in family.samples if s.name == name + "_total")
    return found


@dataclass(frozen=True)
class RoleLoad:
    """One role's figures summed over its alive workers' registry entries."""

    workers: int
    waiting: int
    kv_used: float
    running: int
    queued_tokens: int
    per_worker: float | None  # prefill: mean capacity (full step); decode: max_num_seqs; None: unknown


def role_load(role: str, workers: list[WorkerInfo]) -> RoleLoad:
    def total(key: str) -> int:
        return sum(int(w.load.get(key, 0)) for w in workers)

    blocks, free = total("total_blocks"), total("free_blocks")
    per_worker: float | None = None
    if role == "prefill":
        speeds = [v for w in workers if (v := prefill_capacity(w.load)) > 0]
        per_worker = sum(speeds) / len(speeds) if speeds else None
    else:
        seqs = [int(w.capacity.get("max_num_seqs", 0)) for w in workers]
        per_worker = float(min(seqs)) if seqs and min(seqs) > 0 else None
    return RoleLoad(
        len(workers), total("waiting"), (blocks - free) / blocks if blocks else 0.0, total("running"),
        total("queued_tokens"), per_worker,
    )  # fmt: skip


@dataclass(frozen=True)
class RouterRead:
    """One router's /metrics at one read: when, its TTFT/TPOT buckets, its prompt-token and arrivals
    counters (None: the text has no such counter)."""

    at: float
    hists: dict[str, Buckets]
    tokens: float | None
    arrivals: float | None


class SignalReader:
    """The signals, each read. The router's figures come from one router (`router_url`) or from every
    live router the registry lists (`discover`: each router registers its URL, common/cluster/owners.py),
    summed: histogram bucket deltas added before the p90, counter rates added. A router's first read is
    its baseline (nothing counted from it until the next); a router that does not answer fails the whole
    read (the planner holds), until its registration expires."""

    TTFT, TPOT = "splitserve_router_ttft_seconds", "splitserve_router_tpot_seconds"
    PROMPT_TOKENS = "splitserve_router_prompt_tokens"
    ARRIVALS = "splitserve_router_arrivals"

    def __init__(
        self,
        redis_url: str,
        router_url: str | None,
        api_key: str | None = None,
        *,
        discover: bool = False,
        check_hostname: bool = True,
    ) -> None:
        if discover and router_url:
            raise ValueError("--router-url or --discover-routers, not both")
        self.state = ClusterState.from_url(redis_url)
        self.router_url = router_url.rstrip("/") if router_url else None
        self.discover = discover
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.verify: ssl.SSLContext | bool = True
        if not check_hostname:  # the chain to the CA alone: routers registered at pod IPs
            self.verify = ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE") or None)
            self.verify.check_hostname = False
        self._previous: dict[str, RouterRead] = {}  # router (id, or URL) -> its previous read
        self._none_said = False  # discovery found no router, and said so
        self._read_routers: int | None = None  # how many routers the last read read

    async def read(self) -> Signals | None:
        try:
            roles = {role: await self._role(role) for role in ("prefill", "decode")}
            latency = await self._latency()
        except Exception as e:  # noqa: BLE001 - any failure to read is an outage: hold, say why
            log.warning("signals unavailable (%s: %s): holding", type(e).__name__, e)
            return None
        p, d = roles["prefill"], roles["decode"]
        prompt_tps, finished_per_s = latency.get(self.PROMPT_TOKENS), latency.get("finished_per_s")
        arrivals, span = latency.get(self.ARRIVALS), latency.get("span_s")
        return Signals(
            time.monotonic(),
            RoleSignals(
                p.workers, latency.get(self.TTFT), p.waiting,
                demand=prompt_tps, per_worker=p.per_worker, queued_tokens=p.queued_tokens,
            ),
            RoleSignals(
                d.workers, latency.get(self.TPOT), d.waiting, d.kv_used,
                demand=float(d.running) if d.per_worker else None, per_worker=d.per_worker,
                finished_per_s=finished_per_s,
            ),
            arrivals, span if arrivals is not None else None, self._read_routers,
        )  # fmt: skip

    async def _role(self, role: str) -> RoleLoad:
        return role_load(role, await self.state.registry.alive(role))

    async def _routers(self) -> dict[str, str]:
        if not self.discover:
            return {self.router_url: self.router_url} if self.router_url else {}
        found = await live_router_urls(self.state.redis, self.state.prefix)
        if not found and not self._none_said:  # said once, until a router is found again
            log.warning(
                "--discover-routers: no router has registered its URL in Redis (none running, or one of an "
                "older version): deciding without the routers' latency and arrivals"
            )
        self._none_said = not found
        return found

    async def _metrics(self, client: httpx.AsyncClient, name: str, url: str) -> str:
        try:
            r = await client.get(url.rstrip("/") + "/metrics", headers=self.headers)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise RuntimeError(f"router {name} ({url}): {type(e).__name__}: {e}") from e
        return r.text

    async def _latency(self) -> dict[str, float]:
        """p90 TTFT and TPOT since the previous read, the prompt tokens, finished requests and arrivals
        per second, over every router read; empty without a router or before two reads of one."""
        routers = await self._routers()
        self._read_routers = len(routers) if routers else None
        if not routers:
            self._previous = {}
            return {}
        async with httpx.AsyncClient(timeout=5.0, verify=self.verify) as client:
            texts = await asyncio.gather(
                *(self._metrics(client, n, u) for n, u in routers.items()), return_exceptions=True
            )
        failed = [t for t in texts if isinstance(t, BaseException)]
        if failed:
            raise failed[0]
        at = time.monotonic()
        reads = {}
        for name, text in zip(routers, texts, strict=True):
            assert isinstance(text, str)
            reads[name] = RouterRead(
                at, parse_histograms(text, (self.TTFT, self.TPOT)), parse_counter(text, self.PROMPT_TOKENS),
                parse_counter(text, self.ARRIVALS),
            )  # fmt: skip
        before, self._previous = self._previous, reads
        summed: dict[str, Buckets] = {self.TTFT: {}, self.TPOT: {}}
        rates: dict[str, float] = {}
        spans = []
        for name, now in reads.items():
            then = before.get(name)
            if then is None or now.at <= then.at:
                continue
            span = now.at - then.at
            spans.append(span)
            for hist, buckets in now.hists.items():
                delta = summed.setdefault(hist, {})
                for le, c in buckets.items():
                    delta[le] = delta.get(le, 0.0) + c - then.hists.get(hist, {}).get(le, 0.0)
            if now.tokens is not None and then.tokens is not None:  # a reset: 0, not < 0
                rates[self.PROMPT_TOKENS] = (
                    rates.get(self.PROMPT_TOKENS, 0.0) + max(0.0, now.tokens - then.tokens) / span
                )
            if now.arrivals is not None and then.arrivals is not None:
                # a router restarted between two reads counts from 0: what it counted since is the least
                # that arrived (not a negative rate)
                grew = now.arrivals - then.arrivals
                rates[self.ARRIVALS] = (
                    rates.get(self.ARRIVALS, 0.0) + (grew if grew >= 0 else now.arrivals) / span
                )
            tpot = now.hists.get(self.TPOT, {})
            if tpot:
                top = max(tpot)
                finished = max(0.0, tpot[top] - then.hists.get(self.TPOT, {}).get(top, 0.0))
                rates["finished_per_s"] = rates.get("finished_per_s", 0.0) + finished / span
        if not spans:
            return {}
        out = {"span_s": max(spans), **rates}
        for hist, delta in summed.items():
            p90 = histogram_quantile(0.9, delta)
            if p90 is not None:
                out[hist] = p90
        return out

    async def close(self) -> None:
        await self.state.close()


def describe(signals: Signals | None) -> dict[str, Any]:
    if signals is None:
        return {}
    out: dict[str, Any] = {"prefill": vars(signals.prefill), "decode": vars(signals.decode)}
    if signals.routers is not None:
        out["routers"] = signals.routers  # how many routers' /metrics this decision read
    return out
