"""The HTTP server settings every splitserve process uses (uvicorn), with the limits a server facing
untrusted clients needs:

- a request's head (request line and headers) must arrive within `header_timeout_s` of the connection
  opening or of the previous response (a slow-loris client that trickles headers is disconnected), and
  may be at most `max_header_bytes` long (larger: 400 and the connection closed);
- an idle keep-alive connection is closed after `keep_alive_s`;
- at most `max_connections` connections at once, and as many requests in flight (uvicorn's count): beyond
  it a request gets 503. uvicorn's own answer is a plain-text 503 with no Retry-After that passes by the
  app (no access line, no request id) and logs a warning per request; an app that sets
  `app.state.answers_over_limit` gets those requests instead, marked with `OVER_LIMIT` in their scope,
  and answers them itself (the router: an OpenAI-style 503 with Retry-After, counted; router/app.py);
- HTTP/1.1 only: one request in flight per connection, so "streams per connection" is 1 by construction;
- TLS with `ssl_certfile`/`ssl_keyfile`.

Body limits are the application's (the router's max_body_bytes, the services' frame limit): each reads
the body as a stream and stops at its limit.

Logging is `common.runtime.logs`'s: uvicorn's own logging config and access log are off, and once
`configure_logging` has run, uvicorn's `log_level` is ignored too (its loggers follow --log-level). An app
that sets `app.state.on_serving` (a function of the URL) is told once the socket is listening: that is
where each process logs its "... serving on <url>" line, and then freezes its startup heap out of the
garbage collector's reach (common/runtime/gc_pauses.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.config import http_url
from common.runtime.gc_pauses import freeze_startup_heap
from common.runtime.logs import is_configured

OVER_LIMIT = "splitserve.over_limit"  # in a request's scope: it came over max_connections (module doc)


@dataclass(frozen=True)
class HTTPLimits:
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    keep_alive_s: int = 5
    max_connections: int | None = None


class HeadTooLarge(Exception):
    pass


def _protocol(limits: HTTPLimits, app_answers_limit: bool = False) -> type[HttpToolsProtocol]:
    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with a deadline and a size limit on each request's head."""

        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.logger.warning("closing %s: request head not received in time", self.client)
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            if self._head_timer is None:  # a keep-alive connection's next request
                self._arm()

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > limits.max_header_bytes:
                raise HeadTooLarge()  # the parser reports it; uvicorn answers 400 and closes

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            limit = limits.max_connections
            # uvicorn's own test (its limit_concurrency is off when the app answers: server_config)
            over = limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit)
            if app_answers_limit and over:
                self.scope[OVER_LIMIT] = True  # type: ignore[literal-required]
            super().on_headers_complete()

    return LimitedHttpToolsProtocol


def server_config(
    app: Any,
    host: str,
    port: int,
    limits: HTTPLimits = HTTPLimits(),
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    **kwargs: Any,
) -> uvicorn.Config:
    """A uvicorn.Config with the limits above; `kwargs` go to uvicorn.Config as they are, but for
    logging (the module doc): log_config and access_log are always off, log_level is dropped once
    configure_logging has run."""
    if bool(ssl_certfile) != bool(ssl_keyfile):
        raise ValueError("TLS needs both a certificate file and its key file")
    kwargs["log_config"], kwargs["access_log"] = None, False
    if is_configured():
        kwargs.pop("log_level", None)
    state = getattr(app, "state", None)
    answers_limit = bool(getattr(state, "answers_over_limit", False))
    on_serving = getattr(state, "on_serving", None)
    if callable(on_serving) and "callback_notify" not in kwargs:
        kwargs["callback_notify"] = _notify_once(on_serving, http_url(host, port, bool(ssl_certfile)))
        logging.getLogger("uvicorn.error").addFilter(_drop_running_line)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=_protocol(limits, answers_limit),
        timeout_keep_alive=limits.keep_alive_s,
        limit_concurrency=None if answers_limit else limits.max_connections,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        **kwargs,
    )


def _notify_once(on_serving: Callable[[str], None], url: str) -> Callable[[], Awaitable[None]]:
    """uvicorn calls `callback_notify` on its first tick after the socket listens (then every
    timeout_notify seconds): the first call reports the URL, the rest do nothing."""
    done = False

    async def notify() -> None:
        nonlocal done
        if not done:
            done = True
            on_serving(url)
            freeze_startup_heap()  # what startup built is never walked by the collector again

    return notify


def _drop_running_line(record: logging.LogRecord) -> bool:
    """uvicorn's "Uvicorn running on ..." says what the app's own serving line says: one is enough."""
    return not str(record.msg).startswith("Uvicorn running on")
