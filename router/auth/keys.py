"""The router's API keys: who may call it, under which tenant, with which scopes and limits.

A key's secret is shown once, at creation: `sk-ss-<key_id>-<43 urlsafe chars>` (256 random bits). The
public `key_id` ("k_" + 12 hex) is part of the secret, so authenticating one is a single Redis read of

    {prefix}apikey:{key_id}   hash: name, tenant, scopes, limits (JSON), created_at, expires_at,
                              revoked, salt, hash (HMAC-SHA256(salt, secret)); never the secret itself
    {prefix}apikeys           set of every key id (for `list`)
    {prefix}apikeys:any       marker, set on the first create and never unset: auth is on from then on
    {prefix}apikeys:version   counter, raised by every revocation: routers watch it (below)

Small setups without Redis give the router a static keys file instead (`load_keys_file`); only the
SHA-256 of each secret is kept in memory. `KeyStore` serves both.

Successful authentications are cached for `cache_s` (0.5 s by default) per secret, so a busy key costs
Redis one read per cache_s; while Redis cannot be asked, a key verified within `stale_s` is still served.

Revocation wins over both caches:
- a key Redis reports revoked, expired or gone (deleted) is dropped from the cache at once and remembered
  as refused, so a Redis outage or pause right after cannot bring it back (it gets 401, not a pass);
- a router (`follow_revocations`) reads the version counter every REVOCATION_POLL_S and, when it moved,
  reads its cached keys again in one pipeline: a revocation made anywhere reaches every router within a
  second, even if no request for the key came in between and Redis stops answering right after;
- a cache entry is written only if no revocation was learned while its Redis read was in flight (the
  key is read again, up to VERIFY_REREADS times, to find a read that none overtook).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
SCOPES = frozenset({"inference", "metrics", "admin"})
SECRET_PREFIX = "sk-ss-"
_SECRET_RE = re.compile(r"sk-ss-(k_[0-9a-f]{12})-([A-Za-z0-9_-]{43})")
_TOKEN_RE = re.compile(r"[\x21-\x7e]{1,512}")  # printable ASCII, no spaces, bounded (we hash it)
MIN_STATIC_SECRET_CHARS = 20
CACHE_MAX_ENTRIES = 10_000
VERIFY_REREADS = 2  # reads again when a revocation overtook the read (KeyStore.authenticate)
REVOCATION_POLL_S = 0.25  # how often a router reads the revocation counter (follow_revocations)
# Compared against when the key id is unknown, so an unknown id costs the same work as a wrong secret
_DUMMY_SALT = secrets.token_hex(16)
_DUMMY_HASH = hmac.new(_DUMMY_SALT.encode(), b"dummy", hashlib.sha256).hexdigest()

# KEYS: the key's hash, the id index, the marker. ARGV: key id, then field/value pairs. 0 if the id exists.
_CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], '1')
return 1
"""


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute (prompt + max output charged up front, refunded to actual)
    max_concurrent: int | None = None  # requests (streams included) in flight at once
    # latency targets for the key's requests that name none (router/slo.py): not limits, defaults
    ttft_slo_ms: int | None = None
    tpot_slo_ms: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrent", "ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def any(self) -> bool:
        return self.rpm is not None or self.tpm is not None or self.max_concurrent is not None

    def to_dict(self) -> dict[str, int]:
        return {
            k: v
            for k, v in (
                ("rpm", self.rpm),
                ("tpm", self.tpm),
                ("max_concurrent", self.max_concurrent),
                ("ttft_slo_ms", self.ttft_slo_ms),
                ("tpot_slo_ms", self.tpot_slo_ms),
            )  # fmt: skip
            if v
        }


@dataclass(frozen=True)
class ApiKey:
    key_id: str  # public id, e.g. "k_" + 12 hex (Redis keys) or "file-" + 8 hex (static keys)
    name: str
    tenant: str
    # "inference": the /v1 generation endpoints and its own tenant's records; "metrics": /metrics;
    # "admin": everything, any tenant's records
    scopes: frozenset[str]
    limits: Limits
    created_at: float
    expires_at: float | None = None
    revoked: bool = False
    source: str = "redis"  # or "file"

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (time.time() if now is None else now)

    @property
    def status(self) -> str:
        return "revoked" if self.revoked else "expired" if self.expired() else "active"


class InvalidKey(Exception):
    """The request's credentials are refused (401). str(e) is safe to show the caller."""

    MESSAGES = {
        "missing": "Missing API key: send 'Authorization: Bearer <key>'.",
        "malformed": "Malformed Authorization header: expected 'Bearer <key>'.",
        "unknown": "Incorrect API key provided.",
        "revoked": "This API key has been revoked.",
        "expired": "This API key has expired.",
    }

    def __init__(self, reason: str) -> None:
        super().__init__(self.MESSAGES[reason])
        self.reason = reason


class KeyStoreUnavailable(Exception):
    """Redis, where the keys live, could not be asked (the router answers 503, not 401)."""


def _validate(name: str, tenant: str, scopes: Iterable[str]) -> frozenset[str]:
    if not name or not name.strip():
        raise ValueError("a key needs a non-empty name")
    if not tenant or not tenant.strip():
        raise ValueError("a key needs a non-empty tenant")
    chosen = frozenset(scopes)
    if not chosen or not chosen <= SCOPES:
        raise ValueError(f"scopes must be a non-empty subset of {sorted(SCOPES)}, got {sorted(chosen)}")
    return chosen


def _secret_hash(salt: str, secret: str) -> str:
    # HMAC-SHA256 keyed with a random per-key salt. A slow KDF (bcrypt, scrypt, argon2) exists to make
    # guessing a low-entropy password expensive; these secrets carry 256 random bits, beyond any
    # guessing, and a slow KDF would only add its cost to every request the router serves.
    return hmac.new(salt.encode(), secret.encode(), hashlib.sha256).hexdigest()


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _bearer_token(authorization: str | None) -> str:
    """The token of `Bearer <token>`; InvalidKey("missing"/"malformed") otherwise."""
    if authorization is None or not authorization.strip():
        raise InvalidKey("missing")
    parts = authorization.split()
    if len(parts) != 2 or parts[0].lower() != "bearer" or not _TOKEN_RE.fullmatch(parts[1]):
        raise InvalidKey("malformed")
    return parts[1]


class KeyStore:
    """API keys in Redis (created, listed and revoked here) plus static keys from a file.

    `static` holds (sha256 hex of the secret, key) pairs, as `load_keys_file` returns them. `redis` may
    be None: then only static keys exist, and create/revoke raise KeyStoreUnavailable.
    """

    def __init__(
        self,
        redis: aioredis.Redis | None,
        prefix: str = "splitserve:",
        static: Sequence[tuple[str, ApiKey]] = (),
        cache_s: float = 0.5,
        stale_s: float = 300.0,
        redis_timeout_s: float = 1.0,
    ) -> None:
        self.redis, self.prefix, self.cache_s = redis, prefix, cache_s
        # Redis unreachable: a key verified from Redis within stale_s is still accepted (expiry checked),
        # so an outage does not lock every client out; a revocation made during it waits for Redis.
        self.stale_s, self.redis_timeout_s = stale_s, redis_timeout_s
        self.served_stale = 0  # authentications answered from `_verified` while Redis was unreachable
        # sha256(secret) -> (key, monotonic time it was last verified against Redis): successful
        # authentications only. Younger than cache_s it answers without Redis; younger than stale_s it
        # answers when Redis cannot.
        self._verified: dict[str, tuple[ApiKey, float]] = {}
        # sha256(secret) -> "revoked" | "expired" | "unknown": keys Redis said are refused, after they had
        # been verified (or, revoked and expired ones, after their secret matched); never served from a
        # cache again, and answered 401 while Redis cannot be asked. Oldest dropped past CACHE_MAX_ENTRIES.
        self._refused: dict[str, str] = {}
        self._learned = 0  # raised whenever a refusal is learned: a Redis read older than it is not cached
        self._static = list(static)
        self._static_by_id = {key.key_id: key for _, key in self._static}
        self._create_script = redis.register_script(_CREATE_LUA) if redis is not None else None

    def _key(self, key_id: str) -> str:
        return f"{self.prefix}apikey:{key_id}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}apikeys"

    @property
    def _marker(self) -> str:
        return f"{self.prefix}apikeys:any"

    @property
    def _version(self) -> str:
        return f"{self.prefix}apikeys:version"

    def _client(self) -> aioredis.Redis:
        if self.redis is None:
            raise KeyStoreUnavailable("no Redis configured: only the static keys file's keys exist")
        return self.redis

    async def create(
        self,
        name: str,
        tenant: str = "default",
        *,
        scopes: Iterable[str] = ("inference",),
        limits: Limits = Limits(),  # noqa: B008 - frozen, so sharing the default is safe
        expires_at: float | None = None,
    ) -> tuple[str, ApiKey]:
        """A new key; returns its secret (the only time it exists outside the caller) and the key."""
        chosen = _validate(name, tenant, scopes)
        self._client()  # KeyStoreUnavailable without Redis
        assert self._create_script is not None
        key_id = "k_" + secrets.token_hex(6)
        secret = f"{SECRET_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
        salt = secrets.token_hex(16)
        key = ApiKey(key_id, name, tenant, chosen, limits, time.time(), expires_at)
        mapping = {
            "name": name,
            "tenant": tenant,
            "scopes": ",".join(sorted(chosen)),
            "limits": json.dumps(limits.to_dict()),
            "created_at": repr(key.created_at),
            "expires_at": "" if expires_at is None else repr(float(expires_at)),
            "revoked": "0",
            "salt": salt,
            "hash": _secret_hash(salt, secret),
        }
        args = [key_id, *(x for pair in mapping.items() for x in pair)]
        try:
            created = await self._create_script(
                keys=[self._key(key_id), self._index, self._marker], args=args
            )
        except (RedisError, OSError) as e:
            raise KeyStoreUnavailable(f"Redis: {e}") from e
        if not created:  # 48 random bits collided with an existing id: astronomically unlikely
            raise RuntimeError(f"key id {key_id} already exists; try again")
        return secret, key

    async def list(self) -> list[ApiKey]:
        """Every key (static ones first, then Redis by creation time); never secrets nor hashes."""
        keys = [key for _, key in self._static]
        if self.redis is None:
            return keys
        try:
            ids = sorted(cast(set[str], await self.redis.smembers(self._index)))
            async with self.redis.pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hgetall(self._key(key_id))
                rows = await pipe.execute()
        except (RedisError, OSError) as e:
            raise KeyStoreUnavailable(f"Redis: {e}") from e
        stored = [self._from_hash(key_id, row) for key_id, row in zip(ids, rows, strict=True) if row]
        return keys + sorted(stored, key=lambda k: (k.created_at, k.key_id))

    async def get(self, key_id: str) -> ApiKey | None:
        if key_id in self._static_by_id:
            return self._static_by_id[key_id]
        if self.redis is None:
            return None
        row = await self._fetch(key_id)
        return self._from_hash(key_id, row) if row else None

    async def revoke(self, key_id: str) -> bool:
        """Mark a Redis key revoked (it stays listed); False if there is no such key. Static keys are
        revoked by deleting their line from the keys file (ValueError here)."""
        if key_id in self._static_by_id:
            raise ValueError(f"{key_id} is a static key: remove its line from the keys file instead")
        client = self._client()
        try:
            exists = await client.exists(self._key(key_id))
            if exists:
                await client.hset(self._key(key_id), "revoked", "1")
                await client.incr(self._version)  # every router re-reads its cached keys (module doc)
        except (RedisError, OSError) as e:
            raise KeyStoreUnavailable(f"Redis: {e}") from e
        self._forget(key_id, "revoked")
        return bool(exists)

    async def any_keys(self) -> bool:
        """True once any key was created in Redis (even if revoked since) or static keys exist."""
        if self._static:
            return True
        if self.redis is None:
            return False
        try:
            return bool(await self.redis.exists(self._marker))
        except (RedisError, OSError) as e:
            raise KeyStoreUnavailable(f"Redis: {e}") from e

    async def authenticate(self, authorization: str | None) -> ApiKey:
        """The key named by an `Authorization` header value. InvalidKey (401) when refused,
        KeyStoreUnavailable (503) when Redis cannot be asked."""
        token = _bearer_token(authorization)
        digest = _sha256(token)
        now = time.monotonic()
        hit = self._verified.get(digest)
        if hit is not None and now - hit[1] < self.cache_s:
            return self._admit(hit[0])
        static = None
        for stored_digest, candidate in self._static:  # all compared, no early exit
            if hmac.compare_digest(stored_digest, digest):
                static = candidate
        if static is not None:
            return self._admit(static)
        match = _SECRET_RE.fullmatch(token)
        if match is None:
            raise InvalidKey("malformed" if token.startswith(SECRET_PREFIX) else "unknown")
        key_id = match.group(1)
        learned = self._learned
        key, fresh = await self._verify(key_id, token, digest, hit, now)
        for _ in range(VERIFY_REREADS):
            if not fresh or self._learned == learned:
                break
            # a revocation was learned while the read was in flight, which it may predate: read again (a
            # router's first revocation poll counts as one, so a key first seen then would go uncached)
            learned = self._learned
            try:
                key, fresh = await self._verify(key_id, token, digest, hit, now)
            except KeyStoreUnavailable:
                return key  # Redis answered a moment ago: served, not cached
        if fresh and self._learned == learned:
            if len(self._verified) >= CACHE_MAX_ENTRIES:
                keep_s = max(self.cache_s, self.stale_s)
                self._verified = {d: e for d, e in self._verified.items() if now - e[1] <= keep_s}
                if len(self._verified) >= CACHE_MAX_ENTRIES:
                    self._verified.clear()
            self._verified[digest] = (key, now)
        return key

    async def _verify(
        self, key_id: str, token: str, digest: str, hit: tuple[ApiKey, float] | None, now: float
    ) -> tuple[ApiKey, bool]:
        """`token`'s key as Redis has it now, and True (InvalidKey when refused); while Redis cannot be
        asked, the key verified within stale_s, and False (KeyStoreUnavailable without one, or for a key
        refused before)."""
        try:
            row = await self._fetch(key_id) if self.redis is not None else {}
        except KeyStoreUnavailable:
            refused = self._refused.get(digest)
            if refused is not None:  # Redis said so before it went away: revocation wins
                raise InvalidKey(refused) from None
            if hit is None or now - hit[1] > self.stale_s:
                raise
            self.served_stale += 1
            return self._admit(hit[0]), False
        if not row or "hash" not in row or "salt" not in row:
            hmac.compare_digest(_secret_hash(_DUMMY_SALT, token), _DUMMY_HASH)  # same work as a miss
            if hit is not None:  # a key verified before, gone from Redis now (deleted)
                self._refuse(digest, "unknown")
            raise InvalidKey("unknown")
        if not hmac.compare_digest(_secret_hash(row["salt"], token), row["hash"]):
            if hit is not None:
                self._refuse(digest, "unknown")
            raise InvalidKey("unknown")
        key = self._from_hash(key_id, row)
        if key.status != "active":  # the secret matched: remember the refusal, drop any cached copy
            self._refuse(digest, key.status)
            raise InvalidKey(key.status)
        self._refused.pop(digest, None)
        return key, True

    def _refuse(self, digest: str, reason: str) -> None:
        """Redis refused this secret's key: out of the cache, and remembered (module doc)."""
        news = self._verified.pop(digest, None) is not None or self._refused.pop(digest, None) != reason
        while len(self._refused) >= CACHE_MAX_ENTRIES:
            self._refused.pop(next(iter(self._refused)))
        self._refused[digest] = reason
        if news:  # not for a refused key tried again: that would keep other keys' reads from the cache
            self._learned += 1

    def _forget(self, key_id: str, reason: str) -> None:
        """Every cached secret of `key_id` refused for `reason`."""
        for digest in [d for d, (k, _) in self._verified.items() if k.key_id == key_id]:
            self._refuse(digest, reason)
        self._learned += 1

    async def follow_revocations(self, poll_s: float = REVOCATION_POLL_S) -> None:
        """Until cancelled: read the revocation counter every `poll_s`; when it moved (or on the first
        read), read every cached Redis key again and drop those revoked, expired or deleted. Redis
        errors are retried at the next poll (a revocation made during an outage lands when it ends)."""
        seen: str | None | object = object()  # nothing read yet
        while True:
            await asyncio.sleep(poll_s)
            if not self._verified:  # nothing cached to drop: Redis is not asked (the next one rechecks)
                seen = object()
                continue
            try:
                async with asyncio.timeout(self.redis_timeout_s):
                    version = await self._client().get(self._version)
                if version != seen:
                    self._learned += 1  # a read in flight may predate the revocation: not cached
                    await self.recheck_cached()
                    seen = version
            except (RedisError, OSError, TimeoutError, KeyStoreUnavailable) as e:
                log.debug("revocation check failed (retried): %r", e)

    async def recheck_cached(self) -> None:
        """Read every cached Redis key again (one pipeline); drop those Redis refuses now."""
        ids = sorted({k.key_id for k, _ in self._verified.values() if k.source == "redis"})
        if not ids:
            return
        async with asyncio.timeout(self.redis_timeout_s):
            async with self._client().pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hgetall(self._key(key_id))
                rows = await pipe.execute()
        for key_id, row in zip(ids, rows, strict=True):
            if not row or "hash" not in row:
                self._forget(key_id, "unknown")
                continue
            try:
                status = self._from_hash(key_id, row).status
            except (ValueError, TypeError):
                continue  # a row this version cannot read: left to the next authentication
            if status != "active":
                self._forget(key_id, status)

    @staticmethod
    def _admit(key: ApiKey) -> ApiKey:
        if key.revoked:
            raise InvalidKey("revoked")
        if key.expired():
            raise InvalidKey("expired")
        return key

    async def _fetch(self, key_id: str) -> dict[str, str]:
        try:
            async with asyncio.timeout(self.redis_timeout_s):  # redis-py's own retries take far longer
                return cast(dict[str, str], await self._client().hgetall(self._key(key_id)))
        except (RedisError, OSError, TimeoutError) as e:
            raise KeyStoreUnavailable(f"Redis: {e!r}") from e

    @staticmethod
    def _from_hash(key_id: str, row: dict[str, str]) -> ApiKey:
        limits: dict[str, Any] = json.loads(row.get("limits") or "{}")
        expires = row.get("expires_at") or ""
        return ApiKey(
            key_id=key_id,
            name=row.get("name", ""),
            tenant=row.get("tenant", "default"),
            scopes=frozenset(s for s in row.get("scopes", "").split(",") if s),
            limits=Limits(**limits),
            created_at=float(row.get("created_at") or 0.0),
            expires_at=float(expires) if expires else None,
            revoked=row.get("revoked") == "1",
            source="redis",
        )


# ---- the static keys file ----

_INT_OPTIONS = ("rpm", "tpm", "max_concurrent", "ttft_slo_ms", "tpot_slo_ms")
_OPTIONS = ("name", "tenant", "scopes", "expires", *_INT_OPTIONS)


def parse_expiry(text: str) -> float:
    """An ISO-8601 date or date-time as a Unix time; a time without an offset is UTC."""
    when = dt.datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def parse_keys_line(line: str, lineno: int = 0) -> tuple[str, ApiKey] | None:
    """One line of a keys file as (sha256 hex of the secret, key); None for a blank or comment line.
    ValueError naming the line for anything else that is not a key."""
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    where = f"line {lineno}" if lineno else "keys line"
    secret, *words = text.split()
    options = []
    for word in words:
        if word.startswith("#"):  # a comment after the key
            break
        options.append(word)
    if len(secret) < MIN_STATIC_SECRET_CHARS:
        raise ValueError(f"{where}: the secret must be at least {MIN_STATIC_SECRET_CHARS} characters")
    if not _TOKEN_RE.fullmatch(secret):
        raise ValueError(f"{where}: the secret must be printable ASCII, at most 512 characters")
    values: dict[str, str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep:  # not echoed: it may be part of a secret split by a space
            raise ValueError(f"{where}: unknown option (a word without '='); expected one of {_OPTIONS}")
        if name not in _OPTIONS:
            raise ValueError(f"{where}: unknown option {name!r}; expected one of {_OPTIONS}")
        if name in values:
            raise ValueError(f"{where}: {name} given twice")
        if not value:
            raise ValueError(f"{where}: {name} needs a value")
        values[name] = value
    ints: dict[str, int] = {}
    for name in _INT_OPTIONS:
        if name in values:
            if not values[name].isdigit() or int(values[name]) < 1:
                raise ValueError(f"{where}: {name} must be a positive integer, got {values[name]!r}")
            ints[name] = int(values[name])
    expires_at = None
    if "expires" in values:
        try:
            expires_at = parse_expiry(values["expires"])
        except ValueError:
            raise ValueError(f"{where}: expires must be an ISO-8601 date or date-time") from None
    digest = _sha256(secret)
    key_id = "file-" + digest[:8]
    try:
        scopes = _validate(
            values.get("name", key_id),
            values.get("tenant", "default"),
            values.get("scopes", "inference").split(","),
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    key = ApiKey(
        key_id=key_id,
        name=values.get("name", key_id),
        tenant=values.get("tenant", "default"),
        scopes=scopes,
        limits=Limits(**ints),
        created_at=0.0,
        expires_at=expires_at,
        source="file",
    )
    return digest, key


def parse_keys_text(text: str, origin: str = "keys file") -> list[tuple[str, ApiKey]]:
    keys: list[tuple[str, ApiKey]] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        try:
            entry = parse_keys_line(line, lineno)
        except ValueError as e:
            raise ValueError(f"{origin}: {e}") from None
        if entry is None:
            continue
        if entry[0] in seen:
            raise ValueError(f"{origin}: line {lineno}: the same secret as line {seen[entry[0]]}")
        seen[entry[0]] = lineno
        keys.append(entry)
    return keys


def load_keys_file(path: str) -> list[tuple[str, ApiKey]]:
    """The static keys file (SPLITSERVE_ROUTER_API_KEYS_FILE) as (sha256 hex of the secret, key) pairs.

    One key per line; blank lines and `#` comments (whole lines, or after a key's options) are ignored:

        <secret> [name=<n>] [tenant=<t>] [scopes=inference,admin] [rpm=<n>] [tpm=<n>]
                 [max_concurrent=<n>] [ttft_slo_ms=<n>] [tpot_slo_ms=<n>]
                 [expires=<ISO-8601 date or date-time>]

    An expiry without a UTC offset is UTC; a date alone means its start (00:00 UTC).

    A secret is any printable string of 20+ characters without spaces; its key id is "file-" and the
    first 8 hex digits of its SHA-256. Only that digest is kept (plain SHA-256: a file key's secret is the
    operator's to make long and random; it is never written anywhere by us). ValueError with the line
    number for a line that is not a key.
    """
    with open(path, encoding="utf-8") as f:
        return parse_keys_text(f.read(), origin=path)


def api_key_entry(secret: str) -> list[tuple[str, ApiKey]]:
    """`--api-key` (SPLITSERVE_ROUTER_API_KEY): one static key with every scope, as vLLM's flag gives.
    ValueError that never repeats the secret when it is not 20+ printable characters without spaces."""
    if len(secret) < 20 or not _TOKEN_RE.fullmatch(secret):
        raise ValueError("--api-key must be 20 to 512 printable ASCII characters without spaces")
    return parse_keys_text(f"{secret} name=api-key scopes={','.join(sorted(SCOPES))}", origin="--api-key")


__all__ = [
    "SCOPES",
    "api_key_entry",
    "ApiKey",
    "InvalidKey",
    "KeyStore",
    "KeyStoreUnavailable",
    "Limits",
    "load_keys_file",
    "parse_expiry",
    "parse_keys_text",
]
