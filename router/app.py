"""The router's FastAPI app: the OpenAI-compatible front door of splitserve.

Run it:  `router.app.serve(RouterConfig())`  (loads the tokenizers, connects Redis, runs uvicorn), or
build it yourself with `create_app(config, state, model_info)` and hand it to any ASGI server.
The router never imports torch: everything it needs about each model it serves (config.model, one or
several: router/served_model.py) comes from `load_model_info`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.cluster.kv_events import KVIndex
from common.cluster.owners import RouterOwnership
from common.cluster.state import ClusterState
from common.runtime.access import AccessLog
from common.runtime.http_server import OVER_LIMIT, HTTPLimits, server_config
from common.runtime.logs import configure_logging, is_configured
from common.runtime.telemetry import fastapi_telemetry, setup_tracing
from common.security.internal_auth import SignedCalls
from common.security.secret import InternalSecret
from common.text.model_info import ModelInfo, load_model_info
from router.access import AUTHENTICATED, Access
from router.auth.keys import ApiKey
from router.config import RouterConfig
from router.errors import APIError, install_handlers, unavailable
from router.http_backend import service_transport, without_cookies
from router.metrics import RouterMetrics
from router.openai_types import ChatCompletionRequest, CompletionRequest, request_body_schema
from router.orchestrator import Orchestrator
from router.prep import prepare_detokenize, prepare_tokenize
from router.serving import Server
from router.tokenize import detokenize_body_schema, tokenize_body_schema
from router.upstream import PerServiceTransport, SettledTransport

log = logging.getLogger(__name__)
IDLE_PER_SERVICE = 32  # idle connections kept to each service (router/upstream.py PerServiceTransport)


def create_app(
    config: RouterConfig,
    state: ClusterState | None,
    model_info: ModelInfo | Sequence[ModelInfo],
    *,
    http_client: httpx.AsyncClient | None = None,
    close_state: bool = False,
    secret: InternalSecret | None = None,
    warm_pool: bool = False,
) -> FastAPI:
    """The router app. `state=None` runs without Redis (no request records, no API keys in Redis;
    workers must come from config.decode_urls/prefill_urls). `http_client` is for tests (fake services
    behind a transport); by default the app makes one shared client, signing every call with `secret`
    (default: SPLITSERVE_INTERNAL_SECRET), and closes it at shutdown. With `close_state` the app also
    closes `state` at shutdown. With `warm_pool` the request-preparation workers start with the app,
    else on the first large body (router/prep.py). `model_info`: each model of config.model, loaded, in
    its order."""
    setup_tracing("router")
    secret = InternalSecret.from_env() if secret is None else secret
    owns_client = http_client is None
    client = http_client or _service_client(config, secret)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await access.start()
        if warm_pool:  # the request-preparation workers (router/prep.py) before the first large body
            await server.prep.warm()
        if isinstance(state, ClusterState):
            url = config.metrics_url()
            if url is None:
                log.warning(
                    "this router registers no URL for the planner's --discover-routers (its port is chosen "
                    "at bind time, or its wildcard host's hostname does not resolve): give --advertise-host"
                )
            orch.owners = RouterOwnership(state.redis, state.prefix, router_id, state.records, url=url)
            orch.owners.start()
        if index is not None:
            await index.start()
        yield
        if index is not None:
            await index.stop()
        await access.stop()
        await server.prep.close()
        if orch.owners is not None:
            await orch.owners.stop()
        if orch.records is not None:
            await orch.records.close()
        if owns_client:
            await client.aclose()
        if close_state and state is not None:
            await state.close()

    app = FastAPI(title="splitserve router", lifespan=lifespan, **fastapi_telemetry())
    metrics = RouterMetrics()
    # unique per start: a restarted container has the same host name and pid
    router_id = f"router-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    # prefix-aware routing follows the services' KV events in Redis (common/cluster/kv_events.py)
    index = (
        KVIndex(state.redis, state.prefix)
        if isinstance(state, ClusterState) and config.routing == "prefix_aware"
        else None
    )
    infos = [model_info] if isinstance(model_info, ModelInfo) else list(model_info)
    orch = Orchestrator(config, state, client, metrics, router_id, index, infos[0].tokenizer.fingerprint)
    metrics.watch(orch)
    redis = state.redis if isinstance(state, ClusterState) else None
    access = Access(
        config, redis, state.prefix if isinstance(state, ClusterState) else "splitserve:", metrics
    )
    server = Server(config, infos, orch, metrics, access)  # tells orch.pool the models
    started = int(time.time())
    install_handlers(app)
    # the key is checked on the headers before a body is read: no valid key, no wait for a body
    app.add_middleware(
        BodyLimit,
        max_bytes=config.max_body_bytes,
        timeout_s=config.body_timeout_s,
        authenticate=access.authenticate,
    )
    # over the connection limit (SPLITSERVE_ROUTER_MAX_CONNECTIONS; the server marks such requests:
    # common/runtime/http_server.py): an OpenAI-style 503 with Retry-After, before the key or the body,
    # with an access line and a request id like every other answer (the next middleware)
    app.add_middleware(
        OverLimit, retry_after_s=config.retry_after_s, count=metrics.shed.labels("connections").inc
    )
    app.state.answers_over_limit = True
    # outermost: every response carries x-request-id (the generation id when there is one: handlers set
    # request.state.request_id, else a fresh id), every request gets one access line (413s and 408s
    # too), and an unhandled error becomes an OpenAI-style 500 here, so it gets the header as well
    app.add_middleware(AccessLog, error_app=lambda: APIError(500, "internal error").response())
    app.state.on_serving = lambda url: log.info(
        "router serving on %s, model %s", url, ", ".join(server.models.names)
    )
    app.state.server, app.state.metrics, app.state.access = server, metrics, access
    inference = Depends(access.require("inference"))

    served = server.models.aliases()

    @app.post(
        "/v1/completions", openapi_extra={"requestBody": request_body_schema(CompletionRequest, served)}
    )
    async def completions(request: Request, key: ApiKey | None = inference) -> Response:
        return await server.generate(request, chat=False, key=key)

    @app.post(
        "/v1/chat/completions",
        openapi_extra={"requestBody": request_body_schema(ChatCompletionRequest, served)},
    )
    async def chat_completions(request: Request, key: ApiKey | None = inference) -> Response:
        return await server.generate(request, chat=True, key=key)

    async def metered(request: Request, key: ApiKey | None, job: Callable[..., dict[str, Any]]) -> Response:
        """/tokenize, /detokenize: charged one request (no tokens) to the key's limits before the body
        is parsed, as a generation is (429 past them); its concurrency slot is held while it runs. The
        work runs as a generation's parse does (router/prep.py: off the loop for a large body); a body
        it refuses is charged to the key's refusals too."""
        request_id = getattr(request.state, "request_id", None) or f"req-{uuid.uuid4().hex}"
        access.check_refusals(key)
        admission = await access.admit(key, request_id, 0, generation=False)
        try:
            body = await request.body()
            try:
                result = await server.prep.run(key, len(body), job, body)
            except APIError as e:
                if e.status == 400:
                    await access.refused(key, charge_request=False)  # its request was charged above
                raise
        finally:
            await access.release(admission, 0)
        return JSONResponse(result, headers=admission.headers)

    @app.post("/tokenize", openapi_extra={"requestBody": tokenize_body_schema(served)})
    async def tokenize_endpoint(request: Request, key: ApiKey | None = inference) -> Response:
        return await metered(request, key, prepare_tokenize)

    @app.post("/detokenize", openapi_extra={"requestBody": detokenize_body_schema(served)})
    async def detokenize_endpoint(request: Request, key: ApiKey | None = inference) -> Response:
        return await metered(request, key, prepare_detokenize)

    @app.get("/v1/models", dependencies=[inference])
    async def models() -> dict[str, Any]:
        """Every model the router serves, whether or not a service of it is up now (a request for one
        with none gets 503 + Retry-After naming it; /health counts each model's services)."""
        cards = [
            {
                "id": m.name,
                "object": "model",
                "created": started,
                "owned_by": "splitserve",
                "max_model_len": m.info.context_length,
                "tool_call_parser": m.tool_format,  # how its tool calls are parsed (router/tool_formats.py)
            }
            for m in server.models.models
        ]
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            decodes = await orch.pool.candidates("decode")
            prefills = await orch.pool.candidates("prefill")
        except Exception as e:  # Redis down: the router cannot route anything
            log.warning("health: the worker registry cannot be read: %r", e)  # the log's, not the caller's
            return JSONResponse({"status": "error", "error": "worker registry unavailable"}, status_code=503)
        body: dict[str, Any] = {
            "status": "ok",
            "decode_workers": len(decodes),
            "prefill_workers": len(prefills),
        }
        if len(server.models.models) > 1:  # each model's own services
            body["models"] = {
                name: {
                    "decode_workers": sum(w.model == name for w in decodes),
                    "prefill_workers": sum(w.model == name for w in prefills),
                }
                for name in server.models.names
            }
        return JSONResponse(body)

    @app.get("/metrics", dependencies=[Depends(access.require("metrics"))])
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/requests/{request_id}")
    async def request_record(request_id: str, key: ApiKey | None = inference) -> dict[str, Any]:
        record = await state.records.get(request_id) if state is not None else None
        if record is not None and not access.may_read(key, record.get("tenant")):
            record = None  # another tenant's request: not found, as far as this key can tell
        if record is None:
            kept = "" if state is not None else " (this router keeps no records: no Redis configured)"
            raise APIError(404, f"no request `{request_id}`{kept}", "request_id", "request_not_found")
        if "history" in record:
            record["history"] = [[str(s), t] for s, t in record["history"]]
        return {k: str(v) if k == "state" else v for k, v in record.items()}

    return app


def _service_client(config: RouterConfig, secret: InternalSecret) -> httpx.AsyncClient:
    """The router's client to the services: a pool per service (httpcore's bookkeeping walks every
    connection of a pool per call), each on asyncio sockets (router/http_backend.py), one TLS context
    for all of them (made once, not per pool), no cookie store."""
    pools = functools.partial(
        service_transport,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=IDLE_PER_SERVICE),
        verify=_internal_tls(config),
    )
    return without_cookies(
        httpx.AsyncClient(
            # Connecting must be quick; reading must not time out (a decode stream lasts as long as the
            # generation): the request's own deadline bounds every wait instead.
            timeout=httpx.Timeout(None, connect=config.connect_timeout_s),
            # the services refuse /internal/ calls without the cluster secret's proof
            auth=SignedCalls(secret),
            transport=SettledTransport(PerServiceTransport(pools)),
        )
    )


def _internal_tls(config: RouterConfig) -> ssl.SSLContext:
    """How the router checks the services' HTTPS: the system's CAs, or internal_ca_file's."""
    if not config.internal_ca_file:
        return httpx.create_ssl_context()  # what verify=True makes (httpx's default CAs)
    ctx = ssl.create_default_context(cafile=config.internal_ca_file)
    ctx.check_hostname = config.internal_tls_check_hostname
    return ctx


class OverLimit:
    """A request that came over the router's connection limit (marked by the HTTP server: its open
    connections or requests in flight at SPLITSERVE_ROUTER_MAX_CONNECTIONS) gets an OpenAI-style 503 with
    Retry-After and `Connection: close` (its connection is one too many), counted as shed
    ("connections"); nothing of it is read or run."""

    def __init__(self, app: ASGIApp, retry_after_s: int, count: Callable[[], None]) -> None:
        self.app, self.retry_after_s, self.count = app, retry_after_s, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not scope.get(OVER_LIMIT):
            await self.app(scope, receive, send)
            return
        self.count()
        error = unavailable("the router is at its limit of open connections; retry later", self.retry_after_s)
        error.headers["Connection"] = "close"
        await error.response()(scope, receive, send)


class BodyLimit:
    """The key first, then the body. A request that may carry a body (not GET, HEAD, OPTIONS) is
    authenticated on its headers alone (`authenticate`: 401 or 503 at once, the body never read; the key
    is left in request.state for the route's dependency, which checks its scope). Then a body of more
    than `max_bytes` gets 413 (by its Content-Length before reading, else as soon as it grows past the
    limit); one that does not arrive within `timeout_s` gets 408. Answers given before the body was
    read close the connection (its unread body would otherwise be the next request's head)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float,
        authenticate: Callable[[Headers], Awaitable[Any]] | None = None,
    ) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self.authenticate = authenticate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        unread = {"Connection": "close"}
        if self.authenticate is not None:
            try:
                key = await self.authenticate(Headers(scope=scope))
            except APIError as e:
                e.headers.update(unread)
                await e.response()(scope, receive, send)
                return
            scope.setdefault("state", {})[AUTHENTICATED] = key
        too_large = APIError(
            413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large", headers=unread
        )
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                await too_large.response()(scope, receive, send)
                return
        chunks: list[bytes] = []
        size, more = 0, True
        try:
            async with asyncio.timeout(self.timeout_s):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    more = message.get("more_body", False)
                    if size > self.max_bytes:
                        await too_large.response()(scope, receive, send)
                        return
        except TimeoutError:
            slow = APIError(408, f"request body not received within {self.timeout_s:g} s", code="timeout")
            await slow.response()(scope, receive, send)
            return
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, when it comes

        await self.app(scope, replay, send)


def build_app(config: RouterConfig | None = None) -> FastAPI:
    """An app from settings alone (SPLITSERVE_ROUTER_* env): tokenizers from config.model, Redis from
    config.redis_url. Usable as a uvicorn factory: `uvicorn router.app:build_app --factory`."""
    if not is_configured():  # run by uvicorn itself (the factory): our log lines, access log included
        configure_logging(process="router")
    config = config or RouterConfig()
    infos = []
    models: list[str | None] = [*config.model] or [None]
    for model in models:
        log.info("loading the tokenizer of %s ...", model or "the default model (SmolLM2-135M)")
        t0 = time.monotonic()
        info = load_model_info(model, chat_template=config.chat_template, max_model_len=config.max_model_len)
        log.info("tokenizer loaded: %s, %d tokens, %.1f s", info.model_id, info.tokenizer.vocab_size,
                 time.monotonic() - t0)  # fmt: skip
        infos.append(info)
    state = ClusterState.from_url(config.redis_url, config.redis_prefix) if config.redis_url else None
    # The preparation workers start on the first large body, not here: spawning them costs a router
    # 2.5 s of start-up and as much CPU (measured on 2 cores), paid by every start of every router —
    # most never see a body over parse_inline_bytes.
    return create_app(config, state, infos, close_state=True, warm_pool=False)


def serve(config: RouterConfig | None = None) -> None:
    """Run the router in the foreground (what `splitserve router` calls)."""
    import uvicorn

    config = config or RouterConfig()
    InternalSecret.from_env().require_for_bind(config.host, "the router")
    limits = HTTPLimits(
        header_timeout_s=config.header_timeout_s,
        keep_alive_s=config.keep_alive_s,
        max_connections=config.max_connections,
    )
    app = build_app(config)
    uvicorn.Server(
        server_config(
            app, config.host, config.port, limits, config.ssl_certfile, config.ssl_keyfile, log_level="info"
        )
    ).run()
