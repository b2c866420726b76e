"""What the prefill and decode services share: engine start-up, registry heartbeat, request-record
updates that never take a request down, msgpack bodies and the health/metrics routes."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage

from common.config import EngineConfig, ServiceConfig
from common.engine.async_engine import AsyncEngine
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.leases import LeaseKeeper
from common.protocol import AbortRequest, Message, ProtocolError, decode, encode
from common.state import Heartbeat, IllegalTransition, RequestState, StateStore, UnknownRequest
from common.telemetry import fastapi_telemetry, setup_tracing

log = logging.getLogger(__name__)
MSGPACK = "application/msgpack"


# Seconds. Queue waits and TTFT span a crowded queue; ITL/TPOT one engine step.
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ServiceMetrics:
    """A service's own registry: histograms and counters observed as requests go, plus the engine's
    and the KV transport's figures, read at scrape time by `_EngineCollector` (nothing on the hot path)."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.role = role
        self.requests = Counter("splitserve_requests", "requests by outcome", ["role", "outcome"], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, registry=r, buckets=buckets)

        self.queue_wait = hist(
            "splitserve_queue_wait_seconds", "arrival to admission (KV blocks granted)", _WAIT_BUCKETS
        )
        self.ttft = hist(
            "splitserve_ttft_seconds",
            "arrival to the first token known here (prefill: sampled; decode: first frame sent)",
            _WAIT_BUCKETS,
        )
        self.itl = hist("splitserve_itl_seconds", "gap between token frames sent (decode)", _STEP_BUCKETS)
        self.tpot = hist(
            "splitserve_tpot_seconds", "per-request mean time per output token after the first", _STEP_BUCKETS
        )
        self.e2e = hist("splitserve_e2e_seconds", "arrival to the request's end here", _E2E_BUCKETS)
        self.prefill_compute = hist(
            "splitserve_prefill_compute_seconds", "first prefill chunk start to last chunk end", _WAIT_BUCKETS
        )
        self.transfer = hist(
            "splitserve_kv_transfer_seconds",
            "first layer write to kv_done delivered (prefill)",
            _WAIT_BUCKETS,
        )
        self.transfer_active = hist(
            "splitserve_kv_transfer_active_seconds",
            "time at least one layer write was in flight (prefill); bandwidth = "
            "rate(splitserve_kv_transfer_bytes_total) / rate(this _sum)",
            _WAIT_BUCKETS,
        )
        self.transfer_failures = Counter(
            "splitserve_kv_transfer_failures", "KV transfers that failed, by reason", ["reason"], registry=r
        )


class _EngineCollector:
    """Gauges and counters read from the engine, block manager, leases and KV transport per scrape.
    Read from the event-loop thread while the engine thread runs: approximate by nature."""

    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def collect(self) -> Iterator[Metric]:
        svc = self.svc
        load, bm = svc.load(), svc.engine.block_manager

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge(
            "splitserve_running_sequences", "sequences running or holding a reservation", load["running"]
        )
        yield gauge(
            "splitserve_waiting_sequences", "queue depth: sequences waiting for KV blocks", load["waiting"]
        )
        yield gauge(
            "splitserve_kv_blocks_free", "free KV blocks (incl. evictable cached ones)", load["free_blocks"]
        )
        yield gauge(
            "splitserve_kv_blocks_used", "KV blocks in use", load["total_blocks"] - load["free_blocks"]
        )
        yield gauge("splitserve_kv_blocks_total", "KV blocks", load["total_blocks"])
        preempt = CounterMetricFamily("splitserve_preemptions", "preemptions by kind", labels=["kind"])
        for key, n in list(svc.engine.scheduler.stats.items()):
            if key.startswith("preempt_"):
                preempt.add_metric([key.removeprefix("preempt_")], n)
        yield preempt
        queries, hits = bm.prefix_queries, bm.prefix_hits
        yield CounterMetricFamily(
            "splitserve_prefix_cache_queries",
            "full prompt blocks looked up in the prefix cache",
            value=queries,
        )
        yield CounterMetricFamily(
            "splitserve_prefix_cache_hits", "prompt blocks found in the prefix cache", value=hits
        )
        yield gauge(
            "splitserve_prefix_cache_hit_rate", "hits / queries since start", hits / queries if queries else 0
        )
        yield CounterMetricFamily(
            "splitserve_expired_peer_leases",
            "transfers ended because the peer's lease expired",
            value=svc.leases.expired if svc.leases else 0,
        )
        for name, doc, value in svc.transfer_counters():
            yield CounterMetricFamily(name, doc, value=value)


class RequestIdMiddleware:
    """x-request-id on every response: the message's request id when the handler read one
    (`read_message` puts it in request.state), else a fresh id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def send_with_id(message: ASGIMessage) -> None:
            if message["type"] == "http.response.start":
                rid = state.get("request_id") or f"req-{uuid.uuid4().hex}"
                headers = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class Service:
    """One engine-backed service: engine thread, optional Redis state and heartbeat, metrics."""

    def __init__(self, cfg: ServiceConfig, engine: LLMEngine) -> None:
        self.cfg = cfg
        self.engine = engine
        self.aengine: AsyncEngine | None = None
        self.state: StateStore | None = None
        self.heartbeat: Heartbeat | None = None
        self.leases: LeaseKeeper | None = None
        self.metrics = ServiceMetrics(cfg.role)
        self.metrics.registry.register(_EngineCollector(self))
        setup_tracing(cfg.role)

    @staticmethod
    def build_engine(engine_cfg: EngineConfig) -> LLMEngine:
        return LLMEngine.from_config(engine_cfg)

    def load(self) -> dict[str, Any]:
        """Load figures for the registry (read from another thread: approximate by nature)."""
        sched, bm = self.engine.scheduler, self.engine.block_manager
        return {
            "running": len(sched.running) + len(sched.reserved),
            "waiting": len(sched.waiting) + len(sched.reserving),
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_blocks,
        }

    def transfer_counters(self) -> list[tuple[str, str, int]]:
        """(name, help, value) of the KV transport's counters, for /metrics."""
        return []

    def queue_full(self) -> bool:
        sched = self.engine.scheduler
        return len(sched.waiting) + len(sched.reserving) >= self.cfg.max_queue

    async def start(self, kv_endpoint: str = "") -> None:
        if self.cfg.redis_url:
            self.state = StateStore.from_url(self.cfg.redis_url)
            capacity = {
                "total_blocks": self.engine.block_manager.num_blocks,
                "block_size": self.engine.config.block_size,
                "max_num_seqs": self.engine.config.max_num_seqs,
            }
            self.heartbeat = Heartbeat(
                self.state,
                self.cfg.worker_name,
                self.cfg.role,
                self.cfg.url,
                kv_endpoint,
                capacity,
                self.load,
                self.cfg.heartbeat_s,
            )
            await self.heartbeat.start()
            self.leases = LeaseKeeper(
                self.state, self.cfg.role, self.cfg.worker_name, self.cfg.lease_s, self.peer_lost
            )
            await self.leases.start()

    def peer_lost(self, request_id: str) -> None:
        """The other side of a transfer stopped renewing its lease: end the request here."""

    async def stop(self) -> None:
        if self.leases is not None:
            await self.leases.stop()
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if self.state is not None:
            await self.state.close()
        if self.aengine is not None:
            self.aengine.stop()

    async def record(self, request_id: str, new_state: RequestState, **fields: Any) -> None:
        """Best-effort request-record update: a transition another service already superseded, or a
        record the router never made (a direct call), is logged, not raised."""
        if self.state is None:
            return
        try:
            await self.state.transition(request_id, new_state, **fields)
        except (IllegalTransition, UnknownRequest) as e:
            log.debug("record %s -> %s skipped: %s", request_id, new_state, e)
        except Exception:
            log.exception("could not record %s -> %s", request_id, new_state)

    async def abort(self, request_id: str) -> None:
        """Stop the request and free what it holds (POST /internal/abort)."""
        raise NotImplementedError

    def make_app(self) -> FastAPI:
        """The FastAPI app both services start from: lifespan (start/stop), error handlers, request
        ids, /health, /metrics and /internal/abort; each service adds its own routes."""

        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            await self.start()
            yield
            await self.stop()

        app = FastAPI(title=f"splitserve {self.cfg.role}", lifespan=lifespan, **fastapi_telemetry())
        app.state.service = self
        install_error_handlers(app)
        self.add_common_routes(app)

        @app.post("/internal/abort")
        async def abort(request: Request) -> dict[str, Any]:
            msg = await read_message(request, AbortRequest)
            await self.abort(msg.request_id)
            return {"aborted": msg.request_id}

        return app

    def add_common_routes(self, app: FastAPI) -> None:
        app.add_middleware(RequestIdMiddleware)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {
                "status": "ok",
                "role": self.cfg.role,
                "worker_id": self.cfg.worker_name,
                "engine": self.engine.placement.describe(),
                **self.load(),
            }

        @app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(
                generate_latest(self.metrics.registry).decode(), media_type="text/plain; version=0.0.4"
            )


async def read_message(request: Request, expect: type[Message]) -> Any:
    """The msgpack body as `expect`; ProtocolError (-> 400) if it is anything else. Its request id
    becomes the response's x-request-id."""
    msg = decode(await request.body(), expect)
    if isinstance(getattr(msg, "request_id", None), str):
        request.state.request_id = msg.request_id
    return msg


def msgpack_response(msg: Message, status_code: int = 200) -> Response:
    return Response(encode(msg), status_code=status_code, media_type=MSGPACK)


def error_response(status_code: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "code": status_code}}, status_code=status_code, headers=headers
    )


def sampling_from_wire(d: dict[str, Any], **override: Any) -> SamplingParams:
    """SamplingParams from a message's dict (lists back to tuples); ValueError on bad values."""
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k != "stop"}
    fields.update(override)
    try:
        return SamplingParams(**fields)
    except TypeError as e:
        raise ValueError(f"bad sampling parameters: {e}") from e


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))
