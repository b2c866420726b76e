"""Tenant-private prefix caches (issue 31, point 6): a tenant sending another tenant's recent prompt gets
no cached tokens and no prefix hit in the route header, so it cannot tell what the other sent; its own
repeat does hit. An operator who shares the cache on purpose (prefix_cache_scope=shared) gets hits across
tenants. Real Redis, a real decode service and two real routers (one per scope) with API keys."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from common.cluster.state import connect
from router.auth.keys import KeyStore
from tests.support.cluster import Cluster, free_port

pytestmark = pytest.mark.services

PROMPT = " ".join(f"word{i}" for i in range(160))  # ~10 blocks of 16 tokens


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path_factory.mktemp("logs")))
    try:
        # every prompt prefilled on the decode service, whose prefix cache is the one under test
        c.start("decode", "--threads", "1", "--kv-cache-mb", "64")
        private = c.start("router", "--require-api-key", "--local-prefill-threshold", "100000")
        shared = c.start(
            "router",
            "--require-api-key",
            "--local-prefill-threshold",
            "100000",
            env={"SPLITSERVE_ROUTER_PREFIX_CACHE_SCOPE": "shared"},
        )
        c.wait_routed()
        keys = asyncio.run(_keys(redis.url))
        yield private, shared, keys
    finally:
        c.stop()
        redis.stop()


async def _keys(url: str) -> dict[str, str]:
    r = connect(url)
    try:
        store = KeyStore(r)
        return {t: (await store.create(f"key-{t}", t))[0] for t in ("alice", "bob", "carol")}
    finally:
        await r.aclose()


def ask(router, key: str, prompt: str) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """(cached prompt tokens, the route header) of one completion."""
    r = httpx.post(
        router.url + "/v1/completions",
        json={"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.headers["x-splitserve-route"]


def test_another_tenants_prompt_is_not_a_hit_and_ones_own_is(stack) -> None:  # type: ignore[no-untyped-def]
    private, _, keys = stack
    prompt = "alice private " + PROMPT
    assert ask(private, keys["alice"], prompt)[0] == 0
    own, own_route = ask(private, keys["alice"], prompt)
    assert own >= 144, own  # her repeat: the full blocks come from the cache
    theirs, their_route = ask(private, keys["bob"], prompt)
    assert theirs == 0 and "prefix_hit" not in their_route, (theirs, their_route)
    variant, _ = ask(private, keys["carol"], prompt[:-30])  # a guessed variant: nothing either
    assert variant == 0
    assert ask(private, keys["alice"], prompt)[0] >= 144  # and hers is still there


def test_a_shared_cache_is_an_operators_opt_in(stack) -> None:  # type: ignore[no-untyped-def]
    _, shared, keys = stack
    prompt = "common system prompt " + PROMPT
    assert ask(shared, keys["alice"], prompt)[0] == 0
    cached, _ = ask(shared, keys["bob"], prompt)
    assert cached >= 144, cached
