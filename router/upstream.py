"""The wire to the prefill and decode services: the generate stream, the prefill call, abort.

Every wait is bounded by the request's deadline (unix time, the same value sent to the services);
upstream failures become APIErrors the client can be shown (502, 503, 504). Their messages are generic:
the worker, its answer (an upstream error body is never reflected) and the exception are the error's
`detail`, for the log and the trace only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx

from common.protocol import (
    AbortRequest,
    DecodeFrame,
    ErrorFrame,
    FrameReader,
    PrefillRequest,
    PrefillResult,
    ProtocolError,
    Reserved,
    decode,
    encode,
)
from common.runtime.telemetry import inject_headers
from router.errors import APIError
from router.workers import Worker

log = logging.getLogger(__name__)
MSGPACK = {"content-type": "application/msgpack"}
T = TypeVar("T")
DETAIL_CHARS = 500  # of an upstream's answer kept in an error's detail (the log line)
DECODE_FAILED = "the decode service serving this request failed"
DECODE_STALLED = "the decode service serving this request stopped answering"


class SettledTransport(httpx.AsyncBaseTransport):
    """A transport whose connection failures are all httpx.TransportErrors. anyio (4.x, under uvloop)
    raises AttributeError (`getpeername` on None) when a connection is closed as it is being made, as
    it is when the service at the other end is being killed: every caller here treats a
    TransportError as "that service is unreachable" (try another, or give up on a best-effort call),
    and an AttributeError would instead end the client's request with a 500. Nothing of ours runs
    inside a transport's request (the signing auth runs in the client), so an AttributeError from
    there is the library's. Every response it hands out unhooks itself from httpx's client once closed
    (`_Unbinding`: no reference cycle per call)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await self.inner.handle_async_request(request)
        except AttributeError as e:
            raise httpx.ConnectError(f"connection closed as it was made: {e!r}", request=request) from e
        response.stream = _Unbinding(response)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Unbinding(httpx.AsyncByteStream):
    """A response's stream that, once closed, unhooks the response from the stream httpx's client
    wrapped around it. The client sets `response.stream` to a stream holding the response (for its
    `elapsed`): a reference cycle per call, with the request, its headers and URL, and httpcore's stream
    and pool request (~35 objects) in it, which only the garbage collector could free
    (common/runtime/gc_pauses.py). Closed, the response keeps an empty stream (its body, when read, is
    in `content`), and the rest goes by reference counting. The response is held weakly: no new cycle."""

    def __init__(self, response: httpx.Response) -> None:
        self._inner = response.stream
        self._response = weakref.ref(response)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        assert isinstance(self._inner, httpx.AsyncByteStream)
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        try:
            assert isinstance(self._inner, httpx.AsyncByteStream)
            await self._inner.aclose()
        finally:
            response = self._response()
            if response is not None:
                response.stream = httpx.ByteStream(b"")


class PerServiceTransport(httpx.AsyncBaseTransport):
    """One connection pool per service (scheme, host, port) instead of one for all of them.

    httpcore's pool does its bookkeeping over every connection it holds on every request and every
    response closed (`_assign_requests_to_connections`: for each connection `has_expired`, which polls
    the socket, and an `is_idle` count per idle connection, so quadratic in the pool's size), and a
    router holds a connection per decode stream in flight across the whole fleet: that bookkeeping was
    ~12 % of the router's CPU in `bench fleet` (16 services, 40 req/s). A pool per service holds only
    that service's connections; `make` makes one (with its limits: the router keeps up to 32 idle
    connections per service, router/app.py, where the one pool kept 64 in all). A pool with nothing in
    flight and unused for `idle_s` (a service that went away or moved to another port) is closed, so
    its sockets are not kept forever."""

    def __init__(
        self,
        make: Callable[[], httpx.AsyncBaseTransport],
        idle_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make, self.idle_s, self._clock = make, idle_s, clock
        self._pools: dict[tuple[bytes, bytes, int | None], tuple[httpx.AsyncBaseTransport, list[float]]] = {}
        self._swept = clock()

    @property
    def services(self) -> int:
        """Pools open now (one per service called lately)."""
        return len(self._pools)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin = (url.raw_scheme, url.raw_host, url.port)
        now = self._clock()
        entry = self._pools.get(origin)
        if entry is None:
            entry = self._pools[origin] = (self._make(), [now])
        else:
            entry[1][0] = now
        if now - self._swept > self.idle_s:
            self._swept = now
            await self._sweep(now)
        return await entry[0].handle_async_request(request)

    async def _sweep(self, now: float) -> None:
        """Close the pools unused for idle_s with no connection in use (none in flight)."""
        stale = [
            origin
            for origin, (transport, used) in self._pools.items()
            if now - used[0] > self.idle_s and _at_rest(transport)
        ]
        # out of the map before any await (a new call there gets a fresh pool), and closed even if the
        # request that swept is cancelled meanwhile
        closing = [self._pools.pop(origin)[0] for origin in stale]
        if closing:
            await asyncio.shield(asyncio.gather(*(t.aclose() for t in closing), return_exceptions=True))

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for transport, _ in pools:
            await transport.aclose()


def _at_rest(transport: httpx.AsyncBaseTransport) -> bool:
    """No connection of the transport's pool is in use or being made (httpx's transport keeps its
    httpcore pool as `_pool`; any other transport is never taken for at rest)."""
    pool = getattr(transport, "_pool", None)
    connections = getattr(pool, "connections", None)
    if connections is None:
        return False
    return all(c.is_idle() or c.is_closed() for c in connections)


class PrefillFailed(Exception):
    """The prefill call failed in a way another prefill worker may not (connection, 5xx).
    `unreachable`: the connection failed or broke (the worker may be gone)."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class DecodeLost(APIError):
    """The decode stream broke, closed early or went silent: another decode service may finish the
    request (the router migrates it). `detail` says which and how (the log's); the message is generic."""

    def __init__(self, detail: str, stalled: bool = False, worker: Worker | None = None) -> None:
        super().__init__(502, DECODE_STALLED if stalled else DECODE_FAILED, detail=detail)
        self.stalled, self.worker = stalled, worker  # worker: the decode service it was lost on


class Busy(Exception):
    """Every decode service tried answered 503 (queue full)."""


class Unreachable(Exception):
    """No decode service tried could be connected to."""


async def until_deadline(aw: Awaitable[T], deadline: float | None) -> T:
    try:
        async with asyncio.timeout(None if deadline is None else deadline - time.time()):
            return await aw
    except TimeoutError:
        raise APIError(504, "deadline exceeded", code="deadline_exceeded") from None


async def _pump_frames(
    raw: AsyncIterator[bytes], reader: FrameReader, queue: asyncio.Queue[Any], worker: Worker
) -> None:
    """DecodeStream's reader: the response's frames into `queue`, then the reason it ended."""
    try:
        while True:
            chunk = await anext(raw, b"")
            if not chunk:
                why = f"decode service {worker.id} closed the stream before the request finished"
                await queue.put(DecodeLost(why, worker=worker))
                return
            for frame in reader.feed(chunk):
                await queue.put(frame)
    except httpx.HTTPError as e:
        await queue.put(DecodeLost(f"decode stream from {worker.id} broke: {e!r}", worker=worker))
    except ProtocolError as e:
        detail = f"decode stream from {worker.id}: {e}"
        await queue.put(APIError(502, "the decode service sent an invalid answer", detail=detail))


class DecodeStream:
    """An open POST /internal/generate response: length-prefixed frames, read one at a time."""

    def __init__(self, worker: Worker, resp: httpx.Response, deadline: float) -> None:
        self.worker, self.deadline = worker, deadline
        self._resp, self._raw = resp, resp.aiter_raw()
        self._reader, self._frames = FrameReader(DecodeFrame), deque[Any]()
        # One task reads the response and queues its frames, so that waiting for a frame can be
        # cancelled safely (racing the prefill call, see Legs.prefill): cancelling a read
        # of the HTTP stream itself would close it.
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        # a function of its own, not a method: the task a close cancels keeps its CancelledError, whose
        # traceback holds the pump's frames; through a `self` among their locals that made a reference
        # cycle task -> error -> frame -> stream -> task per request, with the whole HTTP read stack in
        # it, which only the garbage collector could free (common/runtime/gc_pauses.py)
        self._pump = asyncio.create_task(_pump_frames(self._raw, self._reader, self._queue, worker))

    def push_back(self, frame: Any) -> None:
        """Return a frame taken early (while racing the prefill call) to the front of the stream."""
        self._frames.appendleft(frame)

    @classmethod
    async def open(
        cls,
        client: httpx.AsyncClient,
        decodes: list[Worker],
        body: bytes,
        deadline: float,
        unreachable: Callable[[Worker], None] | None = None,
    ) -> tuple[DecodeStream, Reserved]:
        """Open on the first of `decodes` (best first) that takes the request; its Reserved frame.

        Raises Busy if every one answered 503 (or was unreachable), Unreachable if none could be reached.
        `unreachable` is told each one that could not be reached."""
        busy, errors = False, []
        for w in decodes:
            headers = inject_headers(dict(MSGPACK))  # W3C trace context on every HTTP hop
            req = client.build_request("POST", f"{w.url}/internal/generate", content=body, headers=headers)
            try:
                resp = await until_deadline(client.send(req, stream=True), deadline)
            except httpx.TransportError as e:
                errors.append(f"{w.id}: {e!r}")
                if unreachable is not None:
                    unreachable(w)
                continue
            if resp.status_code != 200:
                text = await error_text(resp)
                await resp.aclose()
                if resp.status_code == 503:  # D's queue is full: try the next one
                    busy = True
                    continue
                raise upstream_error(resp.status_code, "decode", f"decode service {w.id}: {text}")
            stream = cls(w, resp, deadline)
            try:
                frame = await stream.next_frame()
                if isinstance(frame, ErrorFrame) and frame.code == 503:
                    busy = True
                    await stream.aclose()
                    continue
                if not isinstance(frame, Reserved):
                    raise unexpected(frame, "reserved", w)
            except BaseException:
                await stream.aclose()
                raise
            return stream, frame
        if busy:
            raise Busy()
        raise Unreachable("; ".join(errors))

    async def next_frame(self, stall_s: float | None = None) -> Any:
        """The next frame; with stall_s, DecodeLost(stalled) if none comes that soon (deadline first)."""
        if self._frames:
            return self._frames.popleft()
        if stall_s is not None and self.deadline - time.time() > stall_s:
            try:
                async with asyncio.timeout(stall_s):
                    item = await self._queue.get()
            except TimeoutError:
                why = f"decode service {self.worker.id} sent nothing for {stall_s:g} s"
                raise DecodeLost(why, stalled=True, worker=self.worker) from None
        else:
            item = await until_deadline(self._queue.get(), self.deadline)
        if isinstance(item, APIError):
            self._queue.put_nowait(item)  # the stream is over: every later read says so too
            raise item
        return item

    async def aclose(self) -> None:
        """Closing the stream early is how the decode service learns to abort and free the blocks."""
        self._pump.cancel()
        await self._resp.aclose()


async def call_prefill(client: httpx.AsyncClient, w: Worker, req: PrefillRequest) -> PrefillResult:
    """POST /internal/prefill; P writes the prompt's KV into D's blocks. Returns its answer: the first
    token (and the logprobs the request asked for)."""
    try:
        resp = await until_deadline(
            client.post(
                f"{w.url}/internal/prefill", content=encode(req), headers=inject_headers(dict(MSGPACK))
            ),
            req.deadline,
        )
    except httpx.TransportError as e:
        raise PrefillFailed(f"{w.id}: {e!r}", unreachable=True) from e
    if resp.status_code == 504:  # past the deadline: another worker would be too
        raise upstream_error(504, "prefill", f"prefill service {w.id}: {await error_text(resp)}")
    if resp.status_code >= 500 or resp.status_code == 409:  # 409: still busy with this id (another try)
        raise PrefillFailed(f"{w.id} answered {resp.status_code}: {await error_text(resp)}")
    if resp.status_code != 200:
        detail = f"prefill service {w.id} refused ({resp.status_code}): {await error_text(resp)}"
        raise APIError(502, "the prefill service failed the request", detail=detail)
    try:
        result = decode(resp.content, PrefillResult)
    except ProtocolError as e:
        detail = f"prefill service {w.id}: {e}"
        raise APIError(502, "the prefill service sent an invalid answer", detail=detail) from e
    return result


async def post_abort(client: httpx.AsyncClient, w: Worker, request_id: str, timeout_s: float = 2.0) -> None:
    """Best effort: tell a service to drop the request (its leases expire on their own anyway). The
    service answers once the request is gone there, so a caller that waits for the answer may place
    the same request id on it again."""
    try:
        body = encode(AbortRequest(request_id))
        await client.post(f"{w.url}/internal/abort", content=body, headers=MSGPACK, timeout=timeout_s)
    except httpx.HTTPError as e:
        log.warning("request %s: abort on %s failed: %r", request_id, w.id, e)


def unexpected(frame: Any, wanted: str, worker: Worker | None = None) -> APIError:
    """A decode stream's frame that is not the `wanted` kind: the service's ErrorFrame, or nonsense."""
    source = f"decode service {worker.id}" if worker is not None else "decode service"
    if isinstance(frame, ErrorFrame):
        detail = f"{source} ended the request ({frame.code}): {frame.error}"
        return upstream_error(frame.code, "decode", detail)
    got = f"{getattr(frame, 'kind', type(frame).__name__)!r}"[:100]
    detail = f"{source}: expected a {wanted!r} frame, got {got}"
    return APIError(502, "the decode service sent an invalid answer", detail=detail)


def _client_status(upstream: int) -> int:
    """What the client sees for an upstream error code: its own fault (400) and deadlines (504)
    pass through; anything else is the router's upstream failing (502)."""
    return upstream if upstream in (400, 504) else 502


def upstream_error(upstream: int, role: str, detail: str) -> APIError:
    """The client's error for a `role` ("decode", "prefill") service's error code: a generic message by
    status (`_client_status`); what the service said, and which one it was, only in `detail`."""
    status, detail = _client_status(upstream), detail[:DETAIL_CHARS]
    if status == 504:
        return APIError(504, "deadline exceeded", code="deadline_exceeded", detail=detail)
    if status == 400:
        return APIError(400, f"the {role} service refused the request", detail=detail)
    return APIError(502, f"the {role} service failed the request", detail=detail)


async def error_text(resp: httpx.Response) -> str:
    """An upstream error body as text, for an error's `detail` (never its message): an ErrorFrame's or a
    JSON error's message, else the raw text."""
    body = await resp.aread()
    with contextlib.suppress(ProtocolError):
        return decode(body, ErrorFrame).error
    with contextlib.suppress(ValueError, TypeError, KeyError):
        return str(json.loads(body)["error"]["message"])
    return f"HTTP {resp.status_code}: {body[:300].decode('utf-8', 'replace')}"
