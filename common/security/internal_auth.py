"""Signed internal HTTP calls: the router proves the cluster secret on every call to a prefill or decode
service, and the services refuse any /internal/ call without a valid proof.

The proof is an HMAC (common.security.secret) over

    "splitserve-http-v1", METHOD, path?query, sha256(body), timestamp, nonce

sent as three headers. A service accepts a call when the HMAC matches under an accepted secret, the
timestamp is within WINDOW_S of its own clock, and the nonce was not seen inside that window (so a
captured call cannot be replayed, even with the same body). A refused call gets 401 before the handler
runs: nothing is read past the body, nothing reserved, nothing aborted.

With no secret configured on a service (loopback only, see InternalSecret.require_for_bind) it checks
nothing; with one, it checks every /internal/ path. /health and /metrics stay open (probes and
scrapers; the NetworkPolicy decides who reaches them).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping

import httpx
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.security.secret import InternalSecret

log = logging.getLogger(__name__)

TIMESTAMP = "x-splitserve-timestamp"
NONCE = "x-splitserve-nonce"
SIGNATURE = "x-splitserve-signature"
WINDOW_S = 30.0  # clocks of one cluster agree far better than this (NTP); a call is fresh this long
PROTECTED_PREFIX = "/internal/"
_VERSION = "splitserve-http-v1"


def sign_headers(
    secret: InternalSecret, method: str, target: str, body: bytes, now: float | None = None
) -> dict[str, str]:
    """The three headers proving `secret` for one call (`target` = path with its query string)."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    digest = hashlib.sha256(body).hexdigest()
    sig = secret.sign(_VERSION, method.upper(), target, digest, ts, nonce)
    return {TIMESTAMP: ts, NONCE: nonce, SIGNATURE: sig}


class ReplayGuard:
    """Nonces seen in the last WINDOW_S seconds (older calls fail the timestamp check anyway)."""

    def __init__(self, window_s: float = WINDOW_S, max_entries: int = 1_000_000) -> None:
        self.window_s, self.max_entries = window_s, max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> expiry, in arrival order

    def first_use(self, nonce: str, now: float) -> bool:
        """True the first time a nonce is offered within the window; False for a replay."""
        while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) >= self.max_entries):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = now + 2 * self.window_s  # covers a timestamp up to WINDOW_S in the future
        return True


def check(
    secret: InternalSecret,
    guard: ReplayGuard,
    method: str,
    target: str,
    body: bytes,
    headers: Mapping[str, str],
    now: float | None = None,
) -> str:
    """Why this call is refused ("" when it is accepted). Reasons are metric labels."""
    now = time.time() if now is None else now
    ts, nonce, sig = headers.get(TIMESTAMP), headers.get(NONCE), headers.get(SIGNATURE)
    if not (ts and nonce and sig):
        return "missing"
    try:
        age = now - float(ts)
    except ValueError:
        return "malformed"
    if abs(age) > guard.window_s:
        return "stale"
    digest = hashlib.sha256(body).hexdigest()
    if not secret.verify(sig, _VERSION, method.upper(), target, digest, ts, nonce):
        return "bad_signature"
    if not guard.first_use(nonce, now):
        return "replayed"
    return ""


class SignedCalls(httpx.Auth):
    """httpx auth that signs every request with the cluster secret (the router's client to services)."""

    requires_request_body = True

    def __init__(self, secret: InternalSecret) -> None:
        self.secret = secret

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if self.secret.configured:
            target = request.url.raw_path.decode("ascii")
            request.headers.update(sign_headers(self.secret, request.method, target, request.content))
        yield request


class InternalAuthMiddleware:
    """ASGI middleware: every /internal/ call must carry a valid proof (see module doc), else 401.

    The body is read here (bounded by `max_body`; larger is 413 before reading it) to check its digest,
    then handed to the app unchanged. `on_refused(reason)` counts refusals."""

    def __init__(
        self,
        app: ASGIApp,
        secret: InternalSecret,
        max_body: int,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.app, self.secret, self.max_body = app, secret, max_body
        self.guard = ReplayGuard()
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self.secret.configured
            or not scope["path"].startswith(PROTECTED_PREFIX)
        ):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            await self._refuse(
                scope, receive, send, 413, "too_large", f"body exceeds the {self.max_body}-byte limit"
            )
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await self._refuse(
                    scope, receive, send, 413, "too_large", f"body exceeds the {self.max_body}-byte limit"
                )
                return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        why = check(self.secret, self.guard, scope["method"], target.decode("latin-1"), bytes(body), headers)
        if why:
            client = scope.get("client")
            log.warning("refused %s %s from %s: %s", scope["method"], scope["path"], client, why)
            await self._refuse(scope, receive, send, 401, why, f"internal call not authenticated ({why})")
            return

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, reason: str, message: str
    ) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)
        body = {"error": {"message": message, "code": status}}  # the services' error shape
        await JSONResponse(body, status_code=status)(scope, receive, send)
