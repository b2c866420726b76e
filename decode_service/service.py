"""The decode service: reserves KV blocks, receives a prompt's KV from a prefill service (or prefills
locally in chunks), runs continuous batching and streams tokens back on the open response.

One generate stream is one Job. Its events are the engine's (Admission, TokenOutput) and the
service's own Interrupts (abort, a lost prefill peer, incomplete KV); the stream turns them into
frames. The reservation itself (blocks, fence, lease, state) is an IncomingKV of the KV connector,
which the KV receiver asks before writing and tells after every layer and kv_done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from common.cluster.records import RequestState
from common.config import EngineConfig, ServiceConfig
from common.connector.decode import DecodeConnector
from common.connector.remote_kv import IncomingKV
from common.engine.api import AddRequest, Admission, Finish, KVArrived, RemoteKV, TokenOutput
from common.engine.llm_engine import LLMEngine, fault
from common.protocol import ErrorFrame, GenerateRequest, KVDone, Reserved, TokenFrame, frame
from common.runtime.telemetry import context_from, span_scope, tracer
from common.service.base import HANDED_BACK, Interrupt, Job, Service, engine_for
from common.service.metrics import TransportCount
from decode_service.timeline import Timeline
from kv_transfer import ReceiverStats, make_receiver, resolve_backend
from kv_transfer.ranks import RankTransfer

log = logging.getLogger(__name__)
FRAMES = "application/x-splitserve-frames"
_tracer = tracer(__name__)


@dataclass(eq=False)
class Stream(Job):
    req: GenerateRequest | None = None
    rkv: IncomingKV | None = None  # remote mode, once reserved
    tl: Timeline = field(default_factory=Timeline)
    finish_reason: str | None = None  # the engine ended the request (stop, length)
    error: str | None = None
    closed: bool = False  # _end ran


class DecodeService(Service):
    def __init__(self, cfg: ServiceConfig, engine_cfg: EngineConfig, reuse: LLMEngine | None = None) -> None:
        self.connector = DecodeConnector(on_arrived=self._on_arrived, on_failed=self._on_failed)
        self.kv_backend, why = resolve_backend(cfg.kv_backend)
        log.warning("decode %s: KV transfer backend %s (%s)", cfg.worker_name, self.kv_backend, why)
        # tensor parallelism: rank r (a worker process) receives its own KV heads on kv_port + r
        options = {"host": cfg.host, "port": cfg.kv_port, "advertise_host": cfg.advertise_host}
        self.connector.rank_transfer = RankTransfer("decode", self.kv_backend, options)
        engine = engine_for(engine_cfg, self.connector, reuse)  # reuse: a role switch keeps the weights
        super().__init__(cfg, engine)
        self.rank = 0  # the tensor-parallel rank whose KV shard this process holds (the others: workers)
        self.receiver = make_receiver(
            self.kv_backend,
            engine.kv_cache,
            engine.kv_compat(),
            self.connector,
            incarnation=self.incarnation,
            rank=self.rank,
            host=cfg.host,
            port=cfg.kv_port,
            advertise_host=cfg.advertise_host,
        )
        self.metrics.init_transfer(self.kv_backend, self.rank)  # observed by the sender: 0 here
        self.kv_endpoint = ""
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, kv_endpoint: str = "") -> None:
        # one endpoint per tensor-parallel rank, in rank order (common/parallel/plan.split_endpoints)
        workers = self.engine.tp_workers
        ranks = workers.endpoints if workers is not None else []
        self.kv_endpoint = ",".join([await self.receiver.start(), *ranks])
        await super().start(self.kv_endpoint)

    async def stop(self) -> None:
        """The base's stop, then the KV receiver (bounded: its listener and connections close, its
        memory registration goes; if that did not finish, `kv_released` says so) and the connector's
        leftover tasks (a kv_done's lease release and record: moot now)."""
        if self._stopped:
            return
        await super().stop()
        self.kv_released = await self.stop_part("KV receiver", self.receiver.close())
        for task in list(self._tasks):
            task.cancel()

    def receiver_stats(self) -> dict[int, ReceiverStats]:
        """Every rank's receiver counters: this process's (rank 0), then the worker ranks' last report."""
        out = {self.receiver.rank: self.receiver.stats}
        workers = self.engine.tp_workers
        for rank, reported in (workers.rank_stats if workers is not None else {}).items():
            if reported.received is not None:
                out[rank] = ReceiverStats(**reported.received)
        return out

    def transfer_counters(self) -> list[TransportCount]:
        return [
            c
            for rank, s in self.receiver_stats().items()
            for c in _receiver_counters(self.kv_backend, rank, s)
        ]

    # --- the connector's news (event loop) ----------------------------------------------------------
    def _on_arrived(self, rkv: IncomingKV, done: KVDone) -> None:
        self._spawn(self._arrived(rkv, done))

    def _on_failed(self, rkv: IncomingKV, why: str) -> None:
        """The reservation cannot be filled: end the stream; its clean-up frees the blocks. The router,
        reading the ErrorFrame, applies its transfer-failure policy and records the outcome."""
        self.interrupt(rkv.request_id, why, 502)

    async def _arrived(self, rkv: IncomingKV, done: KVDone) -> None:
        rid = done.request_id
        # a child of the sender's kv.transfer span: the trace crosses the KV link here
        with span_scope(
            _tracer,
            "kv.receive",
            context=context_from(done.traceparent),
            attributes={"splitserve.request_id": rid, "splitserve.kv.tokens": done.num_tokens},
        ):
            await self.connector.release_lease(rkv)  # the transfer is over: the blocks are the request's
            # recorded before a token can reach the router, which records the end after the last
            await self.record(rid, RequestState.DECODING, decode_id=self.cfg.worker_name)
            job = self.jobs.get(rid)
            if isinstance(job, Stream) and job.rkv is rkv:
                job.tl.on_ready(self.metrics)
            with contextlib.suppress(KeyError):  # the request ended meanwhile
                await self.aengine.submit(KVArrived(rid, done.first_token))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- requests ---------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> Response:
        refused = self.refusal()
        if refused is not None:
            self.metrics.requests.labels(role="decode", outcome="refused").inc()
            return refused
        remote_kv: RemoteKV | None = "receive" if req.mode == "remote" else None
        rid = req.request_id
        job = Stream(rid, req=req)
        self.open_job(job)
        try:
            n_out = req.num_output_tokens
            add = AddRequest(
                rid, req.token_ids, req.sampling, req.priority, remote_kv, n_out, tenant=req.tenant,
                cache_salt=req.cache_salt,
            )  # fmt: skip
            await self.aengine.submit(add)
        except BaseException:
            self.close_job(job)
            raise
        # The background task is a safety net: a client gone before the body starts never runs the
        # generator's clean-up.
        body, net = self._stream(job), BackgroundTask(self._end, job)
        return StreamingResponse(body, media_type=FRAMES, background=net)

    async def _stream(self, job: Stream) -> AsyncIterator[bytes]:
        assert job.req is not None
        req, rid = job.req, job.request_id
        try:
            while job.finish_reason is None:
                timeout = None if req.deadline is None else max(0.0, req.deadline - time.time())
                try:
                    async with asyncio.timeout(timeout):  # not wait_for: common/runtime/tasks.py
                        ev = await job.events.get()
                except TimeoutError:
                    ev = Interrupt(rid, "deadline exceeded on the decode service", 504)
                if isinstance(ev, Interrupt):
                    job.error = ev.error
                    if ev.code == HANDED_BACK:  # no error frame: the router migrates the request
                        return
                    yield frame(ErrorFrame(rid, ev.error, ev.code))
                    return
                if isinstance(ev, Admission):
                    if job.tl.admitted:  # admitted again after a preemption (recompute): it already has
                        continue  # its Reserved frame, and its output goes on where it was
                    yield frame(await self._admitted(job, ev))
                elif isinstance(ev, TokenOutput):
                    job.finish_reason = ev.finish_reason
                    if (why := fault(ev.finish_reason)) is not None:  # the engine failed on it, and goes on
                        job.error = why
                        yield frame(ErrorFrame(rid, why, 500))
                        return
                    if ev.token_ids:
                        job.tl.on_frame(self.metrics, ev.index, len(ev.token_ids), ev.finish_reason)
                    else:
                        job.tl.finish_reason = ev.finish_reason  # token 0 itself ended it
                    yield frame(
                        TokenFrame(
                            rid, ev.token_ids, ev.index, ev.finish_reason,
                            logprobs=ev.logprobs, prompt_logprobs=ev.prompt_logprobs,
                        )
                    )  # fmt: skip
        finally:
            # the reader may have gone away (cancellation): clean-up must still run to the end
            with anyio.CancelScope(shield=True):
                await self._end(job)

    async def _admitted(self, job: Stream, ev: Admission) -> Reserved:
        assert job.req is not None
        rid = job.request_id
        job.tl.admitted = time.time_ns()
        self.metrics.queue_wait.observe((job.tl.admitted - job.tl.arrival) / 1e9)
        await self.record(rid, RequestState.RESERVED, decode_id=self.cfg.worker_name)
        if job.req.mode == "local":
            await self.record(rid, RequestState.DECODING)
            return Reserved(rid, [], 0, ev.num_cached_tokens, "", self.cfg.worker_name)
        job.rkv = rkv = await self.connector.reserve(ev)
        worker = self.cfg.worker_name
        return Reserved(
            rid, rkv.block_ids, rkv.fence, rkv.num_cached_tokens, self.kv_endpoint, worker,
            group_block_ids=rkv.group_block_ids,
        )  # fmt: skip

    async def _end(self, job: Stream) -> None:
        """The stream is over (finished, failed, or the reader went away): let go of everything it
        holds, in order: no write lands any more, the lease is gone, the engine frees the blocks."""
        if job.closed:
            return
        job.closed = True
        assert job.req is not None
        if job.rkv is not None:
            await self.connector.end(job.rkv, self.receiver.wait_idle)
        if job.finish_reason is None:
            await self.aengine.submit(Finish(job.request_id, "abort"))
        outcome = "aborted" if not job.finish_reason else "failed" if job.error else "finished"
        self.metrics.requests.labels(role="decode", outcome=outcome).inc()
        self.close_job(job)
        job.tl.close(self.metrics, job.req, self.cfg.worker_name, job.error)


def _receiver_counters(backend: str, rank: int, s: ReceiverStats) -> list[TransportCount]:
    return [
        TransportCount(name, doc, backend, rank, value)
        for name, doc, value in (
            ("splitserve_kv_transfer_bytes", "KV bytes received and written", s.bytes_received),
            ("splitserve_kv_transfer_layers", "layer writes received", s.layers_received),
            ("splitserve_kv_transfer_dones", "kv_done notifications received", s.dones_received),
            ("splitserve_kv_transfer_stale_drops", "layers dropped: stale fence", s.stale_drops),
            (
                "splitserve_kv_transfer_preflight_refusals",
                "senders refused: incompatible",
                s.preflight_refusals,
            ),
            ("splitserve_kv_transfer_bad_messages", "malformed transfer messages", s.bad_messages),
            (
                "splitserve_kv_transfer_auth_failures",
                "KV connections refused: the peer did not prove the internal secret",
                s.auth_failures,
            ),
        )
    ]
