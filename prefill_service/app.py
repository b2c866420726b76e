"""Prefill service: batches prompts from many requests under a token budget (chunked), reuses cached
prefixes, samples each prompt's first token, and writes the prompt's KV into the decode service's
reserved blocks layer by layer, as soon as each layer is computed.

POST /internal/prefill (msgpack PrefillRequest) -> msgpack PrefillResult, answered once every layer
was sent and kv_done (with the first token and the fence) was delivered to the decode service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.config import EngineConfig, ServiceConfig
from common.engine.async_engine import AsyncEngine
from common.engine.llm_engine import LLMEngine, RequestOutput
from common.engine.sequence import Sequence
from common.protocol import ErrorFrame, KVDone, PrefillRequest, PrefillResult
from common.service import (
    Service,
    error_response,
    msgpack_response,
    read_message,
    sampling_from_wire,
)
from common.state import RequestState
from common.telemetry import context_from, span_ctx, traceparent, tracer
from kv_transfer import KVSender, TransferError, make_sender
from kv_transfer.compat import compat_for

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


class PeerLost(Exception):
    """The decode service this request writes to stopped renewing its lease."""


@dataclass
class TransferJob:
    """Where one request's KV goes, the layer writes posted so far, and when things happened (for the
    request's spans and metrics, which are written once the request ends: nothing per token)."""

    req: PrefillRequest
    ctx: Any = None  # the request's span context: parent of kv.transfer
    first_chunk: bool = True
    writes: list[Future[Any]] = field(default_factory=list)
    nbytes: int = 0
    arrival_ns: int = field(default_factory=time.time_ns)
    # (start, end, tokens) per prefill chunk, wall ns. The start is taken when layer 0 of the step is
    # done (the engine's first hook), so it is late by one layer's compute.
    chunks: list[list[int]] = field(default_factory=list)
    active: list[tuple[float, float]] = field(default_factory=list)  # perf_counter spans of each write
    dst_blocks: set[int] = field(default_factory=set)
    layers: set[int] = field(default_factory=set)
    xfer_span: trace.Span = trace.INVALID_SPAN
    xfer_traceparent: str | None = None

    def active_s(self) -> float:
        """Time at least one layer write was in flight: the union of the writes' intervals. Bandwidth
        is bytes over this, not over the wall time, which includes waiting for layers to compute."""
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.active):
            if b > end:
                total += b - max(a, end)
                end = b
        return total


class PrefillService(Service):
    def __init__(self, cfg: ServiceConfig, engine: LLMEngine) -> None:
        super().__init__(cfg, engine)
        self.jobs: dict[str, TransferJob] = {}
        self._compat = compat_for(engine.model.config, engine.kv_cache.spec)
        self.senders: dict[str, KVSender] = {}  # by backend: a decode service's endpoint names its own
        self._loop: asyncio.AbstractEventLoop | None = None
        kv = engine.kv_cache.spec
        self._block_bytes = (
            2 * kv.block_size * kv.num_kv_heads * kv.head_dim * engine.kv_cache.k.element_size()
        )

    async def start(self, kv_endpoint: str = "") -> None:
        self._loop = asyncio.get_running_loop()
        self.aengine = AsyncEngine(self.engine, on_layer_done=self._on_layer_done)
        self.aengine.start()
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        for sender in self.senders.values():
            await sender.close()

    def transfer_counters(self) -> list[tuple[str, str, int]]:
        stats = [s.stats for s in self.senders.values()]
        return [
            ("splitserve_kv_transfer_bytes", "KV bytes sent", sum(s.bytes_sent for s in stats)),
            ("splitserve_kv_transfer_layers", "layer writes sent", sum(s.layers_sent for s in stats)),
            ("splitserve_kv_transfer_dones", "kv_done notifications sent", sum(s.dones_sent for s in stats)),
        ]

    def sender_for(self, endpoint: str) -> KVSender:
        """The sender for the backend a decode service's endpoint names ("nixl://..." or "tcp://...")."""
        backend = endpoint.split("://", 1)[0]
        if backend not in self.senders:
            self.senders[backend] = make_sender(
                backend, self.engine.kv_cache, self._compat, sender_id=self.cfg.worker_name
            )
        return self.senders[backend]

    def _on_layer_done(self, engine: LLMEngine, layer: int) -> None:
        """Engine thread, inside the forward pass: layer `layer` of this step's tokens is in the
        cache. Post its write for every request with a transfer job; the next layer computes while
        the bytes move. A chunk resends the block it started in (partly filled by the last chunk)."""
        step = engine.last_step
        assert step is not None and self._loop is not None
        bs = engine.block_manager.block_size
        last_layer = layer == engine.model.config.num_layers - 1
        for seq, n in step.scheduled:
            job = self.jobs.get(seq.seq_id)
            if job is None:
                continue
            if layer == 0:
                job.chunks.append([time.time_ns(), 0, n])
            if last_layer and job.chunks:
                job.chunks[-1][1] = time.time_ns()
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            first = 0 if job.first_chunk else start // bs  # the first chunk also ships cached prefix blocks
            first = max(first, job.req.num_cached_tokens // bs)  # the decode side already holds these
            last = -(-end // bs)
            if first < last:
                r = job.req
                if not job.writes:  # the transfer starts with its first write
                    job.xfer_span = _tracer.start_span("kv.transfer", context=job.ctx)
                    job.xfer_traceparent = traceparent(span_ctx(job.xfer_span)) or r.traceparent
                coro = self.sender_for(job.req.kv_endpoint).send_layer(
                    r.kv_endpoint,
                    r.request_id,
                    r.fence,
                    layer,
                    seq.block_table[first:last],
                    r.block_ids[first:last],
                    traceparent=job.xfer_traceparent,
                )
                job.writes.append(asyncio.run_coroutine_threadsafe(_timed(coro, job.active), self._loop))
                job.nbytes += (last - first) * self._block_bytes
                job.dst_blocks.update(r.block_ids[first:last])
                job.layers.add(layer)
            if last_layer:
                job.first_chunk = False

    async def prefill(self, req: PrefillRequest) -> Response:
        bs = self.engine.block_manager.block_size
        try:
            self.sender_for(req.kv_endpoint)
        except ValueError as e:
            return error_response(400, f"kv_endpoint {req.kv_endpoint!r}: {e}")
        if len(req.block_ids) != -(-len(req.token_ids) // bs):
            return error_response(
                400,
                f"{len(req.token_ids)} prompt tokens need {-(-len(req.token_ids) // bs)} "
                f"blocks of {bs}, got {len(req.block_ids)} destination blocks",
            )
        params = sampling_from_wire(req.sampling, max_tokens=1, min_tokens=0)
        if self.queue_full():
            return error_response(503, "prefill queue is full", headers={"Retry-After": "1"})
        assert self.aengine is not None
        rid, t0 = req.request_id, time.perf_counter()
        span = _tracer.start_span(
            "prefill",
            context=context_from(req.traceparent),
            kind=SpanKind.SERVER,
            attributes={"splitserve.request_id": rid, "gen_ai.usage.input_tokens": len(req.token_ids)},
        )
        job = self.jobs[rid] = TransferJob(req, span_ctx(span))
        events = self.aengine.listen(rid)
        seq: Sequence | None = None
        if self.leases is not None:
            await self.leases.acquire(rid, [])  # our hold on the blocks we compute into
        try:
            seq = await self.aengine.call(
                lambda e: e.add_request(req.token_ids, params, rid, hold_blocks=True)
            )
            await self.record(rid, RequestState.PREFILLING, prefill_id=self.cfg.worker_name)
            out = await self._first_token(events, req.deadline)
            self.metrics.ttft.observe(time.perf_counter() - t0)
            self._compute_spans(job, seq)
            await self.record(rid, RequestState.TRANSFERRING)
            for w in job.writes:  # every layer write posted for this request has gone out
                await asyncio.wrap_future(w)
            await self.sender_for(req.kv_endpoint).send_done(
                req.kv_endpoint,
                KVDone(
                    rid, req.fence, out.new_token_ids[0], len(req.token_ids),
                    job.xfer_traceparent or req.traceparent,
                ),
            )  # fmt: skip
            self._transfer_done(job)
            self.metrics.requests.labels(role="prefill", outcome="finished").inc()
            return msgpack_response(
                PrefillResult(
                    rid,
                    out.new_token_ids[0],
                    len(req.token_ids),
                    seq.num_cached_tokens,
                    (time.perf_counter() - t0) * 1e3,
                    job.nbytes,
                )
            )
        except TransferError as e:
            self.metrics.requests.labels(role="prefill", outcome="transfer_failed").inc()
            self.metrics.transfer_failures.labels(reason=type(e).__name__).inc()
            _fail(job.xfer_span, e)
            _fail(span, e)
            return error_response(502, f"KV transfer to {req.kv_endpoint} failed: {e}")
        except TimeoutError as e:
            _fail(span, e)
            return error_response(504, "deadline exceeded on the prefill service")
        except PeerLost as e:
            self.metrics.requests.labels(role="prefill", outcome="decode_lease_expired").inc()
            self.metrics.transfer_failures.labels(reason="decode_lease_expired").inc()
            _fail(job.xfer_span, e)
            _fail(span, e)
            return error_response(502, str(e))
        finally:
            with anyio.CancelScope(shield=True):
                await self._end(rid, job, seq)
            job.xfer_span.end()  # a no-op if it ended already
            if seq is not None and span.is_recording():
                span.set_attribute("splitserve.num_cached_tokens", seq.num_cached_tokens)
            span.end()
            self.metrics.e2e.observe(time.perf_counter() - t0)

    def _compute_spans(self, job: TransferJob, seq: Sequence | None) -> None:
        """The queue wait and per-chunk compute of a prefilled request, as spans dated after the fact
        (the chunks ran on the engine thread), and their histograms."""
        chunks = [c for c in job.chunks if c[1]]
        if not chunks:
            return
        first, last = chunks[0][0], chunks[-1][1]
        self.metrics.queue_wait.observe(max(0, first - job.arrival_ns) / 1e9)
        self.metrics.prefill_compute.observe((last - first) / 1e9)
        if not trace.get_current_span(job.ctx).is_recording():
            return
        _tracer.start_span("prefill.queue", context=job.ctx, start_time=job.arrival_ns).end(end_time=first)
        compute = _tracer.start_span(
            "prefill.compute",
            context=job.ctx,
            start_time=first,
            attributes={"splitserve.chunks": len(chunks), "splitserve.tokens": sum(c[2] for c in chunks)},
        )
        if seq is not None:
            compute.set_attribute("splitserve.num_cached_tokens", seq.num_cached_tokens)
        for i, (a, b, n) in enumerate(chunks):
            chunk = _tracer.start_span(
                "prefill.chunk",
                context=span_ctx(compute),
                start_time=a,
                attributes={"splitserve.chunk": i, "splitserve.tokens": n},
            )
            chunk.end(end_time=b)
        compute.end(end_time=last)

    def _transfer_done(self, job: TransferJob) -> None:
        if not job.writes:
            return
        # first write out to kv_done delivered: the transfer's wall time (compute gaps included)
        duration = time.perf_counter() - min((a for a, _ in job.active), default=time.perf_counter())
        active = job.active_s()
        self.metrics.transfer.observe(duration)
        self.metrics.transfer_active.observe(active)
        span = job.xfer_span
        if span.is_recording():
            span.set_attributes({
                "splitserve.kv.backend": job.req.kv_endpoint.split("://", 1)[0],
                "splitserve.kv.bytes": job.nbytes,
                "splitserve.kv.blocks": len(job.dst_blocks),
                "splitserve.kv.layers": len(job.layers),
                "splitserve.kv.writes": len(job.writes),
                "splitserve.kv.duration_s": duration,
                "splitserve.kv.active_s": active,
                "splitserve.kv.bandwidth_bytes_per_s": job.nbytes / active if active > 0 else 0.0,
                "splitserve.kv.endpoint": job.req.kv_endpoint,
            })  # fmt: skip
        span.end()

    async def _first_token(self, events: asyncio.Queue, deadline: float | None) -> RequestOutput:
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.time())
            ev = await asyncio.wait_for(events.get(), timeout)
            if isinstance(ev, ErrorFrame):
                raise PeerLost(ev.error)
            if isinstance(ev, RequestOutput) and ev.finished:
                return ev

    async def _end(self, rid: str, job: TransferJob, seq: Sequence | None) -> None:
        """Wait until no write still reads the blocks, then free them (the P-side hold ends)."""
        assert self.aengine is not None
        self.aengine.unlisten(rid)
        for w in job.writes:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(w)
        self.jobs.pop(rid, None)
        if self.leases is not None:
            await self.leases.release(rid)
        if seq is not None:
            await self.aengine.call(lambda e: e.forget(seq))

    def peer_lost(self, request_id: str) -> None:
        """The decode side stopped renewing its reservation's lease: stop this request, free its blocks."""
        if self.aengine is not None and request_id in self.jobs:
            self.aengine.emit(request_id, ErrorFrame(request_id, "decode service lease expired", 502))

    async def abort(self, request_id: str) -> None:
        assert self.aengine is not None
        with contextlib.suppress(KeyError):
            await self.aengine.call(lambda e: e.abort(request_id))


def create_app(cfg: ServiceConfig, engine_cfg: EngineConfig, engine: LLMEngine | None = None) -> FastAPI:
    svc = PrefillService(cfg, engine or Service.build_engine(engine_cfg))
    app = svc.make_app()

    @app.post("/internal/prefill")
    async def prefill(request: Request) -> Response:
        return await svc.prefill(await read_message(request, PrefillRequest))

    return app


async def _timed(coro: Coroutine[Any, Any, None], active: list[tuple[float, float]]) -> None:
    """Run one layer write, noting when it was in flight (for the active transfer time)."""
    t0 = time.perf_counter()
    try:
        await coro
    finally:
        active.append((t0, time.perf_counter()))


def _fail(span: trace.Span, e: BaseException) -> None:
    if span.is_recording():
        span.record_exception(e)
        span.set_status(Status(StatusCode.ERROR, str(e)))
