"""Decode service: reserves KV blocks, receives a prompt's KV from a prefill service (or prefills
locally in chunks), runs continuous batching and streams tokens back on the open response.

POST /internal/generate (msgpack GenerateRequest) answers with length-prefixed msgpack frames:
  Reserved   once the request holds its blocks (remote mode: where the prefill service must write)
  TokenFrame per generated token, the last with finished=True
  ErrorFrame if the request fails
Closing the response aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.config import EngineConfig, ServiceConfig
from common.engine.async_engine import Admitted, AsyncEngine
from common.engine.llm_engine import LLMEngine, RequestOutput
from common.engine.sequence import Sequence
from common.protocol import ErrorFrame, GenerateRequest, KVDone, Reserved, TokenFrame, frame
from common.service import (
    Service,
    error_response,
    read_message,
    sampling_from_wire,
)
from common.state import RequestState
from common.telemetry import context_from, span_ctx, span_scope, tracer
from kv_transfer import make_receiver, resolve_backend
from kv_transfer.compat import compat_for

log = logging.getLogger(__name__)
FRAMES = "application/x-splitserve-frames"
_tracer = tracer(__name__)


@dataclass
class Timeline:
    """When one generate stream's milestones happened (wall ns), for its spans and histograms. The
    spans are written once the stream ends: nothing per token beyond a clock read and one histogram."""

    arrival: int = field(default_factory=time.time_ns)
    admitted: int = 0  # blocks granted (reserved, or admitted to local prefill)
    ready: int = 0  # the prompt's KV is in place: kv_done applied (remote) or admission (local)
    first_step: int = 0  # this service's first step for the request produced its token
    last_frame: int = 0
    frames: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None


class DecodeService(Service):
    def __init__(self, cfg: ServiceConfig, engine: LLMEngine) -> None:
        super().__init__(cfg, engine)
        self.fences: dict[str, int] = {}  # request id -> the fence its KV writes must carry
        self._fence_counter = itertools.count(1)
        self.kv_backend, why = resolve_backend(cfg.kv_backend)
        log.warning("decode %s: KV transfer backend %s (%s)", cfg.worker_name, self.kv_backend, why)
        self.receiver = make_receiver(
            self.kv_backend,
            engine.kv_cache,
            compat_for(engine.model.config, engine.kv_cache.spec),
            self._accept,
            self._on_done,
            host=cfg.host,
            port=cfg.kv_port,
            advertise_host=cfg.advertise_host,
        )
        self.kv_endpoint = ""

    async def start(self, kv_endpoint: str = "") -> None:
        self.aengine = AsyncEngine(self.engine)
        self.aengine.start()
        self.kv_endpoint = await self.receiver.start()
        await super().start(self.kv_endpoint)

    async def stop(self) -> None:
        await super().stop()
        await self.receiver.close()

    def transfer_counters(self) -> list[tuple[str, str, int]]:
        s = self.receiver.stats
        return [
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
        ]

    # --- KV receiver callbacks (event loop thread) ------------------------------------------------
    def _accept(self, request_id: str, fence: int) -> bool:
        return self.fences.get(request_id) == fence

    def _on_done(self, done: KVDone) -> None:
        if self.fences.get(done.request_id) != done.fence:
            log.warning("dropping kv_done for %s with stale fence %d", done.request_id, done.fence)
            return
        del self.fences[done.request_id]  # any later write with this fence is stale
        asyncio.get_running_loop().create_task(self._kv_arrived(done))

    async def _kv_arrived(self, done: KVDone) -> None:
        aengine = self.aengine
        assert aengine is not None

        def arrived(e: LLMEngine) -> None:
            # emitted from the engine thread, so token 0 reaches the stream before any later token
            aengine.emit(done.request_id, e.kv_arrived(done.request_id, done.first_token))

        # a child of the sender's kv.transfer span: the trace crosses the KV link here
        with span_scope(
            _tracer,
            "kv.receive",
            context=context_from(done.traceparent),
            attributes={"splitserve.request_id": done.request_id, "splitserve.kv.tokens": done.num_tokens},
        ):
            if self.leases is not None:
                await self.leases.release(done.request_id)  # the transfer is over: the reservation is ours
            # recorded before the first token can reach the router, which records the end after the last
            await self.record(done.request_id, RequestState.DECODING, decode_id=self.cfg.worker_name)
            with contextlib.suppress(KeyError):  # aborted meanwhile
                await aengine.call(arrived)

    # --- requests ---------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> Response:
        if req.mode not in ("remote", "local"):
            return error_response(400, f"mode must be 'remote' or 'local', got {req.mode!r}")
        params = sampling_from_wire(req.sampling)
        timeline = Timeline()
        if self.queue_full():
            self.metrics.requests.labels(role="decode", outcome="rejected_queue_full").inc()
            return error_response(503, "decode queue is full", headers={"Retry-After": "1"})
        assert self.aengine is not None
        events = self.aengine.listen(req.request_id)
        remote = req.mode == "remote"
        try:
            seq = await self.aengine.call(
                lambda e: e.add_request(req.token_ids, params, req.request_id, remote_prefill=remote)
            )
        except ValueError:
            self.aengine.unlisten(req.request_id, events)
            raise
        return StreamingResponse(self._stream(req, seq, events, remote, timeline), media_type=FRAMES)

    async def _stream(
        self, req: GenerateRequest, seq: Sequence, events: asyncio.Queue, remote: bool, tl: Timeline
    ) -> AsyncIterator[bytes]:
        rid, finished, fence = req.request_id, False, 0
        error: str | None = None
        try:
            while not finished:
                timeout = None if req.deadline is None else max(0.0, req.deadline - time.time())
                try:
                    ev = await asyncio.wait_for(events.get(), timeout)
                except TimeoutError:
                    error = "deadline exceeded on the decode service"
                    yield frame(ErrorFrame(rid, error, 504))
                    return
                if isinstance(ev, ErrorFrame):
                    error = ev.error
                    yield frame(ev)
                    return
                if isinstance(ev, Admitted):
                    tl.admitted = time.time_ns()
                    if not remote:
                        tl.ready = tl.admitted
                    self.metrics.queue_wait.observe((tl.admitted - tl.arrival) / 1e9)
                    reserved = await self._admitted(req, ev, remote)
                    fence = reserved.fence
                    yield frame(reserved)
                elif isinstance(ev, RequestOutput):
                    finished = ev.finished
                    self._observe_frame(tl, ev, remote)
                    yield frame(
                        TokenFrame(
                            rid,
                            ev.new_token_ids,
                            ev.num_output_tokens - len(ev.new_token_ids),
                            ev.finished,
                            ev.finish_reason,
                            ev.num_prompt_tokens,
                        )
                    )
        finally:
            # the reader may have gone away (cancellation): clean-up must still run to the end
            with anyio.CancelScope(shield=True):
                await self._end(seq, events, fence, finished)
            self._trace(req, tl, remote, finished, error)

    def _observe_frame(self, tl: Timeline, ev: RequestOutput, remote: bool) -> None:
        now = time.time_ns()
        if tl.frames == 0:
            self.metrics.ttft.observe((now - tl.arrival) / 1e9)
            if remote:  # the first output is the prefill's token, echoed once kv_done was applied
                tl.ready = now
            else:
                tl.first_step = now
        else:
            self.metrics.itl.observe((now - tl.last_frame) / 1e9)
            if not tl.first_step:
                tl.first_step = now
        tl.frames += 1
        tl.last_frame = now
        tl.output_tokens = ev.num_output_tokens
        if ev.finished:
            tl.finish_reason = ev.finish_reason

    def _trace(
        self, req: GenerateRequest, tl: Timeline, remote: bool, finished: bool, error: str | None
    ) -> None:
        """Histograms of the whole stream, and its spans (dated after the fact), once it ended."""
        end = time.time_ns()
        self.metrics.e2e.observe((end - tl.arrival) / 1e9)
        if finished and tl.output_tokens > 1 and tl.frames > 1:
            start = tl.ready if remote else tl.first_step
            self.metrics.tpot.observe((tl.last_frame - start) / 1e9 / (tl.output_tokens - 1))
        parent = context_from(req.traceparent)
        if parent is None or not trace.get_current_span(parent).get_span_context().is_valid:
            return
        span = _tracer.start_span(
            "decode",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=tl.arrival,
            attributes={
                "splitserve.request_id": req.request_id,
                "splitserve.mode": req.mode,
                "splitserve.worker_id": self.cfg.worker_name,
                "gen_ai.usage.input_tokens": len(req.token_ids),
                "gen_ai.usage.output_tokens": tl.output_tokens,
                "gen_ai.response.finish_reasons": [tl.finish_reason or ("error" if error else "aborted")],
            },
        )
        if not span.is_recording():
            return
        ctx = span_ctx(span)
        if tl.admitted:
            _tracer.start_span("decode.queue", context=ctx, start_time=tl.arrival).end(end_time=tl.admitted)
        if remote and tl.admitted:
            wait = _tracer.start_span("decode.kv_wait", context=ctx, start_time=tl.admitted)
            wait.end(end_time=tl.ready or end)
        if tl.ready:
            gen = _tracer.start_span(
                "decode.generate",
                context=ctx,
                start_time=tl.ready,
                attributes={"gen_ai.usage.output_tokens": tl.output_tokens, "splitserve.frames": tl.frames},
            )
            if tl.first_step:
                step = _tracer.start_span(
                    "decode.first_step",
                    context=span_ctx(gen),
                    start_time=tl.ready,
                    attributes={"splitserve.local_prefill": not remote},
                )
                step.end(end_time=tl.first_step)
            gen.end(end_time=tl.last_frame or end)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end)

    async def _admitted(self, req: GenerateRequest, ev: Admitted, remote: bool) -> Reserved:
        rid = req.request_id
        await self.record(rid, RequestState.RESERVED, decode_id=self.cfg.worker_name)
        if not remote:
            await self.record(rid, RequestState.DECODING)
            return Reserved(rid, [], 0, ev.num_cached_tokens, "", self.cfg.worker_name)
        fence = next(self._fence_counter)
        self.fences[rid] = fence
        if self.leases is not None:
            await self.leases.acquire(rid, ev.block_ids, token=fence)
        return Reserved(
            rid, ev.block_ids, fence, ev.num_cached_tokens, self.kv_endpoint, self.cfg.worker_name
        )

    async def _end(self, seq: Sequence, events: asyncio.Queue, fence: int, finished: bool) -> None:
        """The stream is over (finished, failed, or the reader went away): free what it holds.
        Everything is checked against this stream's own objects: a retry may reuse the request id."""
        assert self.aengine is not None
        rid = seq.seq_id
        self.aengine.unlisten(rid, events)
        if fence and self.fences.get(rid) == fence:
            del self.fences[rid]
        if fence and self.leases is not None:
            await self.leases.release(rid, token=fence)  # also after peer_lost made the fence stale
        if fence:
            # a layer accepted just before may still be landing in the blocks: let it finish first
            with contextlib.suppress(Exception):
                await self.receiver.wait_idle(rid)
        outcome = "finished" if finished else "aborted"
        self.metrics.requests.labels(role="decode", outcome=outcome).inc()
        await self.aengine.call(lambda e: e.forget(seq))

    def peer_lost(self, request_id: str) -> None:
        """The prefill side of a reservation stopped renewing its lease (died or hung): make the fence
        stale and end the stream; its clean-up frees the blocks. The router, reading the ErrorFrame,
        applies its transfer-failure policy and records the outcome (it owns the terminal states)."""
        if request_id not in self.fences or self.aengine is None:
            return
        del self.fences[request_id]
        reason = "prefill service lease expired before the KV arrived"
        self.aengine.emit(request_id, ErrorFrame(request_id, reason, 502))

    async def abort(self, request_id: str) -> None:
        """Abort and forget the id at once (a retry may reuse it before this stream notices)."""
        assert self.aengine is not None
        self.fences.pop(request_id, None)
        with contextlib.suppress(Exception):
            await self.receiver.wait_idle(request_id)

        def abort(e: LLMEngine) -> None:
            seq = e.get(request_id)
            if seq is not None:
                e.forget(seq)

        await self.aengine.call(abort)


def create_app(cfg: ServiceConfig, engine_cfg: EngineConfig, engine: LLMEngine | None = None) -> FastAPI:
    svc = DecodeService(cfg, engine or Service.build_engine(engine_cfg))
    app = svc.make_app()

    @app.post("/internal/generate")
    async def generate(request: Request) -> Response:
        return await svc.generate(await read_message(request, GenerateRequest))

    @app.get("/internal/kv")
    async def kv_info() -> dict[str, Any]:
        return {"kv_endpoint": svc.kv_endpoint, "backend": svc.kv_backend, "stats": vars(svc.receiver.stats)}

    return app
