"""The two legs of a trip (router/trip.py): the generate stream it holds on a decode service and the
prefill call it has in flight, with the worker counts (`WorkerPool.hold`) and the spans
(`router.decode_reserve`, `router.prefill`) around them; what the services send back goes into the
request's `Output`. One `Legs` per request: at most one stream and one prefill call at a time, and
whatever is open is closed or aborted by `close()`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from common.protocol import (
    ErrorFrame,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    Reserved,
    TokenFrame,
    encode,
)
from common.runtime.telemetry import span_scope, traceparent, tracer
from router.config import RouterConfig
from router.errors import APIError, unavailable
from router.orchestrator import Orchestrator
from router.output import Output
from router.tasks import spawn
from router.upstream import (
    Busy,
    DecodeLost,
    DecodeStream,
    PrefillFailed,
    Unreachable,
    call_prefill,
    post_abort,
    unexpected,
)
from router.workers import Worker

ABORT_WAIT_S = 30.0  # a service's /internal/abort answers within this once the request is gone there
_tracer = tracer(__name__)


@dataclass
class FirstPlacement:
    """The services of the request's first placement, and their prefix-cache reuse (tokens) as they
    reported it."""

    decode_id: str | None = None
    decode_reused_tokens: int = 0
    prefill_id: str | None = None
    prefill_reused_tokens: int = 0


class Legs:
    def __init__(
        self, orch: Orchestrator, request_id: str, output: Output, deadline: float, tenant: str, priority: int
    ) -> None:
        self.client, self.pool, self.retry_after_s = orch.client, orch.pool, orch.config.retry_after_s
        self.id, self.output, self.deadline = request_id, output, deadline
        self.tenant, self.priority = tenant, priority
        self.cache_salt = cache_salt(orch.config, tenant)
        self.traceparent: str | None = None  # the request's span, for the decode service
        self.first = FirstPlacement()
        self._stream: DecodeStream | None = None
        self._prefill: Worker | None = None  # set while a prefill call is in flight
        self._decode_work = 0  # a local route's prompt tokens held on its decode service until token 1

    # ---- decode service --------------------------------------------------------------------------

    async def open_decode(self, decodes: list[Worker], mode: Literal["remote", "local"]) -> Reserved:
        """Open a generate stream on the least loaded D that accepts it; returns its Reserved frame."""
        out = self.output
        body = encode(
            GenerateRequest(
                self.id, out.tokens, out.next_sampling(), mode, self.deadline, self.traceparent, len(out.ids),
                tenant=self.tenant, priority=self.priority, cache_salt=self.cache_salt,
            )
        )  # fmt: skip
        with span_scope(_tracer, "router.decode_reserve") as span:
            try:
                self._stream, reserved = await DecodeStream.open(
                    self.client, decodes, body, self.deadline, unreachable=self.pool.suspect
                )
                if self.first.decode_id is None:
                    self.first.decode_id = self._stream.worker.id
                    self.first.decode_reused_tokens = reserved.num_cached_tokens
            except Busy:
                message = "every decode service is at capacity; retry later"
                raise unavailable(message, self.retry_after_s) from None
            except Unreachable as e:  # which ones and why: the log's (the error's detail), not the client's
                message = "no decode service could be reached; retry later"
                raise unavailable(message, self.retry_after_s, detail=f"unreachable: {e}") from None
            if span.is_recording():
                span.set_attributes({
                    "splitserve.mode": mode,
                    "splitserve.decode_id": self._stream.worker.id,
                    "splitserve.blocks": len(reserved.block_ids),
                    "splitserve.num_cached_tokens": reserved.num_cached_tokens,
                })  # fmt: skip
        if mode == "local":  # it computes the prompt itself: that work counts until its first token
            self._decode_work = max(0, len(out.tokens) - reserved.num_cached_tokens)
        self.pool.hold(self._stream.worker, self._decode_work)
        return reserved

    async def read_tokens(self, stall_s: float | None = None) -> list[int] | None:
        """Tokens from the next TokenFrame(s) that bring anything new; None when D has finished.
        DecodeLost if the stream breaks, or (with stall_s) brings nothing for that long."""
        assert self._stream is not None, "no decode stream open"
        out = self.output
        while True:
            frame = await self._stream.next_frame(stall_s)
            if not isinstance(frame, TokenFrame):
                raise unexpected(frame, "tokens", self._stream.worker)
            out.take_prompt_logprobs(frame.prompt_logprobs)
            new = out.accept(frame.index, frame.token_ids, frame.logprobs)
            if frame.finished:
                if frame.finish_reason not in ("stop", "length"):
                    why = f"{frame.finish_reason!r}"[:100]
                    detail = f"decode service {self._stream.worker.id} ended it: {why}"
                    raise APIError(502, "the decode service ended the request early", detail=detail)
                out.finish_reason = frame.finish_reason
            if self._decode_work and (new or frame.finished):
                self.pool.done_tokens(self._stream.worker, self._decode_work)
                self._decode_work = 0
            if new:
                return new
            if frame.finished:
                return None

    async def lose_decode(self, e: DecodeLost) -> Worker | None:
        """Leave the decode service that failed the request (stream and prefill call closed); it."""
        stream, prefill = self._stream, self._prefill
        old = stream.worker if stream is not None else e.worker  # lost before its Reserved frame: e's
        if old is not None:
            spawn(
                post_abort(self.client, old, self.id)
            )  # a frozen service may come back: it frees what it held
        if stream is not None:
            await self._close_decode()
        if prefill is not None:
            # The request is placed again next, maybe through this prefill service, which refuses an
            # id it is still working on (409, then tried as a failed prefill): give it 2 s to let go.
            await self._abort(prefill)
        return old

    async def _close_decode(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                await stream.aclose()
            finally:
                self.pool.release(stream.worker, self._decode_work)
                self._decode_work = 0

    # ---- prefill service -------------------------------------------------------------------------

    async def prefill(self, w: Worker, r: Reserved) -> PrefillResult:
        """Send the prompt to P, which writes its KV into r.block_ids on D; returns P's answer (the
        first token)."""
        # P records PREFILLING and TRANSFERRING itself, D records RESERVED and DECODING: the router
        # writes only QUEUED and the end, keeping Redis round trips off the path to the first token.
        self._prefill = w  # from here until it answers, a cancelled request must abort it on P
        out = self.output
        work = len(out.tokens)  # the prompt work P has for it (ranking: placement.py, queued_blocks)
        self.pool.hold(w, work)
        try:
            with span_scope(_tracer, "router.prefill", attributes={"splitserve.prefill_id": w.id}):
                req = PrefillRequest(
                    self.id, out.tokens, out.next_sampling(), r.kv_endpoint, r.block_ids, r.fence,
                    r.num_cached_tokens, self.deadline, traceparent(), len(out.ids),
                    tenant=self.tenant, priority=self.priority, cache_salt=self.cache_salt,
                    group_block_ids=r.group_block_ids,
                )  # fmt: skip
                first = await self._prefill_or_decode_error(call_prefill(self.client, w, req))
        finally:
            self.pool.release(w, work)
        self._prefill = None
        return first

    async def drop_reservation(self, prefill: Worker) -> None:
        """After a failed prefill: abort it, and drop the decode reservation it was writing into (a late
        write from the failed worker then meets a stale fence). Waits until the decode service has let
        go: the request (same id) is placed on a decode service again next, maybe this one, which
        refuses an id it is still tearing down (409)."""
        await self._abort(prefill)
        if self._stream is not None:
            await self._abort(self._stream.worker, until_gone=True)
        await self._close_decode()

    async def _prefill_or_decode_error(self, call: Coroutine[Any, Any, PrefillResult]) -> PrefillResult:
        """Await the prefill call, but give up on it if the decode stream ends the reservation first
        (its lease watch saw the prefill service die or hang): that is a prefill failure too, and
        goes through the transfer-failure policy instead of waiting for the deadline."""
        assert self._stream is not None
        prefill = asyncio.ensure_future(call)
        frame: asyncio.Future[Any] | None = None
        try:
            while True:
                frame = asyncio.ensure_future(self._stream.next_frame())
                done, _ = await asyncio.wait({prefill, frame}, return_when=asyncio.FIRST_COMPLETED)
                if prefill in done:
                    if frame.done() and not frame.cancelled() and frame.exception() is None:
                        self._stream.push_back(frame.result())  # both ended at once: keep the frame
                    return prefill.result()
                got = frame.result()
                if isinstance(got, ErrorFrame):
                    raise PrefillFailed(f"the decode service ended the reservation: {got.error}")
                self._stream.push_back(got)  # D already has the KV and streams tokens: P will answer
                return await prefill
        finally:  # however this ends (cancelled too), nothing is left running behind it
            for fut in (prefill, frame):
                if fut is not None and not fut.done():
                    fut.cancel()

    # ---- both ------------------------------------------------------------------------------------

    async def _abort(self, w: Worker, until_gone: bool = False) -> None:
        """Abort the request on `w`; with until_gone, wait as long as the service takes to let go of it
        (a loaded engine thread needs more than the default 2 s), up to the request's deadline."""
        if w is self._prefill:
            self._prefill = None
        timeout_s = max(2.0, min(ABORT_WAIT_S, self.deadline - time.time())) if until_gone else 2.0
        await post_abort(self.client, w, self.id, timeout_s)

    async def close(self) -> None:
        """Abort a prefill call in flight, close the decode stream: the services free what they hold."""
        if self._prefill is not None:
            await self._abort(self._prefill)
        await self._close_decode()


def cache_salt(config: RouterConfig, tenant: str) -> str:
    """The prefix-cache namespace of a tenant's requests (common/prefix_hash.py cache_root): its own,
    unless the operator shares one cache between tenants."""
    return f"tenant:{tenant}" if config.prefix_cache_scope == "tenant" else ""
