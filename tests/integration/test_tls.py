"""TLS where users expect it, with real processes and a certificate made here by openssl: the router
serves HTTPS, the services serve their internal API over HTTPS (the router verifies them with a CA file),
and a `rediss://` URL with a password reaches a real Redis through a TLS endpoint (the role stunnel or a
managed Redis plays: the bundled redis-server is built without TLS)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from common.cluster.redis_server import RedisServer
from common.cluster.state import ClusterState
from tests.support.cluster import Cluster, free_port, wait_until

pytestmark = [
    pytest.mark.services,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


def make_cert(d: Path, cn: str, names: str) -> tuple[str, str]:
    """A self-signed certificate (its own CA) for `names` (subjectAltName), and its key, in `d`."""
    crt, key = str(d / "tls.crt"), str(d / "tls.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={cn}",
         "-addext", f"subjectAltName={names}", "-keyout", key, "-out", crt],
        check=True, capture_output=True,
    )  # fmt: skip
    return crt, key


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    return make_cert(tmp_path_factory.mktemp("tls"), "localhost", "IP:127.0.0.1,DNS:localhost")


def test_https_from_the_client_to_the_router_to_the_services(cert, tmp_path) -> None:  # type: ignore[no-untyped-def]
    crt, key = cert
    tls = ("--ssl-certfile", crt, "--ssl-keyfile", key)
    c = Cluster(None, str(tmp_path))
    try:
        decode_ = c.start("decode", "--threads", "1", "--kv-cache-mb", "64", *tls)
        assert decode_.url.startswith("https://")
        router = c.start("router", "--decode-urls", decode_.url, "--internal-ca-file", crt, *tls)
        body = {"model": "default", "prompt": "Hi", "max_tokens": 3, "temperature": 0}
        r = httpx.post(
            router.url + "/v1/completions",
            json=body,
            verify=ssl.create_default_context(cafile=crt),
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served on the TLS port
            httpx.post(router.url.replace("https:", "http:") + "/v1/completions", json=body, timeout=10)
        with pytest.raises(httpx.ConnectError):  # and a client that does not trust the certificate stops
            httpx.get(router.url + "/health", timeout=10)
        # a router that cannot verify the services' certificate does not send them anything (the same
        # decode service, which just served the trusting router)
        untrusting = c.start("router", "--decode-urls", decode_.url)
        r = httpx.post(untrusting.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code in (502, 503), r.text
    finally:
        c.stop()


@contextlib.contextmanager
def tls_endpoint(crt: str, key: str, target_port: int) -> Iterator[int]:
    """A TLS listener on 127.0.0.1 forwarding bytes to 127.0.0.1:target_port."""
    port = free_port()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(crt, key)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(pipe(cr, sw), pipe(sr, cw))

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, ssl=ctx)
        started.set()
        async with server:
            await server.serve_forever()

    def run() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(main())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait(10)
    try:
        yield port
    finally:
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        t.join(timeout=5)


def test_a_rediss_url_with_a_password(cert, tmp_path) -> None:  # type: ignore[no-untyped-def]
    crt, key = cert
    server = RedisServer(port=free_port()).start()
    try:
        redis.Redis(port=server.port).config_set("requirepass", "s3cret-pass")
        with tls_endpoint(crt, key, server.port) as port:
            url = f"rediss://:s3cret-pass@127.0.0.1:{port}/0?ssl_ca_certs={crt}"

            async def main() -> str:
                state = ClusterState.from_url(url, "tls-test:")
                try:
                    await state.records.create("r1", model="m")
                    return str((await state.records.get("r1"))["model"])
                finally:
                    await state.close()

            assert asyncio.run(main()) == "m"
            # a service process registers itself over the same URL
            c = Cluster(url, str(tmp_path))
            try:
                d = c.start("decode", "--threads", "1", "--kv-cache-mb", "64", "--worker-id", "tls-decode")
                deadline = time.monotonic() + 10
                plain = redis.Redis(port=server.port, password="s3cret-pass", decode_responses=True)
                while not [k for k in plain.scan_iter("splitserve:*") if "tls-decode" in k]:
                    assert time.monotonic() < deadline, "the decode service did not register over rediss://"
                    time.sleep(0.2)
                assert d.popen.poll() is None
            finally:
                c.stop()
            wrong = url.replace("s3cret-pass", "wrong")
            with pytest.raises(redis.AuthenticationError):
                redis.Redis.from_url(wrong).ping()
    finally:
        server.stop()


def test_the_planner_reads_an_https_router_registered_at_an_address_its_certificate_does_not_name(
    tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A router pod registers its IP, which no certificate names: the planner's read fails the host
    name check by default (it holds), and with --no-router-tls-check-hostname checks the chain to
    SSL_CERT_FILE's CA alone and reads it."""
    from common.cluster.owners import live_router_urls
    from planner.signals import SignalReader

    (tmp_path / "tls").mkdir()
    crt, key = make_cert(tmp_path / "tls", "router", "DNS:router.example.internal")
    redis_ = RedisServer(port=free_port()).start()
    c = Cluster(redis_.url, str(tmp_path))
    try:
        router = c.start("router", "--ssl-certfile", crt, "--ssl-keyfile", key, timeout_s=60)
        assert router.url.startswith("https://127.0.0.1:")
        monkeypatch.setenv("SSL_CERT_FILE", crt)  # the release's CA, as the chart mounts it

        async def listed() -> dict[str, str]:
            state = ClusterState.from_url(redis_.url)
            try:
                return await live_router_urls(state.redis, state.prefix)
            finally:
                await state.close()

        # the router's heartbeat registers it at its start: wait for that, then read once each way
        wait_until(lambda: asyncio.run(listed()) != {}, 10, "the router registered")

        async def read(check_hostname: bool) -> bool:
            reader = SignalReader(redis_.url, None, discover=True, check_hostname=check_hostname)
            try:
                s = await reader.read()
                return s is not None and s.routers == 1
            finally:
                await reader.close()

        assert asyncio.run(read(check_hostname=False))
        assert not asyncio.run(read(check_hostname=True))
    finally:
        c.stop()
        redis_.stop()
