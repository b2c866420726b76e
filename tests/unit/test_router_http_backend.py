"""The router's client to the services: httpx on router/http_backend.py's asyncio sockets, one pool per
service (router/upstream.py PerServiceTransport). Against a real HTTP/1.1 server on 127.0.0.1 (asyncio
streams in this process), under asyncio's loop and uvloop's (the router's)."""

from __future__ import annotations

import asyncio
import gc
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import uvloop

from router.app import create_app
from router.config import RouterConfig
from router.http_backend import AsyncioBackend, service_transport
from router.upstream import DecodeStream, PerServiceTransport, SettledTransport
from router.workers import Worker
from tests.support.router_fakes import model_info

LOOPS = ["asyncio", "uvloop"]


def run(loop: str, main: Callable[[], Awaitable[Any]]) -> Any:
    return uvloop.run(main()) if loop == "uvloop" else asyncio.run(main())


class Server:
    """HTTP/1.1 on 127.0.0.1: GET /stream answers `chunks` chunked pieces (then, with `cut`, closes
    the connection before the last chunk; with `hold`, its head only and then nothing), anything else
    echoes its body; keep-alive. Counts the
    connections it accepted; `close_idle()` closes every connection it holds."""

    def __init__(self, chunks: int = 5, cut: bool = False, hold: bool = False) -> None:
        self.chunks, self.cut, self.hold = chunks, cut, hold
        self.connections = 0
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close_idle()
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close_idle(self) -> None:
        for w in self._writers:
            w.close()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if path == "/stream":
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    if self.hold:  # the head only, then nothing until the client leaves
                        await writer.drain()
                        await reader.read()
                        return
                    for i in range(self.chunks):
                        if self.cut and i == self.chunks - 1:
                            writer.close()
                            return
                        piece = f"frame-{i};".encode()
                        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                elif path == "/cookie":  # sets a cookie; answers with the Cookie header it got, if any
                    got = headers.get("cookie", "").encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nset-cookie: session=s1; Path=/\r\n")
                    writer.write(b"content-length: %d\r\n\r\n%s" % (len(got), got))
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the test ended
        finally:
            writer.close()


class Recording(AsyncioBackend):
    """The router's backend, keeping every stream it opened (a test waits on one's protocol)."""

    def __init__(self) -> None:
        self.streams: list[Any] = []

    async def connect_tcp(self, *args: Any, **kw: Any) -> Any:
        stream = await super().connect_tcp(*args, **kw)
        self.streams.append(stream)
        return stream


def client(backend: AsyncioBackend | None = None, connect_timeout: float = 2, **kw: Any) -> httpx.AsyncClient:
    """The router's client as create_app makes it (router/app.py), but for the auth; `backend` in place
    of the one service_transport puts in each pool."""

    def make() -> httpx.AsyncBaseTransport:
        transport = service_transport(httpx.Limits(max_connections=None, max_keepalive_connections=8), True)
        if backend is not None:
            transport._pool._network_backend = backend  # type: ignore[attr-defined]
        return transport

    return httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=connect_timeout),
        transport=SettledTransport(PerServiceTransport(make, **kw)),
    )


@pytest.mark.parametrize("loop", LOOPS)
def test_a_streamed_answer_arrives_whole_and_in_order_and_the_connection_is_reused(loop: str) -> None:
    async def main() -> tuple[list[bytes], bytes, int]:
        async with Server() as srv, client() as c:
            pieces = []
            async with c.stream("GET", srv.url + "/stream") as r:
                async for chunk in r.aiter_raw():
                    pieces.append(chunk)
            echo = await c.post(srv.url + "/echo", content=b"x" * 300_000)  # past the read buffer
            return pieces, echo.content, srv.connections

    pieces, echo, connections = run(loop, main)
    assert b"".join(pieces) == b"".join(f"frame-{i};".encode() for i in range(5))
    assert echo == b"x" * 300_000
    assert connections == 1  # kept alive: the second call went over the first one's connection


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stream_the_server_breaks_off_is_an_http_error(loop: str) -> None:
    """What DecodeStream turns into DecodeLost (a migration): any httpx.HTTPError while reading."""

    async def main() -> list[bytes]:
        got: list[bytes] = []
        async with Server(cut=True) as srv, client() as c:
            with pytest.raises(httpx.HTTPError):
                async with c.stream("GET", srv.url + "/stream") as r:
                    async for chunk in r.aiter_raw():
                        got.append(chunk)
        return got

    assert b"".join(run(loop, main)).startswith(b"frame-0;")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_service_that_is_not_there_is_a_connect_error(loop: str) -> None:
    async def main() -> None:
        async with Server() as srv:
            url = srv.url
        async with client() as c:  # the server is gone: its port refuses
            with pytest.raises(httpx.ConnectError):
                await c.post(url + "/echo", content=b"x")

    run(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_service_that_does_not_accept_is_a_connect_timeout(loop: str) -> None:
    """A listening socket whose accept queue is full (backlog 0, one connection already queued and
    never accepted): Linux drops the next SYN, so the connect hangs until the client's connect timeout."""

    async def main() -> float:
        with socket.socket() as listener, socket.socket() as queued:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            queued.connect(listener.getsockname())  # fills the queue; nobody accepts it
            async with client(connect_timeout=0.3) as c:
                t0 = time.monotonic()
                with pytest.raises(httpx.ConnectTimeout):
                    await c.post(f"http://127.0.0.1:{listener.getsockname()[1]}/echo", content=b"x")
                return time.monotonic() - t0

    assert 0.25 <= run(loop, main) < 5  # given up at the timeout, not at once nor never


@pytest.mark.parametrize("loop", LOOPS)
def test_an_idle_connection_the_server_closed_is_not_used_again(loop: str) -> None:
    """httpcore asks an idle connection whether it is readable (the server closed it) before reusing it:
    answered from what the protocol got, the next call goes over a new connection and succeeds."""

    async def main() -> tuple[bytes, int]:
        backend = Recording()
        async with Server() as srv, client(backend) as c:
            await c.post(srv.url + "/echo", content=b"one")
            srv.close_idle()
            [stream] = backend.streams
            async with asyncio.timeout(10):  # until the client's side has seen the server close it
                while not stream.get_extra_info("is_readable"):
                    await stream._protocol.wait_data()
            r = await c.post(srv.url + "/echo", content=b"two")
            return r.content, srv.connections

    content, connections = run(loop, main)
    assert content == b"two" and connections == 2


def test_each_service_has_its_own_pool_and_an_unused_one_is_closed() -> None:
    now = [0.0]

    async def main() -> tuple[int, int, bytes]:
        async with Server() as a, Server() as b, client(idle_s=30.0, clock=lambda: now[0]) as c:
            outer = c._transport
            assert isinstance(outer, SettledTransport) and isinstance(outer.inner, PerServiceTransport)
            pools = outer.inner
            await c.post(a.url + "/echo", content=b"a")
            await c.post(b.url + "/echo", content=b"b")
            both = pools.services
            now[0] = 20.0
            await c.post(a.url + "/echo", content=b"a")  # a used again; b not since 0
            now[0] = 40.0
            r = await c.post(a.url + "/echo", content=b"a")  # the sweep: b unused for 40 s, at rest
            return both, pools.services, r.content

    both, after, content = asyncio.run(main())
    assert both == 2 and after == 1 and content == b"a"


def test_a_pool_with_a_stream_in_flight_is_not_closed() -> None:
    now = [0.0]

    async def main() -> tuple[int, bytes]:
        async with Server(chunks=3) as a, Server() as b, client(idle_s=30.0, clock=lambda: now[0]) as c:
            pools = c._transport.inner  # type: ignore[attr-defined]
            async with c.stream("GET", a.url + "/stream") as r:
                it = r.aiter_raw()
                first = await anext(it)
                now[0] = 100.0
                await c.post(b.url + "/echo", content=b"b")  # a sweep while a's stream is open
                rest = b"".join([chunk async for chunk in it])
            return pools.services, first + rest

    services, body = asyncio.run(main())
    assert services == 2 and body == b"frame-0;frame-1;frame-2;"


def test_tls_goes_through_start_tls() -> None:
    """internal_ca_file: the services over https. A certificate the client does not trust stops the
    call as it connects (ConnectError: another service may be tried), as httpx's own backend does."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tempfile.mkdtemp()
    crt, key = f"{d}/tls.crt", f"{d}/tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", key, "-out", crt],
        check=True, capture_output=True,
    )  # fmt: skip
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(crt, key)

    async def main() -> bytes:
        srv = Server()
        server = await asyncio.start_server(srv._serve, "127.0.0.1", 0, ssl=server_ctx)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            trusted = ssl.create_default_context(cafile=crt)
            t = service_transport(httpx.Limits(), trusted)
            async with httpx.AsyncClient(transport=t) as c:
                r = await c.post(url + "/echo", content=b"secret")
            async with httpx.AsyncClient(transport=service_transport(httpx.Limits(), True)) as c:
                with pytest.raises(httpx.ConnectError):
                    await c.post(url + "/echo", content=b"secret")
            return r.content
        finally:
            srv.close_idle()
            server.close()

    assert uvloop.run(main()) == b"secret"


def test_the_routers_own_client_uses_both() -> None:
    """The wiring: the client create_app makes for the services (none was given) has a pool per
    service, each on the asyncio backend."""

    async def main() -> None:
        app = create_app(RouterConfig(), None, model_info())
        outer = app.state.server.orch.client._transport
        assert isinstance(outer, SettledTransport) and isinstance(outer.inner, PerServiceTransport)
        async with Server() as srv:
            r = await app.state.server.orch.client.post(srv.url + "/echo", content=b"hi")
            assert r.content == b"hi"
            [(pool, _)] = outer.inner._pools.values()
            assert isinstance(pool._pool._network_backend, AsyncioBackend)  # type: ignore[attr-defined]
        await app.state.server.orch.client.aclose()

    asyncio.run(main())


def test_the_routers_client_keeps_no_cookies() -> None:
    """A service's Set-Cookie is neither kept nor sent on the next call (to it or any other service)."""

    async def main() -> tuple[bytes, int]:
        app = create_app(RouterConfig(), None, model_info())
        c = app.state.server.orch.client
        try:
            async with Server() as srv:
                first = await c.get(srv.url + "/cookie")
                assert first.headers["set-cookie"].startswith("session=")
                second = await c.get(srv.url + "/cookie")
                return second.content, len(c.cookies)
        finally:
            await c.aclose()

    sent, kept = asyncio.run(main())
    assert sent == b"" and kept == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_leaves_no_reference_cycle(stream: bool) -> None:
    """httpx's client ties each response to the stream it wraps around it (a cycle, with the request,
    its headers and httpcore's stream in it, that only the garbage collector frees); the router's
    transport (router/upstream.py SettledTransport) unhooks it once the response is closed."""

    async def main() -> list[str]:
        async with Server() as srv, client() as c:
            await c.post(srv.url + "/echo", content=b"warm")  # the connection and the pool made
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)  # what a pass finds unreachable stays in gc.garbage
            try:
                for _ in range(10):
                    if stream:
                        async with c.stream("GET", srv.url + "/stream") as r:
                            assert b"".join([chunk async for chunk in r.aiter_raw()]).startswith(b"frame-0;")
                    else:
                        r = await c.post(srv.url + "/echo", content=b"x" * 10)
                        assert r.content == b"x" * 10  # the body stays readable after the unhooking
                    del r
                gc.collect()
            finally:
                gc.set_debug(0)
            found = [type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage]
            gc.garbage.clear()
            return [t for t in found if t.startswith(("httpx", "httpcore"))]

    assert asyncio.run(main()) == []


def test_a_decode_stream_closed_early_leaves_no_reference_cycle() -> None:
    """The stream's reader task, cancelled by the close while it waits for data, keeps its
    CancelledError and with it the reader's frames: none of them may hold the DecodeStream."""

    async def main() -> list[str]:
        async with Server(hold=True) as srv, client() as c:
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for _ in range(3):
                    resp = await c.send(c.build_request("GET", srv.url + "/stream"), stream=True)
                    ds = DecodeStream(Worker("decode-0", srv.url), resp, time.time() + 30)
                    await asyncio.sleep(0)  # the reader task starts and waits for a chunk
                    await ds.aclose()
                    del ds, resp
                await asyncio.sleep(0)  # the cancelled tasks finish
                gc.collect()
            finally:
                gc.set_debug(0)
            found = [type(o).__qualname__ for o in gc.garbage]
            gc.garbage.clear()
            return [t for t in found if t in ("DecodeStream", "Response", "Task")]

    assert asyncio.run(main()) == []
