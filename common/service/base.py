"""What the prefill and decode services share: the engine thread, the registry heartbeat and lease
upkeep, the table of requests in progress (one per id at a time; abort ends one and waits until it is
gone), request-record updates that never take a request down, msgpack bodies and the common routes
(/health, /metrics, /internal/abort)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest

from common.cluster.kv_events import KVEventPublisher
from common.cluster.leases import LeaseKeeper
from common.cluster.record_writer import RecordWriter
from common.cluster.records import RequestState
from common.cluster.registry import Heartbeat
from common.cluster.state import ClusterState
from common.config import EngineConfig, ServiceConfig
from common.engine.async_engine import AsyncEngine
from common.engine.kv_connector import KVConnector
from common.engine.llm_engine import LLMEngine
from common.protocol import MAX_FRAME_BYTES, AbortRequest, Message, ProtocolError, decode, encode
from common.runtime.access import AccessLog
from common.runtime.logs import adopt_loggers
from common.runtime.tasks import cancel_and_wait
from common.runtime.telemetry import fastapi_telemetry, setup_tracing
from common.security.identity import WorkerIdentity, audience
from common.security.internal_auth import InternalAuthMiddleware
from common.security.secret import InternalSecret
from common.service.metrics import EngineCollector, ServiceMetrics, TransportCount

log = logging.getLogger(__name__)
MSGPACK = "application/msgpack"
ABORT_WAIT_S = 30.0  # /internal/abort waits this long for the request to be gone
ENGINE_FAILED_EXIT = 70  # the exit status of a service whose engine failed (EX_SOFTWARE)
# An Interrupt with this code hands the request back (a role switch ran out of time): a decode stream
# closes without an error frame, so the router migrates it; a prefill call answers a retryable 503.
HANDED_BACK = 503
HANDBACK_WAIT_S = 10.0  # a role switch gives what it handed back this long to let go of its blocks
STOP_PART_S = 5.0  # each part of a service's stop (heartbeat, leases, KV events, Redis ...) gets this long
M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Interrupt:
    """The service ends a request itself (abort, a lost peer, incomplete KV); `code` is HTTP-like."""

    request_id: str
    error: str
    code: int


@dataclass(eq=False)
class Job:
    """A request this service is working on: its events (the engine's admissions and outputs, and the
    service's own Interrupts) in one queue, and when its handler has let go of everything."""

    request_id: str
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class RequestInUse(ValueError):
    """A request id this service is still working on (a retry must abort the old one first)."""


class Service:
    """One engine-backed service: engine thread, KV connector, optional Redis state, heartbeat and
    leases, metrics, and the requests in progress."""

    def __init__(self, cfg: ServiceConfig, engine: LLMEngine, secret: InternalSecret | None = None) -> None:
        self.cfg = cfg
        self.secret = InternalSecret.from_env() if secret is None else secret
        self.engine = engine
        self.aengine = AsyncEngine(engine)
        self.jobs: dict[str, Job] = {}
        self.incarnation = uuid.uuid4().hex[:12]  # this start of the process (registry, KV endpoint)
        # the name the router serves this model under (registered, and in /health)
        self.served_model = cfg.served_model_name or engine.model.config.model_id
        self.draining = False  # SIGTERM came: no new work, what runs finishes (drain_timeout_s)
        self._stopped = False  # stop() ran
        self.unstopped: list[str] = []  # the parts of stop() that did not stop in time (logged)
        self.kv_released = True  # False: a KV transport may still have the pool's memory registered
        self.identity: WorkerIdentity | None = None  # signed at /health and in the registry, from start()
        self.state: ClusterState | None = None
        self.records: RecordWriter | None = None
        self.heartbeat: Heartbeat | None = None
        self.leases: LeaseKeeper | None = None
        self.kv_events: KVEventPublisher | None = None
        self.metrics = ServiceMetrics(cfg.role)
        self.metrics.registry.register(
            EngineCollector(
                lambda: self.aengine.load,
                lambda: self.leases.expired if self.leases else 0,
                self.transfer_counters,
                engine.kv_offload.stats if engine.kv_offload is not None else (lambda: None),
            )
        )
        setup_tracing(cfg.role)
        adopt_loggers()  # NIXL's own log handler, installed when the KV backend was chosen

    def load(self) -> dict[str, Any]:
        """Load figures for /health and the registry: the engine's last published `EngineLoad` (the
        engine thread publishes one after every step and command; nothing here reads the engine)."""
        load = self.aengine.load
        return {
            "running": load.running,
            "parked": load.parked,  # of running: reservations waiting for their KV from a prefill
            "waiting": load.waiting,
            "queued_tokens": load.queued_tokens,  # prompt work ahead of a new request (routing, SLOs)
            "queue_wait_s": round(load.queue_wait_s(time.monotonic()), 3),
            "free_blocks": load.free_blocks,
            "total_blocks": load.total_blocks,
            # with layer groups the blocks above are pages, this many to a block of tokens (1: one table)
            "pages_per_block": load.pages_per_block,
            # measured on recent steps (0 until measured): what SLO-aware admission predicts from
            "prefill_tps": round(load.prefill_tps, 1),
            # over steps of long prompts only: what recomputing a block costs (router/placement.py)
            "long_prefill_tps": round(load.long_prefill_tps, 1),
            "decode_step_ms": round(load.decode_step_ms, 2),
            # a prompt step's time, fixed + per token (0 until fitted), and the tokens a step takes at most:
            # what SLO-aware admission predicts a prompt's TTFT from, when known (router/slo.py)
            "prefill_step_ms": round(load.prefill_step_ms, 3),
            "prefill_ms_per_token": round(load.prefill_ms_per_token, 5),
            "step_tokens": load.step_tokens,
            # a decode step's time, fixed + per sequence (0 until fitted): what one more sequence costs it
            "decode_step_fixed_ms": round(load.decode_step_fixed_ms, 3),
            "decode_ms_per_seq": round(load.decode_ms_per_seq, 4),
            # the offload tiers' measured read cost (the store's figures, behind its lock): prefix-aware
            # routing weighs a tier hit against recomputing it (router/placement.py)
            **({"kv_tier_read_ms": off.read_ms_per_block()} if (off := self.engine.kv_offload) else {}),
            # whether its admissions read disk hits now (common/kv/offload.py, "A disk dearer than
            # recomputing"): a router predicts no disk hit on a worker that says false
            **(
                {"kv_tier_disk_reads": off.disk_worth(probe=False)}
                if off is not None and off.store.disk is not None
                else {}
            ),
        }

    def transfer_counters(self) -> list[TransportCount]:
        """The KV transport's counters, per backend and rank, for /metrics."""
        return []

    def refusal(self) -> Response | None:
        """A retryable 503 for new work while draining or with a full queue; None to go ahead."""
        if self.draining:
            return error_response(503, f"{self.cfg.worker_name} is draining", headers={"Retry-After": "1"})
        if self.aengine.load.waiting >= self.cfg.max_queue:
            return error_response(503, f"{self.cfg.role} queue is full", headers={"Retry-After": "1"})
        return None

    async def drain(self) -> None:
        """SIGTERM: leave the registry at once (routers stop choosing this service) and refuse new work
        with a retryable 503; what runs goes on. The server waits for it up to drain_timeout_s, then
        ends the rest (a router migrates those), and the process exits 0."""
        if self.draining:
            return
        self.draining = True
        log.warning(
            "%s draining: %d request(s) in progress get %.0f s", self.cfg.worker_name, len(self.jobs),
            self.cfg.drain_timeout_s,
        )  # fmt: skip
        if self.heartbeat is not None:
            what = f"{self.cfg.worker_name} heartbeat (deregistering)"
            await stop_bounded(what, self.heartbeat.stop(deregister=True), self.heartbeat)

    def _engine_failed(self, why: str) -> None:
        """The engine cannot step any more (a step raised, a tensor-parallel rank exited): exit now, as
        if killed. Crash-only on purpose: a decode service's streams break and the routers migrate its
        requests, a prefill's calls fail into the transfer-failure policy, the peers' leases expire,
        and the supervisor (compose, Kubernetes, `splitserve up`) starts a fresh process."""
        if self.aengine.stopping:  # shutting down anyway (stop() closes the ranks after the thread)
            log.warning("%s: %s while stopping", self.cfg.worker_name, why)
            return
        log.critical("%s: %s; exiting so that its requests move elsewhere", self.cfg.worker_name, why)
        logging.shutdown()
        os._exit(ENGINE_FAILED_EXIT)

    async def start(self, kv_endpoint: str = "") -> None:
        adopt_loggers()  # a KV backend imported since __init__
        self.aengine.on_fatal = self._engine_failed
        if self.engine.tp_workers is not None:
            self.engine.tp_workers.on_lost = lambda rank: self._engine_failed(
                f"tensor-parallel rank {rank} exited"
            )
        self.aengine.start()
        capacity = {
            "model": self.served_model,
            # what its token ids mean: a router serving another tokenizer leaves this service out
            "tokenizer": self.engine.tokenizer.fingerprint,
            "total_blocks": self.aengine.load.total_blocks,
            "block_size": self.engine.config.block_size,
            "max_num_seqs": self.engine.config.max_num_seqs,
        }
        self.identity = WorkerIdentity(
            self.cfg.worker_name, self.cfg.role, self.cfg.url, kv_endpoint, self.incarnation, capacity
        )
        if not self.cfg.redis_url:
            return
        self.state = ClusterState.from_url(self.cfg.redis_url)
        self.state.registry.secret = self.secret  # the registry entry is signed with it
        self.records = RecordWriter(self.state.records)
        if self.engine.config.enable_prefix_caching:
            # Before registering: a router that sees this incarnation finds its (empty) snapshot.
            drain, snapshot = self.aengine.kv_events()
            self.kv_events = KVEventPublisher(
                self.state.redis,
                self.state.prefix,
                self.cfg.worker_name,
                self.incarnation,
                self.engine.config.block_size,
                drain,
                snapshot,
            )
            await self.kv_events.start()
        self.heartbeat = Heartbeat(
            self.state.registry,
            self.cfg.worker_name,
            self.cfg.role,
            self.cfg.url,
            kv_endpoint,
            capacity,
            self.load,
            self.cfg.heartbeat_s,
            self.incarnation,
        )
        await self.heartbeat.start()
        connector: Any = self.engine.connector  # the role's connector: holders, peer_lost, leases
        self.leases = LeaseKeeper(
            self.state.leases,
            self.cfg.role,
            self.cfg.worker_name,
            self.cfg.lease_s,
            connector.holders,
            connector.peer_lost,
        )
        connector.leases = self.leases
        await self.leases.start()

    async def retire(self) -> dict[str, int]:
        """Role switching (splitserve/roles.py): drain (deregister, 503 to new work), let what runs
        finish for up to drain_timeout_s, hand the rest back (an Interrupt with HANDED_BACK: a decode
        stream closes without an error frame and the router migrates it, a prefill call answers 503),
        give those HANDBACK_WAIT_S to let go of their blocks and leases, stop, and count what came
        back: the pool's free and total blocks, the transfers (leases) left, the requests handed back,
        those that did not end in time, the parts of the stop that did not stop in time, and whether
        the KV transport let go of the pool's memory (only then may it be freed). Every wait is
        bounded: a switch takes at most about drain_timeout_s + HANDBACK_WAIT_S + the stop's bounds.
        The drain timeout counts from the switch: leaving the registry runs beside it (a heartbeat
        whose Redis command hangs can take its 5 s bound to stop, and what runs would finish there
        instead of being handed back on time)."""
        leaving = asyncio.ensure_future(self.drain())
        await asyncio.sleep(0)  # drain() ran to its first await: draining, new work gets a 503
        await _wait_ended(list(self.jobs.values()), self.cfg.drain_timeout_s)
        ended = list(self.jobs.values())
        for job in ended:
            job.events.put_nowait(
                Interrupt(job.request_id, f"{self.cfg.worker_name} is switching roles", HANDED_BACK)
            )
        stuck = await _wait_ended(ended, HANDBACK_WAIT_S)
        await leaving  # bounded (stop_bounded)
        if stuck:
            log.error(
                "%s: %d request(s) did not let go within %.0f s of being handed back: %s",
                self.cfg.worker_name, len(stuck), HANDBACK_WAIT_S, [j.request_id for j in stuck],
            )  # fmt: skip
        await self.stop()
        load = self.aengine.load  # published after the engine thread's last command, before it stopped
        connector: Any = self.engine.connector
        return {
            "free_blocks": load.free_blocks,
            "total_blocks": load.total_blocks,
            "leases_left": len(getattr(connector, "requests", {})),
            "ended_requests": len(ended),
            "stuck_requests": len(stuck),
            "unstopped_parts": len(self.unstopped),
            # 1: no KV transport holds the pool's memory any more (the receiver or senders closed)
            "kv_released": int(self.kv_released),
        }

    async def stop(self) -> None:
        """Stop the heartbeat, leases, KV events, records, Redis and the engine thread (idempotent).
        Each part gets STOP_PART_S: one that does not stop in time is logged, cancelled again and
        named in `unstopped` (a Redis client can swallow the cancellation of a task caught
        mid-command, and that task's loop would go on forever: see `stop_bounded`)."""
        if self._stopped:
            return
        self._stopped = True
        for what, part in (
            ("KV events", self.kv_events), ("leases", self.leases), ("heartbeat", self.heartbeat),
        ):  # fmt: skip
            if part is not None:
                await self.stop_part(what, part.stop(), part)
        if self.records is not None:
            await self.stop_part("records", self.records.close())
        if self.state is not None:
            await self.stop_part("Redis", self.state.close())
        # joins the engine thread (up to 10 s): off the event loop, which keeps serving meanwhile
        await asyncio.to_thread(self.aengine.stop)
        self.engine.close()  # the tensor-parallel worker ranks, if any

    async def stop_part(self, what: str, stopping: Awaitable[Any], part: Any = None) -> bool:
        """`stop_bounded` for one part of this service's stop; a part that did not stop in time (or
        failed to) is named in `unstopped`."""
        if await stop_bounded(f"{self.cfg.worker_name} {what}", stopping, part):
            return True
        self.unstopped.append(what)
        return False

    # --- requests in progress ---------------------------------------------------------------------
    def open_job(self, job: Job) -> None:
        """Start working on a request: its events go to the job's queue from now on. RequestInUse (409)
        while another job has the id."""
        rid = job.request_id
        if rid in self.jobs:
            raise RequestInUse(f"request {rid!r} is already in progress on {self.cfg.worker_name}")
        self.jobs[rid] = job
        self.aengine.listen(rid, job.events)

    def close_job(self, job: Job) -> None:
        """The job's handler has let go of everything (engine request, blocks, transfer, lease)."""
        self.aengine.unlisten(job.request_id, job.events)
        if self.jobs.get(job.request_id) is job:
            del self.jobs[job.request_id]
        job.ended.set()

    def interrupt(self, request_id: str, error: str, code: int) -> None:
        """End a request from outside its handler: the handler reads the Interrupt and stops."""
        job = self.jobs.get(request_id)
        if job is not None:
            job.events.put_nowait(Interrupt(request_id, error, code))

    async def abort(self, request_id: str) -> None:
        """Stop the request and free what it holds; returns once it is gone (POST /internal/abort), so
        a retry may reuse the id right after."""
        job = self.jobs.get(request_id)
        if job is None:
            return
        self.interrupt(request_id, "aborted", 499)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ABORT_WAIT_S):
                await job.ended.wait()

    async def record(self, request_id: str, new_state: RequestState, **fields: Any) -> None:
        """A request-record update that never takes the request down: one that Redis cannot take now is
        retried until it lands; one another service superseded, or on a record the router never made
        (a direct call), is skipped."""
        if self.records is None:
            return
        try:
            await self.records.transition(request_id, new_state, **fields)
        except Exception:
            log.exception("could not record %s -> %s", request_id, new_state)

    async def record_fields(self, request_id: str, **fields: Any) -> None:
        """Fields of the request's record set without a transition; never takes the request down, like
        `record`."""
        if self.records is None:
            return
        try:
            await self.records.set_fields(request_id, **fields)
        except Exception:
            log.exception("could not record %s of %s", sorted(fields), request_id)

    def _serving(self, url: str) -> None:
        log.info("%s %s serving on %s", self.cfg.role, self.cfg.worker_name, url)

    # --- the app ----------------------------------------------------------------------------------
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
        app.state.on_serving = self._serving  # server_config logs "<role> <worker> serving on <url>"
        install_error_handlers(app)
        # an unauthenticated /internal/ call is refused before anything else looks at it
        app.add_middleware(
            InternalAuthMiddleware,
            secret=self.secret,
            max_body=MAX_FRAME_BYTES,
            on_refused=lambda reason: self.metrics.internal_auth_refused.labels(reason).inc(),
            audience=audience(self.cfg.worker_name, self.incarnation),  # calls signed for this process only
        )
        # outermost: request ids (x-request-id, the id of every line logged meanwhile) and one access
        # line per request, refused ones included (common/runtime/access.py)
        app.add_middleware(AccessLog)

        @app.post("/internal/abort")
        async def abort(request: Request) -> dict[str, Any]:
            msg = await read_message(request, AbortRequest)
            await self.abort(msg.request_id)
            return {"aborted": msg.request_id}

        @app.get("/health")
        async def health() -> JSONResponse:
            body = {
                "status": "draining" if self.draining else "ok",
                "role": self.cfg.role,
                "worker_id": self.cfg.worker_name,
                "incarnation": self.incarnation,
                "model": self.served_model,
                "engine": self.engine.placement.describe(),
                **self.load(),
            }
            if self.identity is not None:  # who answers here, signed: what a caller signs its calls for
                body["identity"] = self.identity.to_json(self.secret)
            return JSONResponse(body, status_code=503 if self.draining else 200)  # readiness fails

        @app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(
                generate_latest(self.metrics.registry).decode(), media_type="text/plain; version=0.0.4"
            )

        return app


async def stop_bounded(
    what: str, stopping: Awaitable[Any], part: Any = None, timeout_s: float = STOP_PART_S
) -> bool:
    """Await `stopping` (a part's stop) for at most timeout_s; False (logged) if it failed or did not
    end. Not asyncio.wait_for, which waits for the cancelled awaitable to end as well. A part whose
    loop task (`part._task`) is still running then is cancelled again until it ends (bounded too;
    common/runtime/tasks.py says how a Redis command can swallow a cancellation): a heartbeat or an
    event publisher must not go on running for a role this process no longer has."""
    task = asyncio.ensure_future(stopping)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if done:
        if task.cancelled() or task.exception() is None:
            return True
        log.error("%s: stopping failed: %r", what, task.exception())
        return False
    task.cancel()
    log.error("%s did not stop within %.0f s; left behind", what, timeout_s)
    loop_task = getattr(part, "_task", None)
    if isinstance(loop_task, asyncio.Task):
        await cancel_and_wait(loop_task, timeout_s=timeout_s)
    return False


async def _wait_ended(jobs: list[Job], timeout_s: float) -> list[Job]:
    """Wait until every job ended, for at most timeout_s; the jobs that did not."""
    waits = [asyncio.ensure_future(j.ended.wait()) for j in jobs if not j.ended.is_set()]
    if waits:
        _, pending = await asyncio.wait(waits, timeout=timeout_s)
        for w in pending:
            w.cancel()
    return [j for j in jobs if not j.ended.is_set()]


def engine_for(cfg: EngineConfig, connector: KVConnector, reuse: LLMEngine | None = None) -> LLMEngine:
    """The engine of a service with `connector`: loaded from cfg, or (a role switch) on the weights and
    tokenizer of `reuse`, an engine whose service stopped: a fresh KV pool, no reload of the weights."""
    if reuse is None or cfg.engine == "sim":  # the sim engine has no weights to keep
        return LLMEngine.from_config(cfg, connector)
    if cfg.tensor_parallel_size > 1:  # the worker ranks hold the shards: they would have to switch too
        raise ValueError("role switching with tensor_parallel_size > 1 is not supported")
    return LLMEngine(reuse.model, reuse.tokenizer, cfg, reuse.placement, connector)


async def read_message(request: Request, expect: type[M]) -> M:
    """The msgpack body as `expect`; ProtocolError (-> 400) if it is anything else or larger than a
    frame may be. Its request id becomes the response's x-request-id."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FRAME_BYTES:
            raise ProtocolError(f"body exceeds the {MAX_FRAME_BYTES}-byte limit")
    msg = decode(bytes(body), expect)
    rid = getattr(msg, "request_id", None)
    if isinstance(rid, str):
        request.state.request_id = rid
    return msg


def msgpack_response(msg: Message, status_code: int = 200) -> Response:
    return Response(encode(msg), status_code=status_code, media_type=MSGPACK)


def error_response(status_code: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "code": status_code}}, status_code=status_code, headers=headers
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(RequestInUse)
    async def in_use(request: Request, exc: RequestInUse) -> JSONResponse:
        return error_response(409, str(exc))

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))
