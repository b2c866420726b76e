"""Router metrics on a registry of its own (not the process default), so one process can hold
several apps (tests) without duplicate-metric errors."""

from __future__ import annotations

import functools
import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.runtime.gc_pauses import GCPauses
from router.auth.keys import InvalidKey

# Seconds; TTFT spans a queued prefill, ITL a single decode step.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# placement in the router: the 2 ms goal of issue 33 sits on a bucket edge
_PLACEMENT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# The label values the router's code uses (the request's phases from router/request.py, access.py): their
# children are made at start, so each reads 0 until its first event (tests/integration/
# test_observability.py queries every dashboard panel through a real Prometheus).
ENDPOINTS = ("completions", "chat")
STATUSES = ("finished", "failed", "cancelled", "rejected")
ROUTES = (
    ("split", "long_prompt"),
    ("local", "short_prompt"),
    ("local", "no_prefill_worker"),
    ("local", "prefill_failed"),
    ("local", "shared_prefix"),
    ("local", "cached_prefix"),
    ("local", "slo"),
)
PREFIX_KINDS = ("prompt", "predicted_hit", "reused")
PATHS = ("split", "local")
MIGRATION_REASONS = ("lost", "stalled", "gave_up")
SHED_REASONS = ("queue_depth", "queue_wait", "start_timeout", "slo")
AUTH_REFUSALS = (*InvalidKey.MESSAGES, "forbidden")  # 401 reasons, then 403
LIMITS = ("requests", "tokens", "concurrency")
# Tenants (router.access): a bounded label. The first `max_tenants` tenants seen since start keep their
# name; later ones are counted as TENANT_OTHER, requests without a key (auth off) as TENANT_NONE.
TENANT_NONE, TENANT_OTHER = "_none", "_other"
# Models: a bounded label (the router's configured models, router/served_model.py); requests refused before
# they named one of them (bad JSON, an unknown model) count as NO_MODEL when the router serves several.
NO_MODEL = "_none"
TENANT_STATUSES = ("accepted", "rate_limited")  # admitted past the key's limits, or refused with 429
TOKEN_KINDS = ("prompt", "output")
DEFAULT_MAX_TENANTS = 20
WORKER_ROLES = ("prefill", "decode")
# transfer_failure_policy -> the outcomes it can count (retry falls back to recomputing on the last try)
POLICY_OUTCOMES = {"retry": ("retried", "recomputed"), "recompute": ("recomputed",), "fail": ("failed",)}


class TenantLabels:
    """The `tenant` label value of a tenant: its own name for the first `limit` distinct tenants seen
    (this process, since start), TENANT_OTHER for the rest, TENANT_NONE for no tenant (no key). A tenant
    whose name is one of those two is counted as TENANT_OTHER, so they keep their meaning."""

    def __init__(self, limit: int = DEFAULT_MAX_TENANTS) -> None:
        self.limit = limit
        self.named: set[str] = set()

    def __call__(self, tenant: str | None) -> str:
        if tenant is None:
            return TENANT_NONE
        if tenant in self.named:
            return tenant
        if tenant in (TENANT_NONE, TENANT_OTHER) or len(self.named) >= self.limit:
            return TENANT_OTHER
        self.named.add(tenant)
        return tenant


class RouterMetrics:
    """Every router metric; `render()` gives the Prometheus text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        r.register(GCPauses())  # the process's garbage-collector passes (common/runtime/gc_pauses.py)
        p = "splitserve_router_"
        self.requests = Counter(
            p + "requests",
            "Requests by endpoint, outcome and served model (_none: refused before naming one, with "
            "several models)",
            ["endpoint", "status", "model"],
            registry=r,
        )
        self.routes = Counter(p + "route_decisions", "Routing decisions", ["route", "reason"], registry=r)
        self.prefix_blocks = Counter(
            p + "prefix_blocks",
            "Prompt blocks at a request's first placement, per role: all its full blocks (prompt), those the "
            "KV index said the chosen worker held (predicted_hit), those the worker really reused (reused)",
            ["role", "kind"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "ttft_seconds", "Time to first token", ["route"], registry=r, buckets=_TTFT_BUCKETS
        )
        self.itl = Histogram(
            p + "itl_seconds",
            "Gap between streamed token batches",
            ["route"],
            registry=r,
            buckets=_ITL_BUCKETS,
        )
        self.tpot = Histogram(
            p + "tpot_seconds",
            "Per-request mean time per output token after the first",
            ["route"],
            registry=r,
            buckets=_ITL_BUCKETS,
        )
        self.e2e = Histogram(
            p + "e2e_seconds",
            "Request latency, arrival to last token",
            ["route"],
            registry=r,
            buckets=_E2E_BUCKETS,
        )
        self.placement = Histogram(
            p + "placement_seconds",
            "A request's first placement in the router: its candidates (registry read, at most once per "
            "0.25 s), their ranking and the route, with SLO admission; not the services' round trips",
            registry=r,
            buckets=_PLACEMENT_BUCKETS,
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.arrivals = Counter(
            p + "arrivals",
            "Requests let in (valid, within their key's limits), counted on arrival, before any shedding: "
            "the demand the planner's forecast records per minute",
            registry=r,
        )
        self.output_tokens = Counter(p + "output_tokens", "Tokens generated and delivered", registry=r)
        self.slo_misses = Counter(p + "slo_misses", "Requests over an SLO", ["slo"], registry=r)
        self.transfer_failures = Counter(
            p + "transfer_failures",
            "Prefill or KV-transfer failures, by the policy applied",
            ["policy", "outcome"],
            registry=r,
        )
        self.prefill_retries = Counter(
            p + "prefill_retries", "Prefill calls retried on another worker", registry=r
        )
        self.migrations = Counter(
            p + "migrations",
            "Requests moved to another decode service, by what happened to the old one (lost: the stream "
            "broke or closed; stalled: no token for decode_stall_s; gave_up: max_migrations reached)",
            ["reason"],
            registry=r,
        )
        self.shed = Counter(
            p + "shed",
            "Requests refused with 503 for overload (queue_depth: every decode service's "
            "queue at max_decode_queue; queue_wait: every queue older than start_timeout_s; "
            "start_timeout: placed, but no first token within start_timeout_s; connections: the router "
            "at max_connections open connections or requests in flight)",
            ["reason"],
            registry=r,
        )
        self.auth_refused = Counter(
            p + "auth_refused",
            "Calls refused for their API key (missing, malformed, unknown, revoked, expired: 401; "
            "forbidden: 403)",
            ["reason"],
            registry=r,
        )
        self.rate_limited = Counter(
            p + "rate_limited",
            "Requests refused with 429 by their key's limits (requests, tokens, concurrency)",
            ["limit"],
            registry=r,
        )
        self.parse_jobs = Gauge(
            p + "parse_jobs",
            "Large requests being prepared (parsed, templated, tokenized) by the router's worker processes "
            "or waiting for one",
            registry=r,
        )
        self.parse_refused = Counter(
            p + "parse_refused",
            "Large requests refused because the router's preparation pool was full (busy: 503) or their "
            "key held its share of it (key_share: 429)",
            ["reason"],
            registry=r,
        )
        self.limits_unenforced = Counter(
            p + "rate_limits_unenforced",
            "Requests of rate-limited keys served without a limit check because Redis did not answer",
            registry=r,
        )
        self.tenant_requests = Counter(
            p + "tenant_requests",
            "Generation requests past authentication, by tenant (bounded: the first "
            "metrics_max_tenants tenants, then _other; _none: no key) and admission (accepted, or "
            "rate_limited: refused with 429)",
            ["tenant", "status"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            p + "tenant_tokens",
            "Tokens of accepted requests by tenant (as tenant_requests) and kind (prompt, output): what "
            "the key's tokens-per-minute limit counts",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenants = TenantLabels(max_tenants)
        self._tenant_children: set[str] = set()
        self.state_errors = Counter(p + "state_errors", "Redis record writes that failed", registry=r)
        self.inflight = Gauge(p + "inflight_requests", "Requests being served now", registry=r)
        self.slo_met = Counter(
            p + "goodput_requests",
            "Finished requests that met every configured SLO (TTFT and TPOT)",
            registry=r,
        )
        self.slo_judged = Counter(
            p + "slo_judged_requests", "Finished requests judged against the SLOs", registry=r
        )
        self.goodput = Gauge(
            p + "goodput_ratio",
            "Share of finished requests meeting every configured SLO since start "
            "(for a window: rate(goodput_requests_total) / rate(slo_judged_requests_total))",
            registry=r,
        )
        self._met = self._judged = 0
        self._zero()

    def _zero(self) -> None:
        """Every labelled child whose label values are known up front, exported as 0 from the start:
        a dashboard panel or an alert then reads 0 rather than "no data" until the first event."""
        for route, reason in ROUTES:
            self.routes.labels(route, reason)
        for role in WORKER_ROLES:
            for kind in PREFIX_KINDS:
                self.prefix_blocks.labels(role, kind)
        for path in PATHS:
            for hist in (self.ttft, self.itl, self.tpot, self.e2e):
                hist.labels(path)
        for slo in ("ttft", "tpot"):
            self.slo_misses.labels(slo)
        for reason in MIGRATION_REASONS:
            self.migrations.labels(reason)
        for reason in SHED_REASONS:
            self.shed.labels(reason)
        for reason in AUTH_REFUSALS:
            self.auth_refused.labels(reason)
        for reason in ("busy", "key_share"):
            self.parse_refused.labels(reason)
        for limit in LIMITS:
            self.rate_limited.labels(limit)

    def serve_models(self, names: list[str]) -> None:
        """The `model` label values (the served models): their request counters start at 0."""
        for model in names:
            for endpoint in ENDPOINTS:
                for status in STATUSES:
                    self.requests.labels(endpoint, status, model)

    def tenant(self, tenant: str | None) -> str:
        """The bounded label value of `tenant` (None: no key); its children start at 0 when first seen,
        so a tenant's 429 and token series exist from its first request."""
        label = self.tenants(tenant)
        if label not in self._tenant_children:
            self._tenant_children.add(label)
            for status in TENANT_STATUSES:
                self.tenant_requests.labels(label, status)
            for kind in TOKEN_KINDS:
                self.tenant_tokens.labels(label, kind)
        return label

    def watch(self, orch: Any) -> None:
        """Gauges read from the orchestrator at scrape time: what waits for Redis. The transfer-failure
        outcomes its policy can produce start at 0."""
        for outcome in POLICY_OUTCOMES.get(orch.config.transfer_failure_policy, ()):
            self.transfer_failures.labels(orch.config.transfer_failure_policy, outcome)
        r, p = self.registry, "splitserve_router_"
        pending = Gauge(p + "record_writes_pending", "Record writes waiting for Redis to be back", registry=r)
        pending.set_function(lambda: orch.records.pending if orch.records else 0)
        stale = Gauge(
            p + "registry_stale_reads", "Routing decisions made on the last known worker list", registry=r
        )
        stale.set_function(lambda: orch.pool.stale_reads)
        orphans = Gauge(
            p + "orphans_failed",
            "Requests of a router that died, recorded as failed by this one (count since start)",
            registry=r,
        )
        orphans.set_function(lambda: orch.owners.swept if orch.owners else 0)
        workers = Gauge(
            p + "registered_workers",
            "Prefill / decode services the router routes on, as of its last registry read (each routed "
            "request and each /health; the last known list while Redis is away; a static list's length)",
            ["worker_role"],
            registry=r,
        )
        for role in WORKER_ROLES:
            workers.labels(role).set_function(functools.partial(_known_workers, orch.pool, role))
        untrusted = getattr(orch.pool, "untrusted", None)
        if untrusted is not None:  # the registry's pool (a static list has no entries to distrust)
            Gauge(
                p + "registry_untrusted_entries",
                "Registry entries left out because their signature is missing or does not verify (written "
                "into Redis by something without the internal secret); since start",
                registry=r,
            ).set_function(untrusted)
        if isinstance(getattr(orch.pool, "other_tokenizer", None), dict):
            Gauge(
                p + "registry_other_tokenizer_workers",
                "Registered services left out because their tokenizer is not this router's (their token "
                "ids would mean other text); since start",
                registry=r,
            ).set_function(lambda: len(orch.pool.other_tokenizer))
        if isinstance(getattr(orch.pool, "other_model", None), dict):
            Gauge(
                p + "registry_other_model_workers",
                "Registered services left out because they serve a model this router does not (their "
                "registered name is none of its served models'); since start",
                registry=r,
            ).set_function(lambda: len(orch.pool.other_model))
        index = getattr(orch.pool, "index", None)  # prefix-aware routing's KV index (kv_events.py)
        if index is not None:
            for name, attr, text in (
                ("kv_index_events_applied", "events_applied", "Block hashes added or removed (since start)"),
                ("kv_index_resyncs", "resyncs", "Worker snapshots loaded: start, gap, trim or restart"),
                ("kv_index_errors", "errors", "KV index polls that failed on Redis (count since start)"),
                ("kv_index_lag_seconds", "lag_s", "Age of the newest KV event in the index's last read"),
            ):
                Gauge(p + name, text, registry=r).set_function(functools.partial(getattr, index, attr))

    def judge(self, met: bool) -> None:
        """Count one finished request against the SLOs."""
        self._judged += 1
        self._met += met
        self.slo_judged.inc()
        if met:
            self.slo_met.inc()
        self.goodput.set(self._met / self._judged)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _known_workers(pool: Any, role: str) -> float:
    """The pool's last known count of `role` workers; NaN rather than a failed scrape (never raises)."""
    try:
        return float(pool.known(role))
    except Exception:
        return math.nan
