"""Error bodies leak nothing (issue 31, "Security round 2"), against real router processes: what an API
client reads names no worker id, host or port, no exception repr, and never reflects a service's own
error body; the router's log has all of it, with the request id the client got (x-request-id).

The decode services are (a) a closed port and (b) a small HTTP server run here that answers every internal
call with 500 and "LEAK-CANARY", or a generate stream that ends in an ErrorFrame saying "LEAK-CANARY". It
is a service gone wrong, not an impostor: it holds the cluster secret, and its /health states who it is
as a real service's does (where this tree has signed service identities), so the router does call it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from common.protocol import ErrorFrame, GenerateRequest, Reserved, TokenFrame, decode, frame
from common.security.secret import InternalSecret
from tests.support.cluster import INTERNAL_SECRET, Cluster, Proc, free_port, wait_until

pytestmark = pytest.mark.services
CANARY = "LEAK-CANARY"
INTERNALS = (CANARY, "127.0.0.1", "localhost", "http://", "ConnectError", "connection attempts", "Error(")


class Canary(BaseHTTPRequestHandler):
    """A decode service gone wrong: mode "500" answers every call 500 with CANARY as its body; mode
    "frame" opens the generate stream (Reserved, one token) and ends it with an ErrorFrame of CANARY."""

    mode = "500"

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/health":
            self._send(200, "application/json", json.dumps(health(self.server.server_address[1])).encode())
            return
        if self.mode == "frame" and self.path == "/internal/generate":
            rid = decode(body, GenerateRequest).request_id
            frames = frame(Reserved(rid, [], 0, 0, "", "canary"))
            frames += frame(TokenFrame(rid, [42], 0))
            frames += frame(ErrorFrame(rid, f"{CANARY} at /srv/decode on 10.1.2.3", 500))
            self._send(200, "application/msgpack", frames)
            return
        self._send(500, "text/plain", CANARY.encode())

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


def health(port: int) -> dict[str, Any]:
    """A decode service's /health: with its signed identity where the tree has them."""
    try:
        from common.security.identity import WorkerIdentity
    except ImportError:
        return {"status": "ok"}
    url = f"http://127.0.0.1:{port}"
    ident = WorkerIdentity("canary-decode", "decode", url, "127.0.0.1:1", "canary-1", {})
    return {"status": "ok", "identity": ident.to_json(InternalSecret(INTERNAL_SECRET.encode()))}


@pytest.fixture(scope="module")
def canary() -> Iterator[tuple[ThreadingHTTPServer, type[Canary]]]:
    handler = type("CanaryHandler", (Canary,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def routers(canary, tmp_path_factory) -> Iterator[tuple[Proc, Proc, int, int]]:  # type: ignore[no-untyped-def]
    """Two routers without Redis (auth off, on loopback): one whose decode service is a closed port, one
    whose decode service is the canary."""
    server, _ = canary
    closed, canary_port = free_port(), server.server_address[1]
    c = Cluster(None, str(tmp_path_factory.mktemp("logs")))
    try:
        to_closed = c.start("router", "--decode-urls", f"http://127.0.0.1:{closed}")
        to_canary = c.start("router", "--decode-urls", f"http://127.0.0.1:{canary_port}")
        yield to_closed, to_canary, closed, canary_port
    finally:
        c.stop()


def complete(router: Proc, stream: bool = False) -> httpx.Response:
    body = {"model": "default", "prompt": "Hi", "max_tokens": 4, "stream": stream}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=60)


def assert_clean(r: httpx.Response, *ports: int) -> None:
    for leak in (*INTERNALS, *(str(p) for p in ports)):
        assert leak not in r.text, (leak, r.status_code, r.text)


def logged(router: Proc, request_id: str, *needles: str) -> None:
    def found() -> bool:
        with open(router.log_path, errors="replace") as f:
            return any(request_id in line and all(n in line for n in needles) for line in f)

    wait_until(found, 5.0, f"{needles} with {request_id} in the router's log")


def test_an_unreachable_decode_service_is_not_named(routers) -> None:  # type: ignore[no-untyped-def]
    to_closed, _, closed, _ = routers
    for stream in (False, True):
        r = complete(to_closed, stream)
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert r.json()["error"]["message"] and r.json()["error"]["type"] == "service_unavailable"
        assert_clean(r, closed)
        logged(to_closed, r.headers["x-request-id"], "ConnectError", str(closed))


def test_a_decode_services_error_body_is_not_reflected(routers, canary) -> None:  # type: ignore[no-untyped-def]
    _, to_canary, _, port = routers
    _, handler = canary
    handler.mode = "500"
    for stream in (False, True):
        r = complete(to_canary, stream)
        assert r.status_code == 502, r.text
        assert_clean(r, port)
        logged(to_canary, r.headers["x-request-id"], CANARY, str(port))


def test_a_decode_services_error_frame_is_not_reflected(routers, canary) -> None:  # type: ignore[no-untyped-def]
    _, to_canary, _, port = routers
    _, handler = canary
    handler.mode = "frame"
    try:
        r = complete(to_canary)  # before the answer started: an error status
        assert r.status_code == 502, r.text
        assert_clean(r, port)
        logged(to_canary, r.headers["x-request-id"], CANARY)
        s = complete(to_canary, stream=True)  # after the first token: an error event in the stream
        assert s.status_code == 200
        events = [json.loads(x[6:]) for x in s.text.splitlines() if x.startswith("data: {")]
        assert any("error" in e for e in events), s.text
        assert_clean(s, port)
        assert "10.1.2.3" not in s.text and "/srv/decode" not in s.text
        logged(to_canary, s.headers["x-request-id"], CANARY)
    finally:
        handler.mode = "500"
