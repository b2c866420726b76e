"""Test helpers for the router (no tests here): fake decode/prefill services speaking the real
protocol, and an in-process transport that streams (httpx.ASGITransport buffers whole bodies, so a
router could never see a stream being closed, and a fake service never a disconnect)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import ASGIApp, Message

from common.cluster.records import (
    TRANSITIONS,
    DuplicateRequest,
    IllegalTransition,
    RequestState,
    UnknownRequest,
)
from common.protocol import (
    AbortRequest,
    ErrorFrame,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    Reserved,
    TokenFrame,
    decode,
    encode,
    frame,
)
from common.sampling_params import TokenLogprob
from common.text.model_info import ModelInfo, load_model_info
from router.app import create_app
from router.config import RouterConfig

MSGPACK = "application/msgpack"


@functools.cache
def model_info() -> ModelInfo:
    """The real (torch-free) SmolLM2 tokenizer, loaded once per test session."""
    return load_model_info()


class _Body(httpx.AsyncByteStream):
    def __init__(self, queue: asyncio.Queue[bytes | None], gone: asyncio.Event, task: asyncio.Task[None]):
        self.queue, self.gone, self.task = queue, gone, task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.queue.get()) is not None:
            yield chunk

    async def aclose(self) -> None:
        self.gone.set()  # the app's next receive() says http.disconnect
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(self.task), 5)


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """Sends each request to the ASGI app named by its host ("http://decode/..." -> apps["decode"])."""

    def __init__(self, apps: dict[str, ASGIApp]) -> None:
        self.apps = apps

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        app = self.apps.get(request.url.host)
        if app is None:
            raise httpx.ConnectError(f"nothing listens on {request.url.host}", request=request)
        body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},  # spec 2.0: Starlette listens for disconnects, as under uvicorn
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "server": (request.url.host, request.url.port or 80),
            "client": ("127.0.0.1", 1234),
            "root_path": "",
        }
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        started: asyncio.Future[tuple[int, list[Any]]] = asyncio.get_running_loop().create_future()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.set_result((message["status"], message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    queue.put_nowait(message["body"])
                if not message.get("more_body"):
                    queue.put_nowait(None)

        async def run() -> None:
            try:
                await app(scope, receive, send)
            except Exception as e:
                if not started.done():
                    started.set_exception(e)
            finally:
                queue.put_nowait(None)
                if not started.done():
                    started.set_exception(RuntimeError("app ended without a response"))

        task = asyncio.create_task(run())
        try:
            status, headers = await started
        except asyncio.CancelledError:  # the caller gave up before the answer began: a disconnect
            gone.set()
            raise
        return httpx.Response(status, headers=headers, stream=_Body(queue, gone, task), request=request)


class FakeRecords:
    """RequestRecords in memory, enforcing the real transition table; indexable and iterable like a
    dict of the records, for the tests' own checks."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, Any]] = {}

    def __getitem__(self, request_id: str) -> dict[str, Any]:
        return self.data[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    async def create(self, request_id: str, **fields: Any) -> float:
        if request_id in self.data:
            raise DuplicateRequest(request_id)
        self.data[request_id] = {"state": RequestState.QUEUED, "history": [(RequestState.QUEUED, 0.0)]}
        self.data[request_id].update({k: v for k, v in fields.items() if v is not None})
        return 0.0

    async def transition(self, request_id: str, new_state: RequestState | str, **fields: Any) -> float:
        rec = self.data.get(request_id)
        if rec is None:
            raise UnknownRequest(request_id)
        new = RequestState(new_state)
        if new not in TRANSITIONS[rec["state"]]:
            raise IllegalTransition(request_id, rec["state"], new)
        rec["state"] = new
        rec["history"].append((new, float(len(rec["history"]))))
        rec.update({k: v for k, v in fields.items() if v is not None})
        return 0.0

    async def set_fields(self, request_id: str, **fields: Any) -> bool:
        rec = self.data.get(request_id)
        if rec is not None:
            rec.update({k: v for k, v in fields.items() if v is not None})
        return rec is not None

    async def get(self, request_id: str) -> dict[str, Any] | None:
        rec = self.data.get(request_id)
        return None if rec is None else {**rec, "history": list(rec["history"])}


@dataclass(frozen=True)
class FakeWorker:
    id: str
    url: str
    load: dict[str, Any]
    incarnation: str = "1"
    capacity: dict[str, Any] = field(default_factory=lambda: {"block_size": 16})
    last_seen: float = 1.0  # the registry's heartbeat time (WorkerInfo.last_seen)


class FakeRegistry:
    """WorkerRegistry.alive() from a table the test edits: role -> [(name, load)]."""

    def __init__(self) -> None:
        self.workers: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        self.reads: Counter[str] = Counter()  # role -> alive() calls: a test waits on the router's next read
        self.read = asyncio.Event()  # set at each alive() call (a test clears it, then waits)

    async def alive(self, role: str) -> list[Any]:
        self.reads[role] += 1
        self.read.set()
        return [FakeWorker(name, f"http://{name}", load) for name, load in self.workers.get(role, [])]


class FakeState:
    """ClusterState's records and registry in memory."""

    def __init__(self) -> None:
        self.records = FakeRecords()
        self.registry = FakeRegistry()

    def states(self, request_id: str) -> list[str]:
        return [str(s) for s, _ in self.records[request_id]["history"]]


class FakeCluster:
    """Decode and prefill services in miniature. Every request "generates" `output_ids` (cut at
    max_tokens; finish "stop" if it all fits, as if the last token were EOS, else "length").
    The prefill service hands the first token to the decode side the way kv_done would."""

    def __init__(
        self, output_ids: list[int], chunk: int = 2, delay_s: float = 0.0, state: FakeState | None = None
    ) -> None:
        self.output_ids, self.chunk, self.delay_s = output_ids, chunk, delay_s
        self.state = state  # when set, the services record their transitions as the real ones do
        self.reservations: dict[str, tuple[int, asyncio.Future[int]]] = {}  # request id -> (fence, kv_done)
        self.fence = 0
        self.generate_calls: list[tuple[str, GenerateRequest]] = []
        self.prefill_calls: list[tuple[str, PrefillRequest]] = []
        self.aborts: list[tuple[str, str]] = []  # (service, request id) via POST /internal/abort
        self.closed_early: list[str] = []  # decode streams the router closed before they finished
        self.busy: set[str] = set()  # decode services answering 503 (queue full)
        self.failing: set[str] = set()  # prefill services answering 500
        self.error_after: int | None = None  # decode sends an ErrorFrame after this many tokens
        self.hang_after: int | None = None  # decode stops sending (but stays open) after this many
        self.prefill_hangs = False  # prefill never answers
        self.repeat = 0  # frames repeat this many tokens already sent (the router must refuse them)
        # decode service name -> ("break" | "stall", output index): that service's streams close, or go
        # silent, once they reach that output index
        self.fail_on: dict[str, tuple[str, int]] = {}
        # decode services that die while the prefill service writes a request's KV: the stream ends
        # after Reserved, and the prefill (its transfer stuck) lets go only when aborted, teardown_s later
        self.dies_in_prefill: set[str] = set()
        self.teardown_s = 0.2
        self.dies_before_reserved: set[str] = set()  # decode services whose streams end at once
        self._reserved_on: dict[str, str] = {}  # request id -> the decode service of its reservation
        self._prefilling: dict[tuple[str, str], asyncio.Event] = {}  # (prefill, request id) -> aborted

    def decode_app(self, name: str) -> FastAPI:
        app = FastAPI()

        @app.post("/internal/generate")
        async def generate(request: Request) -> Response:
            req = decode(await request.body(), GenerateRequest)
            self.generate_calls.append((name, req))
            if name in self.busy:
                return Response(
                    encode(ErrorFrame(req.request_id, "queue full", 503)), 503, media_type=MSGPACK
                )
            self.fence += 1
            kv_done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self.reservations[req.request_id] = (self.fence, kv_done)
            self._reserved_on[req.request_id] = name
            return StreamingResponse(self._frames(name, req, self.fence, kv_done), media_type=MSGPACK)

        @app.post("/internal/abort")
        async def abort(request: Request) -> Response:
            self.aborts.append((name, decode(await request.body(), AbortRequest).request_id))
            return Response(status_code=200)

        return app

    async def _frames(
        self, name: str, req: GenerateRequest, fence: int, kv_done: asyncio.Future[int]
    ) -> AsyncIterator[bytes]:
        rid, done = req.request_id, False
        try:
            remote = req.mode == "remote"
            if name in self.dies_before_reserved:
                return  # answered 200, then the process died
            blocks, endpoint = ([7, 8, 9], f"tcp://{name}:9000") if remote else ([], "")
            # D records RESERVED itself before telling anyone, so its own DECODING can never race
            # the router's RESERVED (the router's attempt then finds it done).
            await self._record(rid, RequestState.RESERVED, decode_id=f"{name}-id")
            yield frame(Reserved(rid, blocks, fence, 0, endpoint, f"{name}-id"))
            if remote and name in self.dies_in_prefill:
                while not any(r == rid for _, r in self._prefilling):
                    await asyncio.sleep(0.01)
                return  # the process died while the prefill service was writing its KV
            n_out = req.num_output_tokens  # a migrated request: the client has these outputs already
            assert req.token_ids[len(req.token_ids) - n_out :] == self.output_ids[:n_out]
            tokens = list(self.output_ids)
            if remote:
                tokens[n_out] = await kv_done
            await self._record(rid, RequestState.DECODING)
            max_tokens = req.sampling.max_tokens
            reason = "stop" if len(tokens) <= max_tokens else "length"
            tokens = tokens[:max_tokens]
            # Every token once, in order; in remote mode the first is the prefill's, not sent here.
            i = n_out + 1 if remote else n_out
            if i == len(tokens):  # the prefill's token itself ended it
                yield frame(TokenFrame(rid, [], i, reason))
            fault, fail_at = self.fail_on.get(name, ("", len(tokens) + 1))
            while i < len(tokens):
                if self.error_after is not None and i >= self.error_after:
                    yield frame(ErrorFrame(rid, "decode exploded", 500))
                    return
                hang = self.hang_after is not None and i >= self.hang_after
                if hang or (fault == "stall" and i >= fail_at):
                    await asyncio.Event().wait()
                if fault == "break" and i >= fail_at:
                    return  # the process died: the stream just ends
                await asyncio.sleep(self.delay_s)
                start = max(i - self.repeat, 0)  # `repeat` > 0: a broken decode service
                end = min(i + self.chunk, len(tokens))
                last = end == len(tokens)
                lps = _logprobs(req.sampling, tokens[start:end])
                yield frame(TokenFrame(rid, tokens[start:end], start, reason if last else None, logprobs=lps))
                i = end
            done = True
        finally:
            if not done:
                self.closed_early.append(rid)

    async def _record(self, request_id: str, new: RequestState, **fields: Any) -> None:
        if self.state is not None:
            with contextlib.suppress(IllegalTransition, UnknownRequest):
                await self.state.records.transition(request_id, new, **fields)

    def prefill_app(self, name: str) -> FastAPI:
        app = FastAPI()

        @app.post("/internal/prefill")
        async def prefill(request: Request) -> Response:
            req = decode(await request.body(), PrefillRequest)
            self.prefill_calls.append((name, req))
            key = (name, req.request_id)
            if key in self._prefilling:  # as the real service: one id at a time
                return Response(encode(ErrorFrame(req.request_id, "already in progress", 409)), 409)
            if self._reserved_on.get(req.request_id) in self.dies_in_prefill:
                aborted = self._prefilling[key] = asyncio.Event()
                try:
                    await aborted.wait()  # the transfer to a dead decode service hangs until then
                    await asyncio.sleep(self.teardown_s)
                finally:
                    del self._prefilling[key]
                return Response(b"transfer failed", 500)
            if name in self.failing:
                return Response(b"prefill worker on fire", 500)
            if self.prefill_hangs:
                await asyncio.Event().wait()
            fence, kv_done = self.reservations[req.request_id]
            first = self.output_ids[req.num_output_tokens]
            # the real P records these two itself
            await self._record(req.request_id, RequestState.PREFILLING, prefill_id=f"http://{name}")
            await self._record(req.request_id, RequestState.TRANSFERRING)
            if req.fence == fence and not kv_done.done():  # a stale fence is ignored, as on D
                kv_done.set_result(first)
            lp = _logprobs(req.sampling, [first])
            result = PrefillResult(
                req.request_id, first, len(req.token_ids), 0, 1.0, 1024, first_logprob=lp[0] if lp else None
            )
            return Response(encode(result), media_type=MSGPACK)

        @app.post("/internal/abort")
        async def abort(request: Request) -> Response:
            rid = decode(await request.body(), AbortRequest).request_id
            self.aborts.append((name, rid))
            if (aborted := self._prefilling.get((name, rid))) is not None:
                aborted.set()
                while (name, rid) in self._prefilling:  # answers once the request is gone, as the real one
                    await asyncio.sleep(0.01)
            return Response(status_code=200)

        return app


def make_router(
    cluster: FakeCluster,
    decodes: tuple[str, ...] = ("decode",),
    prefills: tuple[str, ...] = ("prefill",),
    static: bool = True,
    **config: Any,
) -> httpx.AsyncClient:
    """A client for a router app whose workers are the cluster's fake services (records go to
    cluster.state when it has one, else nowhere). With static=False the router finds its workers in
    cluster.state's registry instead of fixed URL lists."""
    app = router_app(cluster, decodes, prefills, static, **config)
    return httpx.AsyncClient(transport=StreamingASGITransport({"router": app}), base_url="http://router")


def router_app(
    cluster: FakeCluster,
    decodes: tuple[str, ...] = ("decode",),
    prefills: tuple[str, ...] = ("prefill",),
    static: bool = True,
    **config: Any,
) -> Any:
    """The router app itself (see make_router)."""
    apps: dict[str, ASGIApp] = {n: cluster.decode_app(n) for n in decodes}
    apps |= {n: cluster.prefill_app(n) for n in prefills}
    upstream = httpx.AsyncClient(transport=StreamingASGITransport(apps))
    cfg = RouterConfig(
        decode_urls=[f"http://{n}" for n in decodes] if static else [],
        prefill_urls=[f"http://{n}" for n in prefills] if static else [],
        **config,
    )
    return create_app(cfg, cluster.state, model_info(), http_client=upstream)  # type: ignore[arg-type]


def sse_events(body: str) -> list[Any]:
    """The data payloads of an SSE body, JSON-decoded ("[DONE]" stays a string)."""
    import json

    out: list[Any] = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _logprobs(sampling: Any, tokens: list[int]) -> list[TokenLogprob] | None:
    """What a real service sends when the request asks for logprobs: one per token (a fixed value)."""
    if sampling.logprobs is None or not tokens:
        return None
    return [TokenLogprob(-0.5, tuple((t, -0.5) for t in tokens[:1]) * sampling.logprobs) for t in tokens]
