"""Chaos: Redis dies while streams run, new requests arrive while it is away, and it comes back empty
(a restart without persistence). Redis is not a single point of request failure: every request —
in flight, or new during the outage — finishes with the text of an unfaulted greedy run; the workers
are in the registry again within a heartbeat of its return; every request's record converges to
`finished` (the router writes an end whose record Redis lost again); no lease is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from common.cluster.redis_server import RedisServer
from common.cluster.state import ClusterState
from tests.chaos.test_decode_and_prefill_faults import (
    LEASE_S,
    QUESTIONS,
    Stream,
    assert_clean,
    chat,
    metric,
    reference,
    role,
)
from tests.support.cluster import Cluster, free_port, get_json, wait_until

pytestmark = [pytest.mark.services, pytest.mark.chaos]
FLAGS = ("--threads", "1", "--kv-cache-mb", "128", "--lease-s", str(LEASE_S))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path_factory.mktemp("logs")))
    try:
        c.start("prefill", *FLAGS)
        c.start("decode", *FLAGS)
        c.start("router")
        c.wait_routed()
        yield c, redis
    finally:
        c.stop()
        redis.stop()


def registered(url: str) -> set[str]:
    async def alive() -> set[str]:
        state = ClusterState.from_url(url)
        try:
            return {w.id for role_ in ("prefill", "decode") for w in await state.registry.alive(role_)}
        finally:
            await state.close()

    return asyncio.run(alive())


def test_redis_restarted_empty_loses_no_request(stack) -> None:  # type: ignore[no-untyped-def]
    c, redis = stack
    router = role(c, "router")[0]
    want = reference(router)
    streams = [Stream(router, chat(q)) for q in QUESTIONS]
    for s in streams:
        s.start()
    wait_until(lambda: all(s.chunks >= 2 for s in streams), 120, "every stream to be generating")
    redis.stop()
    try:

        def on_last_known_list() -> bool:
            """The router's /health reads the registry (once its 0.25 s cache is out): with Redis away
            that read is served from the last known list, which the stale-read counter shows."""
            with contextlib.suppress(OSError):
                get_json(router.url + "/health")
            return metric(router, "splitserve_router_registry_stale_reads") > 0

        wait_until(on_last_known_list, 5, "the router to route on its last known worker list")
        during = [Stream(router, chat(q)) for q in QUESTIONS[:2]]  # routed on the last known registry
        for s in during:
            s.start()
        time.sleep(LEASE_S * 1.5)  # longer than a lease: none may expire for that alone
    finally:
        redis.start()  # the same port, empty
    back = time.monotonic()
    wait_until(lambda: len(registered(redis.url)) == 2, 5, "both services to register again")
    assert time.monotonic() - back < 3.0, "workers re-register within a heartbeat or two"
    for s in streams + during:
        s.join(180)
    for s, text in zip(streams + during, want + want[:2], strict=True):
        assert s.status == 200 and not s.errors, (s.status, s.errors)
        assert s.text == text
    assert metric(router, "splitserve_router_registry_stale_reads") > 0
    deadline = time.monotonic() + 15
    records = {}
    while time.monotonic() < deadline:  # the writes that waited for Redis land
        records = {s.request_id: _record(router.url, s.request_id) for s in streams + during}
        if all(r and r["state"] == "finished" for r in records.values()):
            break
        time.sleep(0.3)
    assert all(r and r["state"] == "finished" for r in records.values()), records
    assert any(r.get("restored") == 1 for r in records.values()), "the records Redis lost were written again"
    assert metric(router, "splitserve_router_record_writes_pending") == 0
    assert_clean(c, redis.url)


def _record(router_url: str, request_id: str) -> dict | None:
    try:
        return get_json(f"{router_url}/v1/requests/{request_id}")  # type: ignore[no-any-return]
    except OSError:
        return None
