"""Signed internal HTTP calls: the router proves the cluster secret on every call to a prefill or decode
service, and the services refuse any /internal/ call without a valid proof.

The proof is an HMAC (common.security.secret) over

    "splitserve-http-v2", audience, METHOD, path?query, sha256(body), timestamp, nonce

sent as four headers. The audience names the one process the call is for: its worker id and
incarnation (common.security.identity). A service accepts a call when it is the audience, the HMAC
matches under an accepted secret, the timestamp is within WINDOW_S of its own clock, and the nonce was
not seen inside that window. So a captured call cannot be replayed, even with the same body: not at the
same process (its nonce store), not at another (another audience), not at a restart of the same worker
inside the window (a new incarnation, a fresh nonce store, and another audience). A refused call gets
401 before the handler runs: nothing is read past the body, nothing reserved, nothing aborted.

The caller learns the audience from the service itself: `SignedCalls` reads the signed identity
statement at the service's /health once per address (and again when a call is refused as
`wrong_audience`: the service there restarted), and signs for it only if the statement verifies and
names that address.

With no secret configured on a service (loopback only, see InternalSecret.require_for_bind) it checks
nothing; with one, it checks every /internal/ path. /health and /metrics stay open (probes and
scrapers; the NetworkPolicy decides who reaches them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Generator, Mapping

import httpx
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.security.identity import WorkerIdentity, origin
from common.security.secret import InternalSecret

log = logging.getLogger(__name__)

TIMESTAMP = "x-splitserve-timestamp"
NONCE = "x-splitserve-nonce"
SIGNATURE = "x-splitserve-signature"
AUDIENCE = "x-splitserve-audience"  # the process the call is for: "<worker id>#<incarnation>"
REFUSED = "x-splitserve-refused"  # on a 401: the reason (a metric label, see `check`)
WINDOW_S = 30.0  # clocks of one cluster agree far better than this (NTP); a call is fresh this long
PROTECTED_PREFIX = "/internal/"
_VERSION = "splitserve-http-v2"
PROBE_TIMEOUT_S = 5.0  # reading a service's /health to learn its identity
_MAX_KNOWN = 4096  # addresses whose identity a SignedCalls remembers


def sign_headers(
    secret: InternalSecret,
    method: str,
    target: str,
    body: bytes,
    now: float | None = None,
    audience: str = "",
) -> dict[str, str]:
    """The headers proving `secret` for one call (`target` = path with its query string) to the process
    `audience` names (common.security.identity.audience; a service refuses any other)."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    digest = hashlib.sha256(body).hexdigest()
    sig = secret.sign(_VERSION, audience, method.upper(), target, digest, ts, nonce)
    return {TIMESTAMP: ts, NONCE: nonce, SIGNATURE: sig, AUDIENCE: audience}


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
    audience: str = "",
) -> str:
    """Why this call is refused ("" when it is accepted) by the process `audience` names. Reasons are
    metric labels."""
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
    named = headers.get(AUDIENCE, "")
    if not secret.verify(sig, _VERSION, named, method.upper(), target, digest, ts, nonce):
        return "bad_signature"
    if named != audience:  # a genuine call, for another process (or for an earlier start of this one)
        return "wrong_audience"
    if not guard.first_use(nonce, now):
        return "replayed"
    return ""


class UnknownService(httpx.ConnectError):
    """The service at an address did not prove who it is (no identity statement at its /health, one
    that does not verify under the secret, or one naming another address): no call is signed for it.
    A ConnectError, so a caller treats it as an unreachable service (tries another one)."""


class SignedCalls(httpx.Auth):
    """httpx auth that signs every request with the cluster secret for the process at its address (the
    router's client to the services; the tests' too).

    The audience comes from the service's signed identity at its /health, read on the first call to an
    address and remembered; a call refused as `wrong_audience` (the process there restarted) reads it
    again and, if it changed, is signed for the new process and sent once more. Only /internal/ calls
    are signed (nothing else is checked); without a configured secret none is (loopback development:
    the services check nothing either)."""

    requires_request_body = True

    def __init__(self, secret: InternalSecret) -> None:
        self.secret = secret
        self._audiences: dict[str, str] = {}  # origin -> the audience last proven there

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.read()
        flow = self._flow(request)
        sent = next(flow)
        while True:
            response = yield sent
            if sent is not request:  # an identity probe: its body is what the flow reads
                response.read()
            try:
                sent = flow.send(response)
            except StopIteration:
                return

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        await request.aread()
        flow = self._flow(request)
        sent = next(flow)
        while True:
            response = yield sent
            if sent is not request:
                await response.aread()
            try:
                sent = flow.send(response)
            except StopIteration:
                return

    def _flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if not self.secret.configured or not request.url.path.startswith(PROTECTED_PREFIX):
            yield request  # only /internal/ calls are checked: nothing else is signed
            return
        where = origin(str(request.url))
        audience = self._audiences.get(where)
        if audience is None:
            audience = yield from self._discover(request, where)
        self._sign(request, audience)
        response = yield request
        if response.status_code == 401 and response.headers.get(REFUSED) == "wrong_audience":
            fresh = yield from self._discover(request, where)
            if fresh != audience:  # another process answers there now: the call is for it
                self._sign(request, fresh)
                yield request

    def _sign(self, request: httpx.Request, audience: str) -> None:
        target = request.url.raw_path.decode("ascii")
        headers = sign_headers(self.secret, request.method, target, request.content, audience=audience)
        request.headers.update(headers)

    def _discover(self, request: httpx.Request, where: str) -> Generator[httpx.Request, httpx.Response, str]:
        """Who answers at `where`: the audience of the verified identity at its /health (remembered)."""
        timeout = dict(request.extensions.get("timeout") or {})
        for k in ("read", "write", "pool"):
            timeout[k] = min(timeout.get(k) or PROBE_TIMEOUT_S, PROBE_TIMEOUT_S)
        timeout["connect"] = timeout.get("connect") or PROBE_TIMEOUT_S
        health = request.url.copy_with(raw_path=b"/health")
        probe = httpx.Request("GET", health, extensions={"timeout": timeout})
        response = yield probe
        try:
            ident, sig = WorkerIdentity.from_json(json.loads(response.content).get("identity"))
        except (ValueError, AttributeError) as e:
            raise UnknownService(f"{where} publishes no service identity ({e})", request=request) from None
        if not ident.verify(self.secret, sig):
            raise UnknownService(
                f"{where}: its identity ({ident.id}) is not signed with the internal secret", request=request
            )
        if origin(ident.url) != where:
            raise UnknownService(
                f"{where} presents the identity of {ident.id} at {ident.url}; a service is called at "
                "the URL it registers (--advertise-host)",
                request=request,
            )
        if len(self._audiences) >= _MAX_KNOWN:
            self._audiences.clear()
        self._audiences[where] = ident.audience
        return ident.audience


class InternalAuthMiddleware:
    """ASGI middleware: every /internal/ call must carry a valid proof (see module doc), else 401.

    The body is read here (bounded by `max_body`; larger is 413 before reading it) to check its digest,
    then handed to the app unchanged. `audience` is this process (common.security.identity.audience):
    a call signed for any other is refused. `on_refused(reason)` counts refusals."""

    def __init__(
        self,
        app: ASGIApp,
        secret: InternalSecret,
        max_body: int,
        on_refused: Callable[[str], None] | None = None,
        audience: str = "",
    ) -> None:
        self.app, self.secret, self.max_body, self.audience = app, secret, max_body, audience
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
        why = check(
            self.secret, self.guard, scope["method"], target.decode("latin-1"), bytes(body), headers,
            audience=self.audience,
        )  # fmt: skip
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
        await JSONResponse(body, status_code=status, headers={REFUSED: reason})(scope, receive, send)
