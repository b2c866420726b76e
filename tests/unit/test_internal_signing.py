"""The internal secret and the signed-call check, without a network: what is accepted, what is refused
and why (the reasons are metric labels), rotation, and the HTTP server's limits on a request's head and
on connections."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from common.runtime.http_server import OVER_LIMIT, HTTPLimits, server_config
from common.security.internal_auth import NONCE, SIGNATURE, TIMESTAMP, ReplayGuard, check, sign_headers
from common.security.secret import InternalSecret, SecretError, is_loopback
from tests.support.cluster import wait_until

A = InternalSecret(b"a" * 32)
B = InternalSecret(b"b" * 32)


def test_a_signed_call_is_accepted_once() -> None:
    h = sign_headers(A, "POST", "/internal/generate", b"body")
    guard = ReplayGuard()
    assert check(A, guard, "POST", "/internal/generate", b"body", h) == ""
    assert check(A, guard, "POST", "/internal/generate", b"body", h) == "replayed"


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"body": b"other"}, "bad_signature"),  # tampered body
        ({"target": "/internal/abort"}, "bad_signature"),  # another path
        ({"method": "PUT"}, "bad_signature"),
        ({"secret": B}, "bad_signature"),  # wrong secret
        ({"drop": SIGNATURE}, "missing"),
        ({"drop": NONCE}, "missing"),
        ({"ts": "yesterday"}, "malformed"),
        ({"age": 31.0}, "stale"),
        ({"age": -31.0}, "stale"),  # from the future
    ],
)
def test_a_call_is_refused_with_its_reason(change, reason) -> None:  # type: ignore[no-untyped-def]
    now = time.time()
    signer = change.get("secret", A)
    h = sign_headers(signer, "POST", "/internal/generate", b"body", now=now - change.get("age", 0.0))
    if "drop" in change:
        del h[change["drop"]]
    if "ts" in change:
        h[TIMESTAMP] = change["ts"]
    got = check(
        A,
        ReplayGuard(),
        change.get("method", "POST"),
        change.get("target", "/internal/generate"),
        change.get("body", b"body"),
        h,
        now=now,
    )
    assert got == reason


def test_rotation_accepts_old_and_new_during_the_window() -> None:
    rotating = InternalSecret.from_env(
        {"SPLITSERVE_INTERNAL_SECRET": "n" * 32, "SPLITSERVE_INTERNAL_SECRET_ACCEPT": "o" * 32}
    )
    old, new, other = InternalSecret(b"o" * 32), InternalSecret(b"n" * 32), InternalSecret(b"x" * 32)
    for signer, ok in ((old, True), (new, True), (other, False)):
        h = sign_headers(signer, "POST", "/internal/abort", b"")
        assert (check(rotating, ReplayGuard(), "POST", "/internal/abort", b"", h) == "") is ok
    assert "o" * 32 not in repr(rotating) and "n" * 32 not in repr(rotating)  # never printed


def test_secret_settings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "secret"
    f.write_text("s" * 24 + "\n")
    assert InternalSecret.from_env({"SPLITSERVE_INTERNAL_SECRET_FILE": str(f)}).current == b"s" * 24
    with pytest.raises(SecretError, match="at least 16 bytes"):
        InternalSecret.from_env({"SPLITSERVE_INTERNAL_SECRET": "short"})
    with pytest.raises(SecretError, match="SECRET_FILE"):
        InternalSecret.from_env({"SPLITSERVE_INTERNAL_SECRET_FILE": str(tmp_path / "missing")})
    with pytest.raises(SecretError, match="SECRET is not"):
        InternalSecret.from_env({"SPLITSERVE_INTERNAL_SECRET_ACCEPT": "o" * 32})
    none = InternalSecret.from_env({})
    none.require_for_bind("127.0.0.1", "x")
    none.require_for_bind("localhost", "x")
    with pytest.raises(SecretError, match="0.0.0.0"):
        none.require_for_bind("0.0.0.0", "the decode service")
    A.require_for_bind("0.0.0.0", "x")
    assert is_loopback("::1") and is_loopback("127.0.0.2") and not is_loopback("10.0.0.1")


def test_the_replay_guard_forgets_what_is_too_old_to_matter() -> None:
    g = ReplayGuard(window_s=1.0)
    assert g.first_use("n", now=100.0) and not g.first_use("n", now=100.5)
    assert g.first_use("n", now=103.0)  # past 2 windows: the timestamp check refuses it anyway
    small = ReplayGuard(max_entries=2)
    for n in "abc":
        assert small.first_use(n, now=0.0)
    assert len(small._seen) <= 2


# ---- the server's limits on a request's head (a real uvicorn on 127.0.0.1) --------------------------


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/ok")
    async def ok(request: Request) -> dict[str, bool]:
        return {"ok": True, "over": bool(request.scope.get(OVER_LIMIT))}

    return app


@contextlib.contextmanager
def _serving(app: FastAPI, limits: HTTPLimits) -> Iterator[uvicorn.Server]:
    """A real uvicorn on 127.0.0.1 with server_config's settings, in a thread (its port:
    `.config.port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(server_config(app, "127.0.0.1", port, limits, log_level="warning"))
    t = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield srv
    finally:
        srv.should_exit = True
        t.join(timeout=10)


@pytest.fixture
def server():  # type: ignore[no-untyped-def]
    with _serving(_app(), HTTPLimits(header_timeout_s=0.5, max_header_bytes=2048, keep_alive_s=1)) as srv:
        yield srv.config.port


def _read_all(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    out = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            return out + b"<still open>"
        if not chunk:
            return out
        out += chunk


def test_a_slow_request_head_is_cut(server) -> None:  # type: ignore[no-untyped-def]
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert _read_all(s, 3.0) == b""  # closed by the server, well before the 3 s
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")  # a prompt client is served
        assert b'{"ok":true' in _read_all(s, 3.0)


def test_an_oversized_request_head_is_refused(server) -> None:  # type: ignore[no-untyped-def]
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"j" * 4096 + b"\r\n\r\n")
        reply = _read_all(s, 3.0)
    assert reply.startswith(b"HTTP/1.1 400") and not reply.endswith(b"<still open>")


def _get_ok(port: int) -> bytes:
    """GET /ok on a connection of its own, closed after the answer."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return _read_all(s, 3.0)


@pytest.mark.parametrize("app_answers", [False, True], ids=["uvicorn-answers", "app-answers"])
def test_the_connection_limit_holds_whoever_answers_it(app_answers: bool) -> None:
    """Over max_connections a request is refused by uvicorn (plain 503), or, for an app that says it
    answers such requests itself (the router), handed to the app marked OVER_LIMIT: never served as
    if under the limit."""
    app = _app()
    app.state.answers_over_limit = app_answers
    with _serving(app, HTTPLimits(keep_alive_s=30, max_connections=2)) as srv:
        port = srv.config.port
        with socket.create_connection(("127.0.0.1", port)) as held:
            held.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")  # answered and kept open
            assert b'"over":false' in _read_all(held, 0.5)
            over = _get_ok(port)  # the second connection: at the limit of two
        if app_answers:
            assert over.startswith(b"HTTP/1.1 200") and b'"over":true' in over, over
        else:
            assert over.startswith(b"HTTP/1.1 503") and b'"ok"' not in over, over
        # the held one closed: under the limit again once the server has seen it go
        wait_until(lambda: not srv.server_state.connections, 5, "the server to let the held connection go")
        assert b'"over":false' in _get_ok(port)
