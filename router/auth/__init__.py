"""The router's API keys (router.auth.keys) and per-key rate limits (router.auth.ratelimit)."""

from router.auth.keys import ApiKey, InvalidKey, KeyStore, KeyStoreUnavailable, Limits, load_keys_file
from router.auth.ratelimit import Decision, RateLimiter, RateLimiterUnavailable, format_reset

__all__ = [
    "ApiKey",
    "Decision",
    "InvalidKey",
    "KeyStore",
    "KeyStoreUnavailable",
    "Limits",
    "RateLimiter",
    "RateLimiterUnavailable",
    "format_reset",
    "load_keys_file",
]
