"""The router's sockets to the services, straight on asyncio: an httpcore network backend.

httpx's default backend runs every read and write through anyio (a cancel scope for each, even without a
timeout, the current async library looked up each time, typed-attribute dicts built to poll an idle
socket): ~8 % of the router's CPU in `bench fleet`. This one does the same work on an asyncio Protocol —
the loop hands it each chunk as it arrives, a read takes what is buffered or waits for the next, a write
goes to the transport (waiting only while the transport asks to pause) — with httpcore's exceptions, so
httpx maps them as it does anyio's: a connection that fails is a ConnectError (ConnectTimeout past the
connect timeout), a broken one a ReadError or WriteError. An idle connection's "is it readable" (the
server closed it) is answered from what the protocol already got, with no poll of the socket. TLS
(internal_ca_file, https:// services) goes through loop.start_tls.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Coroutine, Iterable
from typing import Any, cast

import httpcore
import httpx

READ_BUFFER_BYTES = 256 * 1024  # past this, unread, the socket is not read until the reader catches up


class _Protocol(asyncio.Protocol):
    """What one connection received, and whether it may write."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False  # the peer closed its side (or the connection is lost)
        self.error: BaseException | None = None  # the connection broke
        self.reading_paused = False
        self.writing_paused = False
        self._waiter: asyncio.Future[None] | None = None  # a read waiting for data
        self._drained: asyncio.Future[None] | None = None  # a write waiting for the buffer to drain

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio's subclasses

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > READ_BUFFER_BYTES and not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()
        _wake(self._waiter)

    def eof_received(self) -> bool:
        self.eof = True
        _wake(self._waiter)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        if exc is not None and self.error is None:
            self.error = exc
        _wake(self._waiter)
        _wake(self._drained)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        _wake(self._drained)

    async def wait_data(self) -> None:
        await self._wait("_waiter")

    async def wait_drained(self) -> None:
        await self._wait("_drained")

    async def _wait(self, slot: str) -> None:
        """Wait until the future put in `slot` (_waiter or _drained) is woken; the slot is empty again
        after, however the wait ends."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        setattr(self, slot, fut)
        try:
            await fut
        finally:
            setattr(self, slot, None)


def _wake(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport, self._protocol = transport, protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        p = self._protocol
        if not p.buffer and not p.eof:
            try:
                if timeout is None:
                    await p.wait_data()
                else:
                    async with asyncio.timeout(timeout):
                        await p.wait_data()
            except TimeoutError:
                raise httpcore.ReadTimeout(f"no data within {timeout:g} s") from None
        if p.buffer:
            data = bytes(p.buffer[:max_bytes])
            del p.buffer[:max_bytes]
            if p.reading_paused and len(p.buffer) <= READ_BUFFER_BYTES // 2:
                p.reading_paused = False
                self._transport.resume_reading()
            return data
        if p.error is not None:
            raise httpcore.ReadError(repr(p.error)) from p.error
        return b""  # the peer closed the connection

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        p = self._protocol
        if p.error is not None or self._transport.is_closing():
            raise httpcore.WriteError(repr(p.error) if p.error is not None else "the connection is closed")
        self._transport.write(buffer)
        if p.writing_paused:
            try:
                async with asyncio.timeout(timeout):
                    while p.writing_paused and p.error is None and not self._transport.is_closing():
                        await p.wait_drained()
            except TimeoutError:
                raise httpcore.WriteTimeout(f"could not write within {timeout:g} s") from None
            if p.error is not None:
                raise httpcore.WriteError(repr(p.error)) from p.error

    async def aclose(self) -> None:
        self._transport.close()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport = await loop.start_tls(
                    self._transport, self._protocol, ssl_context, server_hostname=server_hostname
                )
        except TimeoutError:
            self._transport.close()
            raise httpcore.ConnectTimeout(f"TLS handshake not done within {timeout:g} s") from None
        except (OSError, ssl.SSLError, ConnectionError) as e:
            self._transport.close()
            raise httpcore.ConnectError(repr(e)) from e
        if transport is None:  # the connection closed during the handshake
            raise httpcore.ConnectError("the connection closed during the TLS handshake")
        self._protocol.transport = transport  # what pause_reading pauses from now on
        return AsyncioStream(transport, self._protocol)

    def get_extra_info(self, info: str) -> Any:
        t = self._transport
        if info == "ssl_object":
            return t.get_extra_info("ssl_object")
        if info == "client_addr":
            return t.get_extra_info("sockname")
        if info == "server_addr":
            return t.get_extra_info("peername")
        if info == "socket":
            return t.get_extra_info("socket")
        if info == "is_readable":  # on an idle connection: only the server closing it makes it so
            p = self._protocol
            return bool(p.buffer) or p.eof or t.is_closing()
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local = (local_address, 0) if local_address else None
        opening = loop.create_connection(_Protocol, host, port, local_addr=local)
        return await _connect(opening, f"{host}:{port}", timeout, socket_options)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        opening = asyncio.get_running_loop().create_unix_connection(_Protocol, path)
        return await _connect(opening, path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def _connect(
    opening: Coroutine[Any, Any, tuple[asyncio.BaseTransport, _Protocol]],
    where: str,
    timeout: float | None,
    socket_options: Iterable[Any] | None,
) -> httpcore.AsyncNetworkStream:
    """A connection being made, as httpcore's stream: ConnectTimeout past `timeout`, ConnectError if it
    fails."""
    try:
        async with asyncio.timeout(timeout):
            transport, protocol = await opening
    except TimeoutError:
        raise httpcore.ConnectTimeout(f"no connection to {where} within {timeout:g} s") from None
    except OSError as e:
        raise httpcore.ConnectError(repr(e)) from e
    _apply(transport, socket_options)
    return AsyncioStream(cast(asyncio.Transport, transport), protocol)


def _apply(transport: asyncio.BaseTransport, options: Iterable[Any] | None) -> None:
    sock: socket.socket | None = transport.get_extra_info("socket")
    for option in options or ():
        if sock is not None:
            sock.setsockopt(*option)


def service_transport(limits: httpx.Limits, verify: ssl.SSLContext | bool) -> httpx.AsyncHTTPTransport:
    """httpx's transport (its exception mapping and response streams, httpcore's pool) on this backend.
    httpx takes no backend of its own choosing: the pool it made, still without a connection, is told
    (httpcore's pool reads `_network_backend` whenever it makes a connection)."""
    transport = httpx.AsyncHTTPTransport(limits=limits, verify=verify)
    pool = transport._pool
    if not isinstance(pool, httpcore.AsyncConnectionPool) or not hasattr(pool, "_network_backend"):
        raise RuntimeError("httpx's transport no longer holds an httpcore pool as `_pool`")
    pool._network_backend = AsyncioBackend()
    return transport


class _NoCookies(httpx.Cookies):
    """A cookie store that keeps nothing: the services set no cookies, and a router must not carry one
    service's cookie to the next call. httpx reads every response's Set-Cookie headers through a urllib
    request and an email message built for it: ~3 % of the router's CPU (bench fleet), for nothing."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


def without_cookies(client: httpx.AsyncClient) -> httpx.AsyncClient:
    """`client`, keeping no cookies from its responses (httpx's client holds its store as `_cookies`;
    the `cookies` setter would copy the store into a plain one)."""
    if not isinstance(getattr(client, "_cookies", None), httpx.Cookies):
        raise RuntimeError("httpx's client no longer holds its cookie store as `_cookies`")
    client._cookies = _NoCookies()
    return client
