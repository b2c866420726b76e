"""The router's API keys (router.auth.keys), per-key rate limits (router.auth.ratelimit) and the
`splitserve keys` CLI against a real Redis server (the session's `redis_url`).

Like tests/integration/test_state.py, each test runs its body with asyncio.run under its own uuid key
prefix, so tests never see each other's keys.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from common.cluster.state import connect
from router.auth.keys import ApiKey, InvalidKey, KeyStore, KeyStoreUnavailable, Limits, parse_keys_text
from router.auth.ratelimit import RateLimiter, RateLimiterUnavailable, retry_after_header
from splitserve.cli import main as cli_main

SECRET_RE = re.compile(r"sk-ss-k_[0-9a-f]{12}-[A-Za-z0-9_-]{43}")
RESET_RE = re.compile(r"^(\d+ms|(\d+h)?(\d+m)?\d+(\.\d+)?s)$")
Body = Callable[[aioredis.Redis, str], Awaitable[Any]]


def run(redis_url: str, body: Body) -> Any:
    async def main() -> Any:
        client = connect(redis_url)
        prefix = f"t-{uuid.uuid4().hex}:"
        try:
            return await body(client, prefix)
        finally:
            keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()

    return asyncio.run(main())


def limited(rpm: int | None = None, tpm: int | None = None, max_concurrent: int | None = None) -> ApiKey:
    return ApiKey(
        key_id=f"k_{uuid.uuid4().hex[:12]}",
        name="t",
        tenant="default",
        scopes=frozenset({"inference"}),
        limits=Limits(rpm=rpm, tpm=tpm, max_concurrent=max_concurrent),
        created_at=time.time(),
    )


async def refused(store: KeyStore, header: str | None) -> str:
    with pytest.raises(InvalidKey) as info:
        await store.authenticate(header)
    return info.value.reason


# ---- keys ----


def test_create_then_authenticate_and_every_refusal(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        store = KeyStore(client, prefix=prefix)
        assert not await store.any_keys()
        limits = Limits(rpm=10, tpm=1000, max_concurrent=2)
        secret, key = await store.create("ci", "acme", scopes=("inference", "admin"), limits=limits)
        assert SECRET_RE.fullmatch(secret) and key.key_id in secret
        assert (key.name, key.tenant, key.scopes, key.limits) == (
            "ci",
            "acme",
            {"inference", "admin"},
            limits,
        )
        assert await store.any_keys()

        got = await store.authenticate(f"Bearer {secret}")
        assert got == key and got.source == "redis" and not got.revoked and got.expires_at is None
        assert await store.authenticate(f"bearer   {secret}  ") == key  # scheme case, spaces
        assert await store.get(key.key_id) == key and await store.get("k_000000000000") is None

        fresh = KeyStore(client, prefix=prefix)  # no cache: each refusal comes from Redis
        wrong = secret[:-1] + ("A" if secret[-1] != "A" else "B")
        assert await refused(fresh, f"Bearer {wrong}") == "unknown"
        assert await refused(fresh, None) == "missing"
        assert await refused(fresh, "") == "missing"
        for header in ("Basic dXNlcjpwYXNz", "Bearer", secret, f"Bearer {secret} extra", "Bearer sk-ss-nope"):
            assert await refused(fresh, header) == "malformed", header
        unknown = f"sk-ss-k_{'0' * 12}-" + secret[-43:]
        assert await refused(fresh, f"Bearer {unknown}") == "unknown"
        assert await refused(fresh, "Bearer some-other-token-of-a-different-shape") == "unknown"

        e = InvalidKey("unknown")
        assert secret not in str(e) and "Incorrect API key" in str(e)

        old, _ = await store.create("old", expires_at=time.time() - 1)
        assert await refused(fresh, f"Bearer {old}") == "expired"
        assert await store.revoke(key.key_id) and not await store.revoke("k_000000000000")
        assert await refused(fresh, f"Bearer {secret}") == "revoked"
        assert await refused(store, f"Bearer {secret}") == "revoked"  # revoke drops the local cache
        assert await store.any_keys()  # revoking never turns auth off again

        listed = {k.key_id: k for k in await store.list()}
        assert len(listed) == 2
        assert listed[key.key_id].revoked and listed[key.key_id].status == "revoked"

    run(redis_url, body)


def test_redis_holds_no_clear_secret(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        store = KeyStore(client, prefix=prefix)
        limits = Limits(rpm=5, tpm=100, max_concurrent=2)
        created = [await store.create(f"k{i}", limits=limits) for i in range(3)]
        secrets = [secret for secret, _ in created]
        await store.revoke(created[0][1].key_id)
        for _, key in created:  # the limiter's state too
            assert (await RateLimiter(client, prefix=prefix).acquire(key, "r", 10, 30.0)).allowed
        values: list[Any] = []
        async for name in client.scan_iter(match=f"{prefix}*"):
            values.append(name)
            kind = await client.type(name)
            if kind == "hash":
                values += [x for pair in (await client.hgetall(name)).items() for x in pair]
            elif kind == "set":
                values += list(await client.smembers(name))
            elif kind == "string":
                values.append(await client.get(name))
            elif kind == "zset":
                values += await client.zrange(name, 0, -1)
            else:
                raise AssertionError(f"unexpected {kind!r} at {name!r}")
        assert len(values) > 30 and all(isinstance(v, str) for v in values)
        for secret in secrets:
            random_part = secret[-43:]
            assert not any(secret in v or random_part in v for v in values)
        for key in await store.list():
            assert not any(s in repr(key) for s in secrets)

    run(redis_url, body)


def test_revocation_and_expiry_take_effect_within_the_cache_time(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        router_a = KeyStore(client, prefix=prefix, cache_s=0.5)
        admin = KeyStore(client, prefix=prefix)  # another process: router_a's cache does not hear of it
        secret, key = await admin.create("a")
        assert await router_a.authenticate(f"Bearer {secret}") == key  # now cached in router_a
        assert await admin.revoke(key.key_id)
        await asyncio.sleep(router_a.cache_s + 0.1)
        assert await refused(router_a, f"Bearer {secret}") == "revoked"

        short, _ = await admin.create("short", expires_at=time.time() + 0.3)
        await router_a.authenticate(f"Bearer {short}")  # cached
        await asyncio.sleep(0.4)
        assert await refused(router_a, f"Bearer {short}") == "expired"  # the cache checks expiry too

    run(redis_url, body)


def test_static_keys_work_alongside_redis_and_without_it(redis_url: str) -> None:
    text = (
        "# static keys\n"
        "static-secret-number-one-0123456789 name=ops tenant=acme scopes=inference,admin rpm=5\n"
        "static-secret-number-two-0123456789 expires=2000-01-01\n"
    )
    static = parse_keys_text(text)

    async def body(client: aioredis.Redis, prefix: str) -> None:
        store = KeyStore(client, prefix=prefix, static=static)
        assert await store.any_keys()
        ops = await store.authenticate("Bearer static-secret-number-one-0123456789")
        assert (ops.name, ops.tenant, ops.source, ops.limits.rpm) == ("ops", "acme", "file", 5)
        assert await refused(store, "Bearer static-secret-number-two-0123456789") == "expired"
        secret, key = await store.create("dyn")
        assert await store.authenticate(f"Bearer {secret}") == key
        listed = await store.list()
        assert [k.source for k in listed] == ["file", "file", "redis"]
        with pytest.raises(ValueError, match="keys file"):
            await store.revoke(ops.key_id)

        offline = KeyStore(None, static=static)
        assert await offline.authenticate("Bearer static-secret-number-one-0123456789") == ops
        assert await refused(offline, f"Bearer {secret}") == "unknown"  # no Redis: no such keys
        with pytest.raises(KeyStoreUnavailable):
            await offline.create("x")

    run(redis_url, body)


def test_unreachable_redis_is_unavailable_not_unauthorized() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused

        async def main() -> None:
            no_retry = Retry(NoBackoff(), 0)  # fail at once (the default retries with backoff for seconds)
            client = aioredis.Redis(
                port=port, socket_connect_timeout=0.5, retry=no_retry, decode_responses=True
            )
            store = KeyStore(client, prefix="x:")
            fake = "sk-ss-k_0123456789ab-" + "a" * 43
            with pytest.raises(KeyStoreUnavailable):
                await store.authenticate(f"Bearer {fake}")
            with pytest.raises(KeyStoreUnavailable):
                await store.any_keys()
            with pytest.raises(RateLimiterUnavailable):
                await RateLimiter(client).acquire(limited(rpm=1), "r", 1, 1.0)
            await RateLimiter(client).release(limited(max_concurrent=1), "r", 1, 0)  # logged, not raised
            assert await refused(store, "Basic abc") == "malformed"  # no Redis needed to refuse that
            await client.aclose()

        asyncio.run(main())


def test_known_keys_ride_out_a_redis_outage() -> None:
    """Redis stops: a key verified before is still accepted (for stale_s), an unseen one is not; both
    answers come within the store's Redis timeout, not after redis-py's retries."""
    from common.cluster.redis_server import RedisServer

    server = RedisServer().start()

    async def main() -> None:
        client = connect(server.url)
        store = KeyStore(client, prefix="outage:", cache_s=0.0, stale_s=2.0, redis_timeout_s=0.5)
        known, _ = await store.create("known")
        unseen, _ = await store.create("unseen")
        assert (await store.authenticate(f"Bearer {known}")).name == "known"
        server.stop()
        t0 = time.monotonic()
        assert (await store.authenticate(f"Bearer {known}")).name == "known"
        assert store.served_stale == 1
        with pytest.raises(KeyStoreUnavailable):
            await store.authenticate(f"Bearer {unseen}")
        assert time.monotonic() - t0 < 5.0  # bounded by redis_timeout_s (two calls), with slack
        await asyncio.sleep(2.1)
        with pytest.raises(KeyStoreUnavailable):  # verified too long ago to vouch for it now
            await store.authenticate(f"Bearer {known}")
        await client.aclose()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_a_key_read_while_a_revocation_is_learned_is_read_again_and_cached(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Another key's revocation is learned while this key's read is in flight (a router's first
    revocation poll counts as one): the read may predate it, so the key is read again and that read is
    cached, and it rides out a Redis outage right after (a CI run lost a /metrics call to this)."""
    from common.cluster.redis_server import RedisServer

    server = RedisServer().start()

    async def main() -> None:
        client, admin_client = connect(server.url), connect(server.url)
        store = KeyStore(client, prefix="overtaken:", cache_s=0.0, stale_s=60.0, redis_timeout_s=0.5)
        admin = KeyStore(admin_client, prefix="overtaken:")
        revoked, revoked_key = await admin.create("revoked-meanwhile")
        wanted, wanted_key = await admin.create("wanted")
        await store.authenticate(f"Bearer {revoked}")  # cached: recheck_cached will drop it
        real_hgetall, reads = client.hgetall, []

        async def hgetall(name: str) -> Any:
            reads.append(name)
            if len(reads) == 1:  # the revocation is learned while this read is in flight
                assert await admin.revoke(revoked_key.key_id)
                await store.recheck_cached()
            return await real_hgetall(name)

        monkeypatch.setattr(client, "hgetall", hgetall)
        assert (await store.authenticate(f"Bearer {wanted}")).key_id == wanted_key.key_id
        assert len(reads) == 2 and all(wanted_key.key_id in r for r in reads)  # read again, once
        server.stop()
        assert (await store.authenticate(f"Bearer {wanted}")).key_id == wanted_key.key_id
        assert store.served_stale == 1
        with pytest.raises(InvalidKey):  # the revocation learned stays: 401, not a pass
            await store.authenticate(f"Bearer {revoked}")
        await client.aclose()
        await admin_client.aclose()

    try:
        asyncio.run(main())
    finally:
        server.stop()


# ---- rate limits ----


def test_requests_per_minute(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        limiter, key = RateLimiter(client, prefix=prefix), limited(rpm=3)
        decisions = [await limiter.acquire(key, f"r{i}", 10, 30.0) for i in range(4)]
        assert [d.allowed for d in decisions] == [True, True, True, False]
        assert [d.headers["x-ratelimit-remaining-requests"] for d in decisions] == ["2", "1", "0", "0"]
        first, last = decisions[0], decisions[-1]
        assert first.headers["x-ratelimit-limit-requests"] == "3" and first.retry_after_s == 0
        assert RESET_RE.match(first.headers["x-ratelimit-reset-requests"])
        assert "x-ratelimit-limit-tokens" not in first.headers  # only the limits the key has
        assert last.reason == "requests" and not last.never
        assert 19.0 < last.retry_after_s <= 20.0  # one request refills in 60/3 s
        assert retry_after_header(last.retry_after_s) == "20"

    run(redis_url, body)


def test_tokens_charged_up_front_and_refunded(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        limiter, key = RateLimiter(client, prefix=prefix), limited(tpm=600)  # refills 10 tokens/s
        ok = await limiter.acquire(key, "a", 500, 30.0)
        assert ok.allowed and ok.headers["x-ratelimit-remaining-tokens"] == "100"
        no = await limiter.acquire(key, "b", 300, 30.0)
        assert not no.allowed and no.reason == "tokens" and 19.0 < no.retry_after_s <= 20.0
        assert no.headers["x-ratelimit-remaining-tokens"] == "100"  # a refusal charges nothing
        await limiter.release(key, "a", charged_tokens=500, used_tokens=200)  # 300 back
        await limiter.release(key, "a", charged_tokens=500, used_tokens=200)  # twice: refunded once
        yes = await limiter.acquire(key, "b", 300, 30.0)
        assert yes.allowed and yes.headers["x-ratelimit-remaining-tokens"] == "100"

        # a refund never fills the bucket past its capacity
        await limiter.release(key, "b", charged_tokens=10_000, used_tokens=0)
        full = await limiter.acquire(key, "c", 600, 30.0)
        assert full.allowed and full.headers["x-ratelimit-remaining-tokens"] == "0"
        assert not (await limiter.acquire(key, "d", 20, 30.0)).allowed

        # larger than the whole limit: can never pass, and says so
        never = await limiter.acquire(key, "e", 601, 30.0)
        assert (never.allowed, never.reason, never.retry_after_s, never.never) == (
            False,
            "tokens",
            -1.0,
            True,
        )

    run(redis_url, body)


def test_concurrency_limit_release_and_expiry(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        limiter, key = RateLimiter(client, prefix=prefix), limited(max_concurrent=2)
        assert (await limiter.acquire(key, "a", 1, 30.0)).allowed
        assert (await limiter.acquire(key, "b", 1, 30.0)).allowed
        third = await limiter.acquire(key, "c", 1, 30.0)
        assert not third.allowed and third.reason == "concurrency" and 0 < third.retry_after_s <= 1.0
        assert third.headers == {}  # no requests/tokens limits: no x-ratelimit-* headers
        await limiter.release(key, "a", 1, 1)
        assert (await limiter.acquire(key, "c", 1, 30.0)).allowed

        # a router that dies never releases: its entries leave once their hold is over
        other = limited(max_concurrent=2)
        assert (await limiter.acquire(other, "x", 1, 0.2)).allowed
        assert (await limiter.acquire(other, "y", 1, 0.2)).allowed
        assert not (await limiter.acquire(other, "z", 1, 0.2)).allowed
        await asyncio.sleep(0.3)
        assert (await limiter.acquire(other, "z", 1, 0.2)).allowed

    run(redis_url, body)


def test_unlimited_key_never_touches_redis(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        limiter, key = RateLimiter(client, prefix=prefix), limited()
        for i in range(5):
            d = await limiter.acquire(key, f"r{i}", 10**9, 1.0)
            assert d.allowed and d.headers == {}
        await limiter.release(key, "r0", 10, 0)
        assert [k async for k in client.scan_iter(match=f"{prefix}*")] == []

    run(redis_url, body)


def test_two_routers_share_one_budget(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        second = connect(redis_url)  # another router: its own connection, its own script cache
        try:
            routers = [RateLimiter(client, prefix=prefix), RateLimiter(second, prefix=prefix)]
            key = limited(rpm=5, tpm=10_000)
            allowed = 0
            for i in range(12):
                d = await routers[i % 2].acquire(key, f"r{i}", 100, 30.0)
                allowed += d.allowed
                if not d.allowed:
                    assert d.reason == "requests"
            assert allowed == 5
        finally:
            await second.aclose()

    run(redis_url, body)


def test_many_concurrent_acquires_admit_exactly_the_limit(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        second = connect(redis_url)
        try:
            routers = [RateLimiter(client, prefix=prefix), RateLimiter(second, prefix=prefix)]
            key = limited(max_concurrent=5, tpm=1200)  # refills 20 tokens/s
            decisions = await asyncio.gather(
                *(routers[i % 2].acquire(key, f"r{i}", 10, 30.0) for i in range(60))
            )
            assert sum(d.allowed for d in decisions) == 5
            assert {d.reason for d in decisions if not d.allowed} == {"concurrency"}
            # a refused request was charged nothing: 5 x 10 tokens gone (plus what refilled meanwhile)
            state = await client.hgetall(f"{prefix}ratelimit:{{{key.key_id}}}:buckets")
            assert 1150 <= float(state["t"]) <= 1160
        finally:
            await second.aclose()

    run(redis_url, body)


def test_script_is_reloaded_after_a_script_flush(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        limiter, key = RateLimiter(client, prefix=prefix), limited(rpm=2)
        assert (await limiter.acquire(key, "a", 1, 1.0)).allowed
        await client.script_flush()  # as after a Redis restart: EVALSHA answers NOSCRIPT
        assert (await limiter.acquire(key, "b", 1, 1.0)).allowed
        assert not (await limiter.acquire(key, "c", 1, 1.0)).allowed

    run(redis_url, body)


# ---- the CLI ----


def test_keys_cli_create_list_revoke(
    redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = f"t-{uuid.uuid4().hex}:"
    where = ["--redis-url", redis_url, "--redis-prefix", prefix]
    argv = ["keys", "create", "--name", "ci", "--tenant", "acme", "--scopes", "inference,admin"]
    assert (
        cli_main(
            [*argv, "--rpm", "60", "--tpm", "5000", "--max-concurrent", "3", "--expires-in", "30d", *where]
        )
        == 0
    )
    out = capsys.readouterr().out
    secrets = SECRET_RE.findall(out)
    assert len(secrets) == 1 and "will not be shown again" in out
    secret = secrets[0]
    key_id = secret.split("-")[2]

    async def check() -> ApiKey:
        client = connect(redis_url)
        try:
            return await KeyStore(client, prefix=prefix).authenticate(f"Bearer {secret}")
        finally:
            await client.aclose()

    key = asyncio.run(check())
    assert key.key_id == key_id and key.scopes == {"inference", "admin"} and key.tenant == "acme"
    assert key.limits == Limits(rpm=60, tpm=5000, max_concurrent=3)
    assert key.expires_at is not None and abs(key.expires_at - (time.time() + 30 * 86400)) < 60

    monkeypatch.delenv("SPLITSERVE_REDIS_URL", raising=False)
    monkeypatch.setenv("SPLITSERVE_ROUTER_REDIS_URL", redis_url)  # the URL from the environment
    assert cli_main(["keys", "list", "--redis-prefix", prefix]) == 0
    table = capsys.readouterr().out
    assert secret not in table and secret[-43:] not in table
    lines = table.splitlines()
    assert lines[0].split() == ["ID", "NAME", "TENANT", "SCOPES", "LIMITS", "CREATED", "EXPIRES", "STATUS"]
    assert key_id in lines[1] and "acme" in lines[1] and "rpm=60" in lines[1] and lines[1].endswith("active")

    assert cli_main(["keys", "revoke", key_id, *where]) == 0
    capsys.readouterr()
    assert cli_main(["keys", "revoke", "k_000000000000", *where]) == 1
    assert "no key" in capsys.readouterr().err

    assert cli_main(["keys", "list", "--json", *where]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(k["key_id"], k["status"], k["scopes"]) for k in listed] == [
        (key_id, "revoked", ["admin", "inference"])
    ]
    assert "hash" not in listed[0] and "salt" not in listed[0]

    for bad in (["--scopes", "root"], ["--expires-in", "3x"], ["--rpm", "0"], ["--expires-in", "0d"]):
        assert cli_main(["keys", "create", "--name", "x", *bad, *where]) == 2
        assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # argparse: not a number
        cli_main(["keys", "create", "--name", "x", "--rpm", "many", *where])
    assert info.value.code == 2

    async def cleanup() -> None:
        client = connect(redis_url)
        keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    asyncio.run(cleanup())
