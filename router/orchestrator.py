"""What every request's trip shares, one per router: the worker pool (router/workers.py), the HTTP
client to the services, the request-record writer and this router's owned set (Redis), the metrics.
The trip itself, phase by phase, starts at router/request.py."""

from __future__ import annotations

from typing import Any

import httpx

from common.cluster.owners import RouterOwnership
from common.cluster.record_writer import RecordWriter
from common.cluster.state import ClusterState
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.placement import Candidate, Route, choose_route
from router.workers import Worker, WorkerPool

__all__ = ["Orchestrator", "Route"]


class Orchestrator:
    """Shared by all requests of one router: worker pool, HTTP client, state store, metrics."""

    def __init__(
        self,
        config: RouterConfig,
        state: ClusterState | None,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        router_id: str,
        index: Any = None,
        tokenizer: str | None = None,
    ) -> None:
        """`index`: a KV index (common.cluster.kv_events.KVIndex) for prefix-aware routing; None routes on
        load alone. `tokenizer`: the fingerprint of the router's tokenizer; registered services with
        another are not routed to (router/workers.py)."""
        self.config, self.state, self.client, self.metrics = config, state, client, metrics
        self.router_id = router_id
        self.pool = WorkerPool(state, config.decode_urls, config.prefill_urls, index, tokenizer)
        # the router writes each request's end, so it may write a record Redis lost (restart) again
        self.records = RecordWriter(state.records, restore_lost=True) if state is not None else None
        self.owners: RouterOwnership | None = None  # set by the app while it runs (with Redis)

    def route(
        self,
        prompt_tokens: int,
        prefills: list[Worker],
        shared_prefix: bool = False,
        decode_hit: Candidate | None = None,
        prefill_hit: Candidate | None = None,
    ) -> Route:
        """Split or local, and why, with this router's local_prefill_threshold (router/placement.py,
        `choose_route`)."""
        threshold = self.config.local_prefill_threshold
        return choose_route(threshold, prompt_tokens, prefills, shared_prefix, decode_hit, prefill_hit)
