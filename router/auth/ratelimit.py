"""Per-key rate limits (requests per minute, tokens per minute, requests in flight), shared by every
router on one Redis.

Design: one token bucket per limit. A bucket holds at most the per-minute limit (so a key may burst its
whole minute's budget at once) and refills continuously at limit/60 per second; a request passes when
the requests bucket holds 1 and the tokens bucket holds the request's tokens. Buckets rather than a
sliding window: O(1) state (a level and a timestamp) instead of one entry per request of the last
minute, an exact time until a refused request would pass (its Retry-After), and no cliff at a window's
edge. Concurrency is a sorted set of the key's in-flight request ids scored by when their hold expires:
an entry leaves at release, or by itself once its hold is over, so a router that dies mid-request
cannot leak slots forever.

Every check and charge is one call of ratelimit.lua (EVALSHA, reloaded by redis-py on NOSCRIPT), which
reads Redis' own clock (TIME): routers on one Redis share one budget whatever their clocks say, and
concurrent requests cannot both take the last unit of anything. A refused request is charged nothing.

Tokens are charged up front (prompt + max output) and the difference refunded at release. A request is
tracked in flight whenever its key has a tpm or max_concurrent limit; release refunds only if the entry
was still there, so a doubled release refunds once, and one after the hold expired refunds nothing.

A request refused after its parse (a 400: too long, a bad guide) has cost the router its parse, so it is
charged too (`refuse`): one request, and one of a small bucket of refusals of its own (the router's
`refusals_per_minute`); while that is empty the key's requests are refused before any parsing.

A request asking for more tokens than the tpm limit itself can never pass: Decision(allowed=False,
reason="tokens", retry_after_s=-1.0), `never` True. The router should answer
it 429 without Retry-After, with a message saying the request is larger than the key's tokens-per-minute
limit (as OpenAI does for "Request too large"), since retrying cannot help; lowering max_tokens can.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from importlib import resources

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.auth.keys import ApiKey, KeyStoreUnavailable

log = logging.getLogger(__name__)
_LUA = resources.files("router.auth").joinpath("ratelimit.lua").read_text(encoding="utf-8")


class RateLimiterUnavailable(KeyStoreUnavailable):
    """Redis could not be asked for a limited key's budget (the router answers 503)."""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_s: float  # 0 when allowed; -1.0 when the request can never pass (see the module doc)
    reason: str  # "" or "requests" | "tokens" | "concurrency": the limit that refused (the longest wait)
    # x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the limits the key has (Retry-After is
    # the caller's to add on a refusal: retry_after_header(retry_after_s))
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def never(self) -> bool:
        """Refused for good: the request is larger than the key's tokens-per-minute limit."""
        return not self.allowed and self.retry_after_s < 0


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's x-ratelimit-reset-* headers write it: "20ms", "1s", "1.5s", "6m0s",
    "1h2m3s". Rounded up to the millisecond, so a reset is never announced early."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return f"{out}{secs}s"


def retry_after_header(seconds: float) -> str:
    """The Retry-After value for a wait: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds - 1e-9)))


class RateLimiter:
    def __init__(self, redis: aioredis.Redis, prefix: str = "splitserve:") -> None:
        self.redis, self.prefix = redis, prefix
        self._script = redis.register_script(_LUA)

    def _keys(self, key: ApiKey) -> list[str]:
        # the {hash tag} keeps both keys of one API key in one slot, should this ever run on a Cluster
        base = f"{self.prefix}ratelimit:{{{key.key_id}}}"
        return [f"{base}:buckets", f"{base}:inflight"]

    async def acquire(self, key: ApiKey, request_id: str, tokens: int, hold_s: float) -> Decision:
        """Check and charge one request of `tokens` tokens, in flight for at most `hold_s` seconds.

        A key without limits never touches Redis. RateLimiterUnavailable when Redis cannot be asked.
        """
        limits = key.limits
        if not limits.any():
            return Decision(True, 0.0, "", {})  # a fresh headers dict: callers may add to it
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if hold_s <= 0:
            raise ValueError(f"hold_s must be > 0, got {hold_s}")
        args: list[str | int] = [
            "acquire",
            limits.rpm or 0,
            limits.tpm or 0,
            limits.max_concurrent or 0,
            int(tokens),
            max(1, math.ceil(hold_s * 1000)),
            request_id,
        ]
        try:
            raw = await self._script(keys=self._keys(key), args=args)
        except (RedisError, OSError) as e:
            raise RateLimiterUnavailable(f"Redis: {e}") from e
        allowed, reason, wait_ms, r_left, r_reset_ms, t_left, t_reset_ms = raw
        headers: dict[str, str] = {}
        if limits.rpm:
            headers["x-ratelimit-limit-requests"] = str(limits.rpm)
            headers["x-ratelimit-remaining-requests"] = str(max(0, math.floor(float(r_left) + 1e-9)))
            headers["x-ratelimit-reset-requests"] = format_reset(float(r_reset_ms) / 1000)
        if limits.tpm:
            headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(float(t_left) + 1e-9)))
            headers["x-ratelimit-reset-tokens"] = format_reset(float(t_reset_ms) / 1000)
        if int(allowed):
            return Decision(True, 0.0, "", headers)
        wait_s = float(wait_ms) / 1000 if float(wait_ms) >= 0 else -1.0
        return Decision(False, wait_s, str(reason), headers)

    async def refuse(self, key: ApiKey, per_minute: int, charge_request: bool) -> float:
        """A request of `key` refused after its parse: charged one request (`charge_request`; never below
        empty) and one refusal of `per_minute`. Seconds until the key may have another refusal (0: it may
        now). RateLimiterUnavailable when Redis cannot be asked."""
        rpm = key.limits.rpm if charge_request and key.limits.rpm else 0
        try:
            _, wait_ms = await self._script(keys=self._keys(key), args=["refuse", rpm, per_minute])
        except (RedisError, OSError) as e:
            raise RateLimiterUnavailable(f"Redis: {e}") from e
        return float(wait_ms) / 1000

    async def release(self, key: ApiKey, request_id: str, charged_tokens: int, used_tokens: int) -> None:
        """The request is over: free its in-flight entry and refund charged - used tokens (never above the
        bucket's capacity). A Redis error is logged, not raised: the entry expires at its hold anyway."""
        limits = key.limits
        if limits.tpm is None and limits.max_concurrent is None:
            return
        refund = max(0, int(charged_tokens) - int(used_tokens))
        try:
            await self._script(keys=self._keys(key), args=["release", limits.tpm or 0, refund, request_id])
        except (RedisError, OSError) as e:
            log.warning("rate limit release for key %s, request %s failed: %s", key.key_id, request_id, e)


__all__ = ["Decision", "RateLimiter", "RateLimiterUnavailable", "format_reset", "retry_after_header"]
