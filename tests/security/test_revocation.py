"""Revocation wins (issue 31, "Security round 2"), against a real Redis and a real router process: a key
Redis reported revoked or deleted is never served again from the router's key cache, not even while Redis
stops answering; a revocation reaches the router within a second without any request for the key; and
a key the router cannot check gets a 503 that names no exception.

Redis is paused for real: its process is stopped (SIGSTOP) and continued (SIGCONT), so the router's
connections stay open and its reads time out, as with a Redis that is slow rather than gone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from common.cluster.state import connect
from router.auth.keys import KeyStore
from tests.support.cluster import Cluster, Proc, free_port, wait_until

pytestmark = pytest.mark.services
UNSEEN = "sk-ss-k_0123456789ab-" + "a" * 43  # well formed, never created


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path_factory.mktemp("logs")))
    try:
        # no decode service: these calls (/v1/models) need only the key check
        router = c.start("router", "--require-api-key", "--decode-urls", f"http://127.0.0.1:{free_port()}")
        yield redis, router
    finally:
        c.stop()
        redis.stop()


@contextlib.contextmanager
def paused(redis: RedisServer) -> Iterator[None]:
    """Redis stops answering (its process stopped) until the block ends."""
    assert redis.pid is not None
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(redis.pid, signal.SIGCONT)


def with_store(redis_url: str, work):  # type: ignore[no-untyped-def]
    """work(KeyStore) on a client of its own: another process than the router, as `splitserve keys` is."""

    async def main():  # type: ignore[no-untyped-def]
        r = connect(redis_url)
        try:
            return await work(KeyStore(r), r)
        finally:
            await r.aclose()

    return asyncio.run(main())


def create_key(redis_url: str, name: str) -> str:
    async def work(store: KeyStore, _):  # type: ignore[no-untyped-def]
        return (await store.create(name))[0]

    return str(with_store(redis_url, work))


def revoke(redis_url: str, secret: str) -> None:
    async def work(store: KeyStore, _):  # type: ignore[no-untyped-def]
        assert await store.revoke(secret.split("-")[2])

    with_store(redis_url, work)


def delete(redis_url: str, secret: str) -> None:
    """The key's hash removed from Redis by hand (an operator's DEL): no revocation counter moves."""

    async def work(_, r):  # type: ignore[no-untyped-def]
        assert await r.delete(f"splitserve:apikey:{secret.split('-')[2]}") == 1

    with_store(redis_url, work)


def models(router: Proc, key: str) -> httpx.Response:
    return httpx.get(router.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=15)


def test_a_revoked_key_stays_refused_while_redis_pauses(stack) -> None:  # type: ignore[no-untyped-def]
    """Revoke -> 401; Redis paused -> still 401 (it was 200: the verified-key cache still held the key),
    while a key verified before is still served; Redis back -> 401."""
    redis, router = stack
    revoked, good = create_key(redis.url, "to-revoke"), create_key(redis.url, "good")
    assert models(router, revoked).status_code == 200 and models(router, good).status_code == 200
    revoke(redis.url, revoked)
    wait_until(lambda: models(router, revoked).status_code == 401, 3.0, "the revocation")
    with paused(redis):
        r = models(router, revoked)
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"], r.text
        assert models(router, good).status_code == 200  # outages are still ridden out
    r = models(router, revoked)
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"], r.text


def test_a_key_that_cannot_be_checked_gets_a_503_naming_no_exception(stack) -> None:  # type: ignore[no-untyped-def]
    """An unknown key while Redis pauses: 503 with Retry-After, no `Redis: TimeoutError()` in the body;
    the cause is in the router's log with the request id."""
    redis, router = stack
    with paused(redis):
        unseen = models(router, UNSEEN)
    assert unseen.status_code == 503 and unseen.headers["retry-after"], unseen.text
    assert "cannot check API keys" in unseen.json()["error"]["message"]
    for leak in ("TimeoutError", "Redis:", "Error(", "127.0.0.1", str(redis.port)):
        assert leak not in unseen.text, (leak, unseen.text)
    request_id = unseen.headers["x-request-id"]

    def logged() -> bool:
        with open(router.log_path, errors="replace") as f:
            return any(request_id in line and "TimeoutError" in line for line in f)

    wait_until(logged, 5.0, "the cause in the router's log, with the request id")


def test_a_revocation_reaches_the_router_without_a_request_and_survives_a_pause(stack) -> None:  # type: ignore[no-untyped-def]
    """Nobody uses the key between its revocation and the pause: the router learned of it anyway."""
    redis, router = stack
    key = create_key(redis.url, "revoked-quietly")
    assert models(router, key).status_code == 200  # verified: in the router's cache from here on
    revoke(redis.url, key)
    time.sleep(1.0)  # "within a second"
    with paused(redis):
        r = models(router, key)
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"], r.text


def test_a_deleted_key_is_not_served_from_the_cache_while_redis_pauses(stack) -> None:  # type: ignore[no-untyped-def]
    redis, router = stack
    key = create_key(redis.url, "deleted")
    assert models(router, key).status_code == 200
    delete(redis.url, key)
    # once the 0.5 s cache is out the next call reads Redis, which says there is no such key
    wait_until(lambda: models(router, key).status_code == 401, 5, "the deleted key to be refused")
    with paused(redis):
        r = models(router, key)
    assert r.status_code == 401, r.text
