"""The HTTP server settings every splitserve process uses (uvicorn), with the limits a server facing
untrusted clients needs:

- a request's head (request line and headers) must arrive within `header_timeout_s` of the connection
  opening or of the previous response (a slow-loris client that trickles headers is disconnected), and
  may be at most `max_header_bytes` long (larger: 400 and the connection closed);
- an idle keep-alive connection is closed after `keep_alive_s`;
- at most `max_connections` connections at once (beyond it uvicorn answers 503);
- HTTP/1.1 only: one request in flight per connection, so "streams per connection" is 1 by construction;
- TLS with `ssl_certfile`/`ssl_keyfile`.

Body limits are the application's (the router's max_body_bytes, the services' frame limit): each reads
the body as a stream and stops at its limit.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True)
class HTTPLimits:
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    keep_alive_s: int = 5
    max_connections: int | None = None


class HeadTooLarge(Exception):
    pass


def _protocol(limits: HTTPLimits) -> type[HttpToolsProtocol]:
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
    """A uvicorn.Config with the limits above; `kwargs` go to uvicorn.Config as they are."""
    if bool(ssl_certfile) != bool(ssl_keyfile):
        raise ValueError("TLS needs both a certificate file and its key file")
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=_protocol(limits),
        timeout_keep_alive=limits.keep_alive_s,
        limit_concurrency=limits.max_connections,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        **kwargs,
    )
