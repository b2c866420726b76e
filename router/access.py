"""Who may call the router, and how much: API keys (router.auth.keys) and their rate limits
(router.auth.ratelimit), as FastAPI dependencies and two calls around each generation.

Auth is on when `require_api_key` is set, when a static keys file is given, or once any key exists in
Redis (checked at start and every second after, so the first `splitserve keys create` turns it on).
With auth off the router serves everyone; it says so at start, and refuses to start on an address
other machines can reach unless `allow_unauthenticated` is set. `allow_unauthenticated` (without
`require_api_key`) is the explicit opt-out: calls without a key are served even once keys exist, and a
key that is sent is still checked.

Scopes: "inference" may generate, list models and read its own tenant's request records; "metrics" may
read /metrics; "admin" may do everything, and read any tenant's records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from common.security.secret import is_loopback
from router.auth.keys import ApiKey, InvalidKey, KeyStore, KeyStoreUnavailable, load_keys_file
from router.auth.ratelimit import RateLimiter, retry_after_header
from router.config import RouterConfig
from router.errors import APIError
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)
POLL_S = 1.0
LIMITS_TIMEOUT_S = 1.0  # a rate-limit check that Redis does not answer this soon is skipped (counted)


@dataclass
class Admission:
    """A generation's charge against its key's limits, released exactly once at its end."""

    key: ApiKey
    request_id: str
    charged_tokens: int
    headers: dict[str, str]


class Access:
    def __init__(self, config: RouterConfig, redis: Any, prefix: str, metrics: RouterMetrics) -> None:
        self.config, self.metrics = config, metrics
        static = load_keys_file(config.api_keys_file) if config.api_keys_file else []
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

    async def start(self) -> None:
        """Find out whether keys exist; refuse an open router on a reachable address."""
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

    async def stop(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll

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

    def require(self, scope: str) -> Callable[[Request], Awaitable[ApiKey | None]]:
        """A FastAPI dependency: the caller's key (None while auth is off); 401/403 otherwise."""

        async def dependency(request: Request) -> ApiKey | None:
            if not self.enabled or (self.anonymous_ok and "authorization" not in request.headers):
                return None
            try:
                key = await self.keys.authenticate(request.headers.get("authorization"))
            except InvalidKey as e:
                self.metrics.auth_refused.labels(e.reason).inc()
                raise APIError(
                    401,
                    str(e),
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="splitserve"'},
                ) from None
            except KeyStoreUnavailable as e:
                raise APIError(
                    503,
                    f"cannot check API keys now: {e}",
                    headers={"Retry-After": str(self.config.retry_after_s)},
                ) from None
            if scope not in key.scopes and "admin" not in key.scopes:
                self.metrics.auth_refused.labels("forbidden").inc()
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

    async def admit(self, key: ApiKey | None, request_id: str, tokens: int) -> Admission | None:
        """Charge one request and `tokens` (prompt + max output) to the key, and hold a concurrency slot;
        429 with Retry-After and the x-ratelimit-* headers when a limit says no."""
        if key is None or self.limiter is None or not key.limits.any():
            return None
        hold_s = self.config.request_timeout_s + 60  # a router that dies frees its slots this late
        try:
            async with asyncio.timeout(LIMITS_TIMEOUT_S):
                d = await self.limiter.acquire(key, request_id, tokens, hold_s)
        except Exception as e:
            # Redis unreachable: serve the request unmetered rather than lock every limited key out for
            # the outage (limits share a budget, they guard no secret); counted and logged, not silent
            self.metrics.limits_unenforced.inc()
            log.warning("rate limits of %s not enforced for %s: %r", key.key_id, request_id, e)
            return None
        if d.allowed:
            return Admission(key, request_id, tokens, dict(d.headers))
        self.metrics.rate_limited.labels(d.reason).inc()
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

    async def release(self, admission: Admission | None, used_tokens: int) -> None:
        """Give back the concurrency slot and the tokens charged but not used."""
        if admission is None or self.limiter is None:
            return
        try:
            async with asyncio.timeout(LIMITS_TIMEOUT_S):
                await self.limiter.release(
                    admission.key,
                    admission.request_id,
                    admission.charged_tokens,
                    min(used_tokens, admission.charged_tokens),
                )
        except Exception:  # the slot expires by itself (hold_s); the refund is lost
            log.exception("could not release the rate-limit charge of %s", admission.request_id)
