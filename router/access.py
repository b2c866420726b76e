"""Who may call the router, and how much: API keys (router.auth.keys) and their rate limits
(router.auth.ratelimit), as FastAPI dependencies and two calls around each generation.

Auth is on when `require_api_key` is set, when a static keys file is given, or once any key exists in
Redis (checked at start and every second after, so the first `splitserve keys create` turns it on).
With auth off the router serves everyone; it says so at start, and refuses to start on an address
other machines can reach unless `allow_unauthenticated` is set. `allow_unauthenticated` (without
`require_api_key`) is the explicit opt-out: calls without a key are served even once keys exist, and a
key that is sent is still checked.

Scopes: "inference" may generate, tokenize, list models and read its own tenant's request records;
"metrics" may read /metrics; "admin" may do everything, and read any tenant's records.

The key is checked on the request's headers before its body is read (`authenticate`, called by the
app's BodyLimit middleware for every request that may carry a body, then by the route's dependency for
the rest): a caller without a valid key is answered 401 at once, whatever body it announces. Revocations
reach this router's key cache within a second (`KeyStore.follow_revocations`, started here).

/tokenize and /detokenize are charged one request (no tokens) against the key's limits, like a
generation (`admit(..., generation=False)`), but are not counted as the tenant's generations.

Observability (docs/operations.md, "Metrics"): each generation past authentication counts once in
`splitserve_router_tenant_requests_total{tenant,status}` at `admit` (status "accepted" or
"rate_limited"), and its tokens in `splitserve_router_tenant_tokens_total{tenant,kind}` at `release`;
the tenant label is bounded (RouterMetrics.tenant: `metrics_max_tenants` names, then "_other"; "_none"
without a key). Calls refused for their key have no tenant and count in `auth_refused_total` only. Each
refusal adds a span event to the current span: `splitserve.auth_refused` (reason) and
`splitserve.rate_limited` (limit, tenant, key id).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from opentelemetry import trace
from starlette.datastructures import Headers

from common.runtime.logs import current_request_id
from common.runtime.tasks import cancel_and_wait
from common.security.secret import is_loopback
from router.auth.keys import (
    ApiKey,
    InvalidKey,
    KeyStore,
    KeyStoreUnavailable,
    api_key_entry,
    load_keys_file,
)
from router.auth.ratelimit import RateLimiter, retry_after_header
from router.config import RouterConfig
from router.errors import APIError
from router.metrics import TENANT_NONE, RouterMetrics

log = logging.getLogger(__name__)
POLL_S = 1.0
LIMITS_TIMEOUT_S = 1.0  # a rate-limit check that Redis does not answer this soon is skipped (counted)
LOOP_SLACK_S = 0.05  # a deadline's wake-up this late means the loop, not Redis, was busy
T = TypeVar("T")
# request.state: the key the BodyLimit middleware authenticated from the headers (None: anonymous), set
# under AUTHENTICATED so the route's dependency does not check it again
AUTHENTICATED = "authenticated"


async def within(call: Awaitable[T], timeout_s: float) -> T:
    """`call`'s value if Redis answers within `timeout_s` of time the loop was free to read it; else
    TimeoutError (the call is cancelled). A deadline that fires late, because the loop was busy (a long
    step, a pause of the process), does not count that time against Redis: the call gets it back, up to
    4 x `timeout_s` in all. An answer that came in while the loop was busy is read before the deadline is
    looked at (asyncio runs ready I/O before expired timers), so a stall alone never turns an answer into
    a timeout."""
    task = asyncio.ensure_future(call)
    deadline = time.monotonic() + timeout_s
    give_up = deadline + 3 * timeout_s
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - time.monotonic()))
            if done:
                return task.result()
            now = time.monotonic()
            late = now - deadline
            if late <= LOOP_SLACK_S or now >= give_up:
                raise TimeoutError(f"no answer within {timeout_s:g} s")
            deadline = min(give_up, now + late)  # the stall's time back
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


@dataclass
class Admission:
    """A generation let in: its charge against its key's limits (if any) and its tenant's metrics label,
    released exactly once at its end."""

    key: ApiKey | None  # None: no key (auth off, or the allow_unauthenticated opt-out)
    request_id: str
    charged_tokens: int  # charged to the key's limits; 0 with `charged` False
    headers: dict[str, str]  # the x-ratelimit-* headers for the answer
    tenant: str = TENANT_NONE  # the bounded `tenant` label value (RouterMetrics.tenant)
    prompt_tokens: int | None = None  # to split the tokens used into prompt and output
    charged: bool = False  # holds a rate-limit charge (a concurrency slot, tokens) to give back


class Access:
    def __init__(self, config: RouterConfig, redis: Any, prefix: str, metrics: RouterMetrics) -> None:
        self.config, self.metrics = config, metrics
        metrics.tenants.limit = config.metrics_max_tenants
        static = load_keys_file(config.api_keys_file) if config.api_keys_file else []
        if config.api_key is not None:
            static += api_key_entry(config.api_key)
        self.keys = KeyStore(redis, prefix, static)
        self.limiter = RateLimiter(redis, prefix) if redis is not None else None
        if self.limiter is None and any(k.limits.any() for _, k in static):
            raise ValueError("API key limits are kept in Redis: give the router a --redis-url")
        self.enabled = config.require_api_key or bool(static)
        # the explicit opt-out: a call without an Authorization header is served (no tenant, no limits);
        # a key that is sent is still checked, and brings its tenant and limits
        self.anonymous_ok = config.allow_unauthenticated and not config.require_api_key
        self._redis = redis
        self._poll: asyncio.Task[None] | None = None
        self._revocations: asyncio.Task[None] | None = None
        self._refusals_spent: dict[str, float] = {}  # key id -> when (monotonic) its next refusal is back

    async def start(self) -> None:
        """Find out whether keys exist; refuse an open router on a reachable address; follow
        revocations (with Redis)."""
        if not self.enabled and self._redis is not None:
            with contextlib.suppress(KeyStoreUnavailable):
                self.enabled = await self.keys.any_keys()
        if not self.enabled:
            if not is_loopback(self.config.host) and not self.config.allow_unauthenticated:
                raise RuntimeError(
                    f"the router binds {self.config.host}, which other machines can reach, and no API key is "
                    "configured: create one (splitserve keys create), give --api-keys-file or "
                    "--require-api-key, or pass --allow-unauthenticated to serve openly"
                )
            log.warning(
                "no API key configured: the router serves anyone who can reach %s:%d",
                self.config.host, self.config.port,
            )  # fmt: skip
            if self._redis is not None:
                self._poll = asyncio.create_task(self._watch())
        if self._redis is not None:  # cached keys revoked elsewhere are dropped within a second
            self._revocations = asyncio.create_task(self.keys.follow_revocations())

    async def stop(self) -> None:
        for task in (self._poll, self._revocations):
            if task is not None:
                await cancel_and_wait(task)

    async def _watch(self) -> None:
        while not self.enabled:
            await asyncio.sleep(POLL_S)
            try:
                if await self.keys.any_keys():
                    self.enabled = True
                    log.warning("an API key exists now: every call but /health needs one from here on")
            except KeyStoreUnavailable:
                pass

    # ---- authentication --------------------------------------------------------------------------

    async def authenticate(self, headers: Headers) -> ApiKey | None:
        """The caller's key, from its `Authorization` header alone (None while auth is off, or for a call
        without one under the allow_unauthenticated opt-out); APIError 401 for a missing or refused key,
        503 when Redis cannot say. The scope is the route's to check (`require`)."""
        if not self.enabled or (self.anonymous_ok and "authorization" not in headers):
            return None
        try:
            return await self.keys.authenticate(headers.get("authorization"))
        except InvalidKey as e:
            self.metrics.auth_refused.labels(e.reason).inc()
            trace.get_current_span().add_event("splitserve.auth_refused", {"splitserve.reason": e.reason})
            raise APIError(
                401,
                str(e),
                code="invalid_api_key",
                headers={"WWW-Authenticate": 'Bearer realm="splitserve"'},
            ) from None
        except KeyStoreUnavailable as e:
            # what Redis said is the log's (with the request id), never the client's
            log.warning("request %s: cannot check its API key: %s", current_request_id() or "-", e)
            raise APIError(
                503,
                "cannot check API keys now; retry later",
                headers={"Retry-After": str(self.config.retry_after_s)},
                detail=str(e),
            ) from None

    def require(self, scope: str) -> Callable[[Request], Awaitable[ApiKey | None]]:
        """A FastAPI dependency: the caller's key (None while auth is off); 401/403 otherwise. A key the
        BodyLimit middleware already authenticated (request.state) is not checked again."""

        async def dependency(request: Request) -> ApiKey | None:
            state = request.scope.get("state") or {}
            if AUTHENTICATED in state:
                key = state[AUTHENTICATED]
            else:
                key = await self.authenticate(request.headers)
            if key is None:
                return None
            if scope not in key.scopes and "admin" not in key.scopes:
                self.metrics.auth_refused.labels("forbidden").inc()
                trace.get_current_span().add_event(
                    "splitserve.auth_refused",
                    {
                        "splitserve.reason": "forbidden",
                        "splitserve.key_id": key.key_id,
                        "splitserve.scope": scope,
                    },
                )
                raise APIError(
                    403, f"the API key {key.key_id!r} lacks the {scope!r} scope", code="permission_denied"
                )
            request.state.api_key = key
            return key

        return dependency

    @staticmethod
    def may_read(key: ApiKey | None, record_tenant: str | None) -> bool:
        """Whether `key` may see a request record of `record_tenant` (auth off: anyone may)."""
        return key is None or "admin" in key.scopes or key.tenant == (record_tenant or "")

    # ---- limits ----------------------------------------------------------------------------------

    async def admit(
        self,
        key: ApiKey | None,
        request_id: str,
        tokens: int,
        prompt_tokens: int | None = None,
        *,
        generation: bool = True,
    ) -> Admission:
        """Charge one request and `tokens` (prompt + max output) to the key, and hold a concurrency slot;
        429 with Retry-After and the x-ratelimit-* headers when a limit says no. Counted for the key's
        tenant either way; `prompt_tokens` (of `tokens`) lets `release` count prompt and output apart.
        `generation` False (/tokenize, /detokenize): charged alike, not counted as the tenant's
        generation."""
        tenant = self.metrics.tenant(key.tenant if key is not None else None)
        admission = Admission(key, request_id, 0, {}, tenant, prompt_tokens)

        def count(status: str) -> None:
            if generation:
                self.metrics.tenant_requests.labels(tenant, status).inc()

        if key is None or self.limiter is None or not key.limits.any():
            count("accepted")
            return admission
        hold_s = self.config.request_timeout_s + 60  # a router that dies frees its slots this late
        try:
            d = await within(self.limiter.acquire(key, request_id, tokens, hold_s), LIMITS_TIMEOUT_S)
        except Exception as e:
            if key.limits.max_concurrent is not None:
                # fail closed: a key whose requests in flight are capped must not get uncounted ones (each
                # would hold work nobody can release against its cap)
                log.warning("request %s: cannot check the limits of %s: %r", request_id, key.key_id, e)
                raise APIError(
                    503,
                    "cannot check this API key's limits now; retry later",
                    headers={"Retry-After": str(max(1, self.config.retry_after_s))},
                    detail=repr(e),
                ) from None
            # Redis unreachable: serve the request unmetered rather than lock every limited key out for
            # the outage (limits share a budget, they guard no secret); counted and logged, not silent
            self.metrics.limits_unenforced.inc()
            count("accepted")
            log.warning("rate limits of %s not enforced for %s: %r", key.key_id, request_id, e)
            return admission
        if d.allowed:
            count("accepted")
            admission.charged_tokens, admission.headers, admission.charged = tokens, dict(d.headers), True
            return admission
        self.metrics.rate_limited.labels(d.reason).inc()
        count("rate_limited")
        trace.get_current_span().add_event(
            "splitserve.rate_limited",
            {"splitserve.limit": d.reason, "splitserve.tenant": key.tenant, "splitserve.key_id": key.key_id},
        )
        if d.never:  # more tokens than the key may ever use in a minute
            raise APIError(
                429,
                f"this request needs {tokens} tokens (prompt + max_tokens) but the key's limit is "
                f"{key.limits.tpm} tokens per minute: lower max_tokens or shorten the prompt",
                "max_tokens", "rate_limit_exceeded", headers=d.headers,
            )  # fmt: skip
        what = {"requests": "requests per minute", "tokens": "tokens per minute"}.get(
            d.reason, "concurrent requests"
        )
        headers = {**d.headers, "Retry-After": retry_after_header(d.retry_after_s)}
        raise APIError(
            429,
            f"rate limit reached for {what} on API key {key.key_id!r}: retry after "
            f"{d.retry_after_s:.1f} s",
            None, "rate_limit_exceeded", headers=headers,
        )  # fmt: skip

    def check_refusals(self, key: ApiKey | None) -> None:
        """Before a request's parse: 429 while `key` has spent its refusals (`refused`; this router learnt
        it from Redis when charging the last one)."""
        if key is None or not key.limits.any():
            return
        until = self._refusals_spent.get(key.key_id)
        wait = until - time.monotonic() if until is not None else 0.0
        if wait <= 0:
            self._refusals_spent.pop(key.key_id, None)
            return
        self.metrics.rate_limited.labels("refusals").inc()
        trace.get_current_span().add_event(
            "splitserve.rate_limited",
            {
                "splitserve.limit": "refusals",
                "splitserve.tenant": key.tenant,
                "splitserve.key_id": key.key_id,
            },
        )
        raise APIError(
            429,
            f"too many requests of API key {key.key_id!r} were refused (at most "
            f"{self.config.refusals_per_minute} per minute): retry after {wait:.1f} s",
            None, "rate_limit_exceeded", headers={"Retry-After": retry_after_header(wait)},
        )  # fmt: skip

    async def refused(self, key: ApiKey | None, charge_request: bool = True) -> None:
        """A request of `key` was refused (400) after its parse: charged one request (`charge_request`)
        and one of the key's refusals (router/auth/ratelimit.py `refuse`). Keys without limits are not
        charged; a Redis that does not answer is logged."""
        if key is None or self.limiter is None or not key.limits.any():
            return
        try:
            wait = await within(
                self.limiter.refuse(key, self.config.refusals_per_minute, charge_request), LIMITS_TIMEOUT_S
            )
        except Exception as e:
            log.warning("could not charge a refused request of %s: %r", key.key_id, e)
            return
        if wait > 0:
            if len(self._refusals_spent) > 10_000:  # forget the keys whose refusals are back
                now = time.monotonic()
                self._refusals_spent = {k: t for k, t in self._refusals_spent.items() if t > now}
            self._refusals_spent[key.key_id] = time.monotonic() + wait
        else:
            self._refusals_spent.pop(key.key_id, None)

    async def release(self, admission: Admission | None, used_tokens: int) -> None:
        """Count the tokens used (prompt + output) for the tenant; give back the concurrency slot and the
        tokens charged but not used."""
        if admission is None:
            return
        if admission.prompt_tokens is not None:  # else unknown: the split, and so the count, is left out
            prompt = min(admission.prompt_tokens, used_tokens)
            self.metrics.tenant_tokens.labels(admission.tenant, "prompt").inc(prompt)
            self.metrics.tenant_tokens.labels(admission.tenant, "output").inc(used_tokens - prompt)
        if not admission.charged or admission.key is None or self.limiter is None:
            return
        try:
            await within(
                self.limiter.release(
                    admission.key,
                    admission.request_id,
                    admission.charged_tokens,
                    min(used_tokens, admission.charged_tokens),
                ),
                LIMITS_TIMEOUT_S,
            )
        except Exception:  # the slot expires by itself (hold_s); the refund is lost
            log.exception("could not release the rate-limit charge of %s", admission.request_id)
