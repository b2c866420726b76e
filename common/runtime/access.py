"""Request ids and the access log, one ASGI middleware for every splitserve process (router, prefill,
decode).

For each HTTP request it
- gives the request an id at once (`scope["state"]["request_id"]`, "req-<hex>"); a handler that knows
  the real one (the router's generation id, a service's message id) sets `request.state.request_id`,
  and from then on that is the id;
- keeps the id in `common.runtime.logs.request_id_var` while the request is handled, so every line
  logged meanwhile carries it;
- puts it in the response's x-request-id header, unless the handler put one there itself (then that
  one is the id);
- logs one line when the request ends, on "splitserve.access": method, path and query (escaped: a %0a
  in a path cannot start a line of its own), status, duration, request id and client. /health and
  /metrics are polled every second or so by probes and scrapers: those lines are at debug, not info.

An exception that escapes the app is logged with its traceback; with `error_app` set it is answered
with that app's response (the router's OpenAI-style 500), else it propagates (the server answers 500).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.runtime.logs import escape, request_id_var

log = logging.getLogger("splitserve.access")
QUIET_PATHS = frozenset({"/health", "/metrics"})  # polled every second: logged at debug


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


class _RequestState(dict[str, Any]):
    """scope["state"] (what request.state reads and writes): setting request_id also makes it the id of
    the context's log lines."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key == "request_id" and isinstance(value, str):
            request_id_var.set(value)


def request_target(scope: Scope) -> str:
    """The request's path and query string, escaped for a log line."""
    path = escape(scope.get("path", ""))
    query = scope.get("query_string", b"")
    if query:
        path += "?" + escape(query.decode("latin-1"))
    return path


def _client(scope: Scope) -> str:
    client = scope.get("client")
    if not client:
        return "-"
    host, port = client[0], client[1] if len(client) > 1 else None
    return escape(f"{host}:{port}" if port is not None else host)


_HEADER_ID = re.compile(r"[\x21-\x7e]{1,200}")  # what an x-request-id header may carry


class AccessLog:
    """ASGI middleware: request id, x-request-id header, one access line per request (module doc)."""

    def __init__(self, app: ASGIApp, error_app: Callable[[], ASGIApp] | None = None) -> None:
        self.app = app
        self.error_app = error_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state = _RequestState(scope.get("state") or {})
        scope["state"] = state
        token = request_id_var.set(None)
        state.setdefault("request_id", new_request_id())
        request_id_var.set(state["request_id"])
        status: int | None = None
        sent_id: str | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status, sent_id
            if message["type"] == "http.response.start":
                status = message["status"]
                # a request id comes from the caller's message (a service's) or a handler: one that is
                # not a plain header token (control characters, spaces, non-ASCII, too long) would make
                # the server refuse to send the response at all, so the header gets a fresh id instead
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                given = [v for k, v in message.get("headers", []) if k.lower() == b"x-request-id"]
                sent_id = given[0].decode("latin-1") if given else str(state["request_id"])
                if not _HEADER_ID.fullmatch(sent_id):
                    sent_id = new_request_id()
                headers.append((b"x-request-id", sent_id.encode("ascii")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error in %s %s", escape(scope.get("method", "")), request_target(scope))
            if status is not None or self.error_app is None:
                status = status or 500
                raise
            await self.error_app()(scope, receive, send_with_id)
        finally:
            self._log(scope, status, sent_id or state.get("request_id"), start)
            request_id_var.reset(token)

    @staticmethod
    def _log(scope: Scope, status: int | None, rid: str | None, start: float) -> None:
        level = logging.DEBUG if scope.get("path") in QUIET_PATHS else logging.INFO
        if not log.isEnabledFor(level):
            return
        ms = (time.perf_counter() - start) * 1000
        method, target, client = escape(scope.get("method", "")), request_target(scope), _client(scope)
        shown = status if status is not None else "-"  # no response: the client left first
        log.log(
            level,
            "%s %s %s %.1f ms %s",
            method, target, shown, ms, client,
            extra={
                "request_id": escape(rid) if rid else None,
                "method": method,
                "path": target,
                "status": status,
                "duration_ms": round(ms, 2),
                "client": client,
            },
        )  # fmt: skip
