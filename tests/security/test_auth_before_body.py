"""The key before the body (issue 31, "Security round 2"), against a real Redis and a real router process:
a caller without a valid key that announces a large body and sends none gets its 401 at once (it waited
30 s for a 408), a key's holder still gets its body read; connections are capped by default; /tokenize
and /detokenize are charged to the key's limits like a generation."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from common.cluster.state import connect
from router.auth.keys import KeyStore, Limits
from tests.support.cluster import Cluster, Proc, free_port

pytestmark = pytest.mark.services
ANNOUNCED = 8_000_000  # under the 8 MiB body limit: only the missing key can refuse it early


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path_factory.mktemp("logs")))
    try:
        router = c.start("router", "--require-api-key", "--decode-urls", f"http://127.0.0.1:{free_port()}")
        yield redis.url, router
    finally:
        c.stop()
        redis.stop()


def create_key(redis_url: str, name: str, **kw) -> str:  # type: ignore[no-untyped-def]
    async def main() -> str:
        r = connect(redis_url)
        try:
            return (await KeyStore(r).create(name, **kw))[0]
        finally:
            await r.aclose()

    return asyncio.run(main())


def open_request(router: Proc, path: str, length: int, authorization: str | None) -> socket.socket:
    """A POST's head announcing `length` bytes of body, on a raw connection; no body sent."""
    host, port = router.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {length}\r\n"
    if authorization is not None:
        head += f"Authorization: {authorization}\r\n"
    s.sendall((head + "\r\n").encode())
    return s


def read_answer(s: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """What the server sent within timeout_s, and whether it then closed the connection."""
    s.settimeout(timeout_s)
    data, closed = b"", False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            closed = True
            break
        data += chunk
    return data, closed


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer sk-ss-k_000000000000-" + "x" * 43, "Bearer not-a-key", "Basic abc"],
    ids=["none", "unknown", "malformed", "basic"],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/nowhere"])
def test_no_valid_key_is_refused_before_the_body(stack, path: str, authorization: str | None) -> None:  # type: ignore[no-untyped-def]
    _, router = stack
    t0 = time.monotonic()
    with open_request(router, path, ANNOUNCED, authorization) as s:
        data, closed = read_answer(s, 5.0)
    took = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 401 "), data[:200]
    assert took < 2.5, f"answered after {took:.1f} s"  # not the 30 s body timeout
    assert b"invalid_api_key" in data and b"www-authenticate: bearer" in data.lower()
    assert closed  # the announced body is not waited for


def test_a_key_holder_still_gets_its_body_read(stack) -> None:  # type: ignore[no-untyped-def]
    redis_url, router = stack
    key = create_key(redis_url, "body-later")
    body = b'{"prompt": "Hello there"}'
    with open_request(router, "/tokenize", len(body), f"Bearer {key}") as s:
        early, _ = read_answer(s, 0.5)
        assert early == b""  # the key is good: the router waits for the body
        s.sendall(body)
        data, _ = read_answer(s, 5.0)
    assert data.startswith(b"HTTP/1.1 200 "), data[:300]
    assert b'"count"' in data


def test_connections_are_capped_by_default(stack) -> None:  # type: ignore[no-untyped-def]
    """No --max-connections given: the router's default cap (1024) answers 503 beyond it, as every other
    503 of the router is answered (an OpenAI-style body, Retry-After, a request id), closes that
    connection and counts it as shed."""
    redis_url, router = stack
    ops = {"Authorization": f"Bearer {create_key(redis_url, 'ops-metrics', scopes=('metrics',))}"}
    host, port = router.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(1024)]
    try:  # (idle ones are closed after the 10 s head timeout: ask well within it)
        deadline = time.monotonic() + 5.0
        while (refused := httpx.get(router.url + "/health", timeout=10)).status_code != 503:
            if time.monotonic() > deadline:  # every one accepted by now: there is no cap
                break
            time.sleep(0.2)
    finally:
        for s in idle:
            s.close()
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert "limit of open connections" in error["message"] and error["type"], error
    assert refused.headers["retry-after"] == "1" and refused.headers["x-request-id"]
    assert refused.headers["connection"] == "close"
    deadline = time.monotonic() + 10
    while (ok := httpx.get(router.url + "/health", timeout=10)).status_code != 200:
        assert time.monotonic() < deadline, ok.text
        time.sleep(0.2)
    text = httpx.get(router.url + "/metrics", headers=ops, timeout=10).text
    shed = [
        line
        for line in text.splitlines()
        if line.startswith('splitserve_router_shed_total{reason="connections"}')
    ]
    assert shed and float(shed[0].rsplit(" ", 1)[1]) >= 1, shed


def test_tokenize_and_detokenize_are_charged_to_the_keys_limits(stack) -> None:  # type: ignore[no-untyped-def]
    redis_url, router = stack
    key = create_key(redis_url, "tokenizer", limits=Limits(rpm=2))
    auth = {"Authorization": f"Bearer {key}"}
    first = httpx.post(router.url + "/tokenize", json={"prompt": "Hi"}, headers=auth)
    assert first.status_code == 200, first.text
    second = httpx.post(router.url + "/detokenize", json={"tokens": first.json()["tokens"]}, headers=auth)
    third = httpx.post(router.url + "/tokenize", json={"prompt": "Hi"}, headers=auth)
    assert (second.status_code, third.status_code) == (200, 429), third.text
    assert third.json()["error"]["code"] == "rate_limit_exceeded" and int(third.headers["retry-after"]) >= 1
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    # a bad body is charged too (it reached parsing): the budget is spent, so it is refused first
    assert httpx.post(router.url + "/detokenize", content=b"{", headers=auth).status_code == 429
