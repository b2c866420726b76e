"""The router's registry read (common/cluster/registry.py `alive`): every worker of a role in one script
round trip, and each entry's signature checked once while it stays the same — against a real Redis."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from common.cluster.registry import WorkerRegistry
from common.cluster.state import ClusterState
from common.security.secret import InternalSecret

LOAD = {"running": 1, "waiting": 0, "free_blocks": 90, "total_blocks": 100}
SECRET = InternalSecret.from_env({"SPLITSERVE_INTERNAL_SECRET": "r" * 64})


def _store(redis_url: str) -> ClusterState:
    return ClusterState.from_url(redis_url, prefix=f"test:{uuid.uuid4().hex}:")


def test_one_read_returns_every_worker_sorted_and_drops_expired_entries(redis_url: str) -> None:
    async def main() -> None:
        store = _store(redis_url)
        reg = WorkerRegistry(store.redis, store.prefix, ttl_s=5.0, secret=SECRET)
        try:
            capacity = {"block_size": 16, "model": "m/ü"}  # cjson escapes "/"; non-ASCII passes as UTF-8
            for i in (3, 1, 2):  # registered out of order
                url, kv = f"http://127.0.0.1:90{i}", f"tcp://h:91{i}/inc{i}"
                await reg.register(f"d{i}", "decode", url, kv, capacity, {**LOAD, "running": i}, f"inc{i}")
            await reg.register("p0", "prefill", "http://127.0.0.1:9000", "tcp://h:9100", {}, LOAD)
            await store.redis.delete(reg.key("d2"))  # expired: its index entry is left behind
            workers = await reg.alive("decode")
            assert [w.id for w in workers] == ["d1", "d3"]
            d3 = workers[1]
            assert (d3.role, d3.url, d3.kv_endpoint, d3.incarnation) == (
                "decode", "http://127.0.0.1:903", "tcp://h:913/inc3", "inc3"
            )  # fmt: skip
            assert d3.capacity == {"block_size": 16, "model": "m/ü"} and d3.load == {**LOAD, "running": 3}
            assert d3.last_seen > 0
            assert await store.redis.smembers(reg.index_key("decode")) == {"d1", "d3"}  # d2 dropped
            assert [w.id for w in await reg.alive("prefill")] == ["p0"]
            await reg.deregister("p0")
            assert await reg.alive("prefill") == []  # none: an empty list, not an error
        finally:
            await store.close()

    asyncio.run(main())


def test_a_signature_is_checked_once_while_the_entry_stays_the_same(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Re-reads of an unchanged entry skip the HMAC; a changed one (a forger rewriting the url) is checked
    again and left out."""

    async def main() -> tuple[int, int, list[str]]:
        store = _store(redis_url)
        reg = WorkerRegistry(store.redis, store.prefix, secret=SECRET)
        checks: list[Any] = []
        check = reg._check
        monkeypatch.setattr(reg, "_check", lambda w, sig: checks.append(w.id) or check(w, sig))
        try:
            await reg.register("d0", "decode", "http://127.0.0.1:9001", "tcp://h:1", {}, LOAD)
            for _ in range(5):
                assert [w.id for w in await reg.alive("decode")] == ["d0"]
            once = len(checks)
            await reg.heartbeat("d0", {**LOAD, "running": 7})  # load is not signed: no new check
            [d0] = await reg.alive("decode")
            assert d0.load["running"] == 7
            after_beat = len(checks)
            await store.redis.hset(reg.key("d0"), "url", "http://evil:1")
            forged = [w.id for w in await reg.alive("decode")]
            return once, after_beat, forged
        finally:
            await store.close()

    once, after_beat, forged = asyncio.run(main())
    assert once == 1 and after_beat == 1
    assert forged == []
