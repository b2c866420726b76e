"""What the prefill and decode services share: engine start-up, registry heartbeat, request-record
updates that never take a request down, msgpack bodies and the health/metrics routes."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from common.config import EngineConfig, ServiceConfig
from common.engine.async_engine import AsyncEngine
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.leases import LeaseKeeper
from common.protocol import Message, ProtocolError, decode, encode
from common.state import Heartbeat, IllegalTransition, RequestState, StateStore, UnknownRequest

log = logging.getLogger(__name__)
MSGPACK = "application/msgpack"


class ServiceMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("splitserve_requests", "requests by outcome", ["role", "outcome"], registry=r)
        self.running = Gauge("splitserve_running_sequences", "sequences in the running batch", registry=r)
        self.waiting = Gauge("splitserve_waiting_sequences", "sequences waiting for KV blocks", registry=r)
        self.blocks_free = Gauge("splitserve_kv_blocks_free", "free KV blocks (incl. evictable)", registry=r)
        self.blocks_total = Gauge("splitserve_kv_blocks_total", "KV blocks", registry=r)
        self.preemptions = Gauge("splitserve_preemptions", "preemptions by kind", ["kind"], registry=r)
        self.expired_leases = Gauge(
            "splitserve_expired_peer_leases", "transfers ended by a peer's expired lease", registry=r
        )
        self.role = role


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

    def add_common_routes(self, app: FastAPI) -> None:
        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "role": self.cfg.role, "worker_id": self.cfg.worker_name, **self.load()}

        @app.get("/metrics")
        async def metrics() -> Response:
            m, load = self.metrics, self.load()
            m.running.set(load["running"])
            m.waiting.set(load["waiting"])
            m.blocks_free.set(load["free_blocks"])
            m.blocks_total.set(load["total_blocks"])
            m.expired_leases.set(self.leases.expired if self.leases else 0)
            for key, n in self.engine.scheduler.stats.items():
                if key.startswith("preempt_"):
                    m.preemptions.labels(kind=key.removeprefix("preempt_")).set(n)
            return PlainTextResponse(
                generate_latest(m.registry).decode(), media_type="text/plain; version=0.0.4"
            )


async def read_message(request: Request, expect: type[Message]) -> Any:
    """The msgpack body as `expect`; ProtocolError (-> 400) if it is anything else."""
    return decode(await request.body(), expect)


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
