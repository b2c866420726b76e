"""common.cluster (records, registry, leases, the lease keeper) against a real Redis server (the
session's `redis_url`). TTLs are a few hundred ms, so expiry is waited out in well under a second;
the keeper's own notion of time is an injected clock, advanced by hand.

Each test runs its body with asyncio.run and its own uuid key prefix, so tests never see each
other's keys and no asyncio pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from common.cluster.leases import LeaseKeeper, LeaseTerm
from common.cluster.records import DuplicateRequest, IllegalTransition, RequestState, UnknownRequest
from common.cluster.registry import Heartbeat
from common.cluster.state import ClusterState, connect

S = RequestState


def run_with_store(redis_url: str, body: Callable[[ClusterState], Awaitable[Any]], **kwargs: Any) -> Any:
    async def main() -> Any:
        store = ClusterState.from_url(redis_url, prefix=f"test:{uuid.uuid4().hex}:", **kwargs)
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def test_split_path_records_every_transition_in_order(redis_url: str) -> None:
    async def body(store: ClusterState) -> None:
        records = store.records
        await records.create("r1", router_id="router-0", model="smollm2", route="split", prompt_tokens=12)
        await store.records.transition("r1", S.RESERVED, decode_id="decode-0")
        await store.records.transition("r1", S.PREFILLING, prefill_id="prefill-0")
        await store.records.transition("r1", S.TRANSFERRING)
        transfer = {"transfer_bytes": 4096, "transfer_ms": 1.25, "transfer_backend": "tcp"}
        assert await store.records.set_fields("r1", **transfer)
        await store.records.transition("r1", S.DECODING)
        await store.records.transition("r1", S.FINISHED, output_tokens=7, finish_reason="stop")

        rec = await store.records.get("r1")
        assert rec is not None
        order = [S.QUEUED, S.RESERVED, S.PREFILLING, S.TRANSFERRING, S.DECODING, S.FINISHED]
        assert [s for s, _ in rec["history"]] == order
        stamps = [t for _, t in rec["history"]]
        assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps), stamps
        assert [rec[f"t_{s.value}"] for s in order] == stamps
        assert rec["state"] is S.FINISHED
        assert rec["prompt_tokens"] == 12 and rec["output_tokens"] == 7  # ints, not strings
        assert (rec["router_id"], rec["prefill_id"], rec["decode_id"]) == (
            "router-0",
            "prefill-0",
            "decode-0",
        )
        assert (rec["route"], rec["model"], rec["finish_reason"]) == ("split", "smollm2", "stop")
        assert (rec["transfer_bytes"], rec["transfer_ms"], rec["transfer_backend"]) == (4096, 1.25, "tcp")
        assert await store.records.get("missing") is None

    run_with_store(redis_url, body)


def test_local_prefill_path_skips_prefill_states(redis_url: str) -> None:
    async def body(store: ClusterState) -> None:
        await store.records.create("r1", route="local:short_prompt")
        for state in (S.RESERVED, S.DECODING, S.FINISHED):
            await store.records.transition("r1", state)
        rec = await store.records.get("r1")
        assert rec is not None
        assert [s for s, _ in rec["history"]] == [S.QUEUED, S.RESERVED, S.DECODING, S.FINISHED]
        assert "t_prefilling" not in rec and rec["route"] == "local:short_prompt"

    run_with_store(redis_url, body)


def test_illegal_transitions_are_refused_and_leave_the_record_alone(redis_url: str) -> None:
    async def body(store: ClusterState) -> None:
        await store.records.create("r1")
        with pytest.raises(IllegalTransition, match="QUEUED -> DECODING"):
            await store.records.transition("r1", S.DECODING)
        with pytest.raises(IllegalTransition, match="QUEUED -> FINISHED"):
            await store.records.transition("r1", S.FINISHED)
        await store.records.transition("r1", S.CANCELLED, error="client went away")
        # A late FINISHED after CANCELLED must neither succeed nor overwrite anything.
        with pytest.raises(IllegalTransition, match="CANCELLED -> FINISHED") as info:
            await store.records.transition("r1", S.FINISHED, finish_reason="stop", output_tokens=3)
        assert (info.value.current, info.value.new) == (S.CANCELLED, S.FINISHED)
        rec = await store.records.get("r1")
        assert rec is not None
        assert rec["state"] is S.CANCELLED and "finish_reason" not in rec and "output_tokens" not in rec
        assert [s for s, _ in rec["history"]] == [S.QUEUED, S.CANCELLED]

        with pytest.raises(UnknownRequest):
            await store.records.transition("nope", S.RESERVED)
        with pytest.raises(ValueError, match="already exists"):
            await store.records.create("r1")
        with pytest.raises(ValueError, match="unknown request field"):
            await store.records.transition("r1", S.FAILED, prompt_tokenz=1)

    run_with_store(redis_url, body)


def test_terminal_state_sets_ttl(redis_url: str) -> None:
    async def body(store: ClusterState) -> None:
        await store.records.create("r1")
        await store.records.transition("r1", S.RESERVED)
        assert await store.redis.ttl(store.records.key("r1")) == -1  # live records do not expire
        await store.records.transition("r1", S.FAILED, error="decode died")
        assert 0 < await store.redis.ttl(store.records.key("r1")) <= 120

    run_with_store(redis_url, body, request_ttl_s=120)


def test_concurrent_terminal_transitions_exactly_one_wins(redis_url: str) -> None:
    async def body(store: ClusterState) -> None:
        for i in range(20):
            rid = f"r{i}"
            await store.records.create(rid)
            for state in (S.RESERVED, S.DECODING):
                await store.records.transition(rid, state)
            targets = [S.FINISHED, S.FAILED, S.CANCELLED] * 3
            results = await asyncio.gather(
                *(store.records.transition(rid, t) for t in targets), return_exceptions=True
            )
            winners = [t for t, r in zip(targets, results, strict=True) if isinstance(r, float)]
            assert len(winners) == 1, results
            assert all(isinstance(r, (float, IllegalTransition)) for r in results), results
            rec = await store.records.get(rid)
            assert rec is not None and rec["state"] is winners[0]
            assert [s for s, _ in rec["history"]][-1] is winners[0] and len(rec["history"]) == 4

    run_with_store(redis_url, body)


LOAD = {"running": 0, "waiting": 0, "free_blocks": 100, "total_blocks": 100}


def test_worker_registry_expires_without_heartbeats(redis_url: str) -> None:
    async def body(store: ClusterState) -> None:
        await store.registry.register(
            "d0", "decode", "http://127.0.0.1:9001", "tcp://127.0.0.1:9101", {"blocks": 100}, LOAD
        )
        await store.registry.register("p0", "prefill", "http://127.0.0.1:9002", "tcp://h:9102", {}, LOAD)
        [d0] = await store.registry.alive("decode")
        assert (d0.id, d0.role, d0.url, d0.kv_endpoint) == (
            "d0",
            "decode",
            "http://127.0.0.1:9001",
            "tcp://127.0.0.1:9101",
        )
        assert d0.capacity == {"blocks": 100} and d0.load == LOAD and d0.last_seen > 0
        assert [w.id for w in await store.registry.alive("prefill")] == ["p0"]

        assert await store.registry.heartbeat("d0", {**LOAD, "running": 3})
        [d0] = await store.registry.alive("decode")
        assert d0.load["running"] == 3

        await asyncio.sleep(0.45)  # past the 0.3 s TTL
        assert await store.registry.alive("decode") == [] and await store.registry.alive("prefill") == []
        # The lazy cleanup dropped the expired ids from the index, and a late heartbeat says so.
        assert await store.redis.smembers(store.registry.index_key("decode")) == set()
        assert not await store.registry.heartbeat("d0", LOAD)

        await store.registry.register("d1", "decode", "http://x", "tcp://x", {}, LOAD)
        await store.registry.deregister("d1")
        assert await store.registry.alive("decode") == []

    run_with_store(redis_url, body, worker_ttl_s=0.3)


def test_heartbeat_keeps_worker_alive_and_reports_load(redis_url: str) -> None:
    async def body(store: ClusterState) -> None:
        running = iter(range(1000))
        hb = Heartbeat(
            store.registry, "d0", "decode", "http://127.0.0.1:9001", "tcp://127.0.0.1:9101", {"blocks": 100},
            lambda: {**LOAD, "running": next(running)}, interval_s=0.05,
        )  # fmt: skip
        await hb.start()
        await asyncio.sleep(0.5)  # well past the 0.3 s TTL
        [d0] = await store.registry.alive("decode")
        assert d0.load["running"] >= 4  # beats happened and carried fresh load
        # A registration lost meanwhile (e.g. Redis restarted) comes back on the next beat.
        await store.redis.delete(store.registry.key("d0"))
        await asyncio.sleep(0.15)
        assert [w.id for w in await store.registry.alive("decode")] == ["d0"]
        await hb.stop()
        assert await store.registry.alive("decode") == []

    run_with_store(redis_url, body, worker_ttl_s=0.3)


def test_leases_acquire_renew_release(redis_url: str) -> None:
    async def body(store: ClusterState) -> None:
        ledger = store.leases
        assert await ledger.acquire("r1", 1, "decode", "d0", 0.3, [3, 4, 5])
        assert not await ledger.acquire("r1", 1, "decode", "d1", 5, [6])  # held by d0
        assert await ledger.acquire("r1", 1, "decode", "d0", 0.3, [3, 4, 5])  # retry by holder is fine
        assert await ledger.acquire("r1", 1, "prefill", "p0", 5, [1])  # other side is its own lease
        assert await ledger.acquire("r1", 2, "decode", "d1", 5, [6])  # a retry's fence: its own lease
        lease = await ledger.get("r1", 1, "decode")
        assert lease is not None and (lease.owner, lease.blocks, lease.fence) == ("d0", [3, 4, 5], 1)
        assert 0 < lease.ttl_s <= 0.3

        assert not await ledger.renew("r1", 1, "decode", "d1", 5)
        assert await ledger.renew("r1", 1, "decode", "d0", 5)
        await asyncio.sleep(0.4)  # past the original 0.3 s: only the renewal keeps it
        lease = await ledger.get("r1", 1, "decode")
        assert lease is not None and lease.ttl_s > 3

        assert not await ledger.release("r1", 1, "decode", "d1")
        assert await ledger.release("r1", 1, "decode", "d0")
        assert await ledger.get("r1", 1, "decode") is None
        assert not await ledger.renew("r1", 1, "decode", "d0", 5)  # nothing left to renew
        assert await ledger.count() == 2  # r1's prefill lease and the retry's

        assert await ledger.acquire("r2", 1, "decode", "d0", 0.1, [7])
        await asyncio.sleep(0.2)
        assert await ledger.get("r2", 1, "decode") is None  # expired by itself
        assert await ledger.acquire("r2", 1, "decode", "d1", 5, [7])  # free for someone else
        with pytest.raises(ValueError, match="lease side"):
            await ledger.acquire("r3", 1, "router", "x", 1, [])

    run_with_store(redis_url, body)


class Holder:
    """A remote-KV request as the lease keeper sees it."""

    def __init__(self, request_id: str, fence: int = 1, block_ids: list[int] | None = None) -> None:
        self.request_id, self.fence, self.block_ids = request_id, fence, block_ids or [1, 2]
        self.lease = LeaseTerm()


def test_lease_keeper_renews_ours_and_reports_a_silent_peer_once(redis_url: str) -> None:
    """No sleeps: the keeper runs on a hand-advanced clock and ticks when told; Redis TTLs are long."""

    async def body(store: ClusterState) -> None:
        now = [100.0]
        holders = [Holder("a"), Holder("b")]
        lost: list[str] = []
        keeper = LeaseKeeper(
            store.leases, "decode", "d0", 2.0, lambda: holders, lambda h: lost.append(h.request_id),
            clock=lambda: now[0],
        )  # fmt: skip
        for h in holders:
            await keeper.acquire(h)
        assert await store.leases.count() == 2
        await store.leases.acquire("a", 1, "prefill", "p0", 60, [9])  # a's peer is alive, b's never shows
        now[0] += 1.5
        await keeper.tick()
        assert lost == []  # b's peer still has time to take its lease
        now[0] += 1.0  # b's peer silent for 2.5 s > the 2 s TTL; a's peer renews
        await keeper.tick()
        assert lost == ["b"] and keeper.expired == 1
        now[0] += 5
        await keeper.tick()
        assert lost == ["b"], "reported once"
        # a lease lost meanwhile (Redis restarted empty) is taken again on the next tick
        await store.redis.delete(store.leases.key("a", 1, "decode"))
        await keeper.tick()
        lease = await store.leases.get("a", 1, "decode")
        assert lease is not None and lease.owner == "d0" and lease.ttl_s > 1
        # released leases are gone from Redis and neither renewed nor watched any more
        for h in holders:
            await keeper.release(h)
        await keeper.tick()
        for rid in ("a", "b"):
            assert await store.leases.get(rid, 1, "decode") is None
        assert await store.leases.count() == 1  # only the fake peer's own

    run_with_store(redis_url, body)


def test_record_writes_wait_for_redis_and_land_in_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A dedicated server, stopped and started again empty under the writer."""
    from common.cluster.owners import RouterOwnership
    from common.cluster.record_writer import RecordWriter
    from common.cluster.redis_server import RedisServer
    from tests.support.cluster import free_port

    redis = RedisServer(port=free_port()).start()

    async def body() -> None:
        store = ClusterState.from_url(redis.url)
        router = RecordWriter(store.records, restore_lost=True)
        service = RecordWriter(store.records)
        owned = RouterOwnership(store.redis, store.prefix, "router-0", store.records).owned_set
        try:
            await router.create("a", owned_by=owned, route="split", prompt_tokens=3)
            await router.create("b", route="local:short_prompt")
            await service.transition("a", S.RESERVED, decode_id="d0")
            redis.stop()
            await service.transition("a", S.DECODING)  # Redis away: kept, in order
            await router.transition("a", S.FINISHED, leave=owned, output_tokens=4, finish_reason="length")
            await router.create("c", owned_by=owned, route="split")  # a new request while Redis is away
            await router.transition("c", S.FAILED, leave=owned, error="client went away")
            await router.create("e", owned_by=owned, route="split")  # ...still live when Redis is back
            assert router.pending == 4 and service.pending == 1
            redis.start()  # empty: a and b are gone
            async with asyncio.timeout(10):
                while router.pending or service.pending:
                    await asyncio.sleep(0.05)
            a, c = await store.records.get("a"), await store.records.get("c")
            assert a is not None and (a["state"], a["restored"], a["route"], a["output_tokens"]) == (
                S.FINISHED, 1, "split", 4,
            )  # fmt: skip
            assert [s for s, _ in a["history"]] == [S.FINISHED]  # what Redis kept of it
            assert c is not None and [s for s, _ in c["history"]] == [S.QUEUED, S.FAILED]
            assert await store.records.get("b") is None  # lost, and never ended: nothing to write
            # the owned set came along with the writes: c joined and left, e (live) is in it
            assert await store.redis.smembers(owned.key) == {"e"}
            assert await store.redis.exists(owned.alive_key)
            assert await store.redis.smembers(owned.routers_key) == {"router-0"}
            # an end refused from a live state (the states between were lost): written from there
            await router.create("d", route="split")
            await router.transition("d", S.FINISHED)
            d = await store.records.get("d")
            assert d is not None and [s for s, _ in d["history"]] == [S.QUEUED, S.FINISHED]
        finally:
            await router.close()
            await service.close()
            await store.close()

    try:
        asyncio.run(body())
    finally:
        redis.stop()


def test_closing_a_writer_whose_redis_is_away_stops_its_retries_for_sure() -> None:
    """close() gives pending writes their grace, then stops the retry loop and returns only once it has
    stopped (it cancels until the loop ends: a cancel lost inside a Redis command under Python 3.11 would
    leave it retrying, common/runtime/tasks.py). Redis here: a port nothing listens on."""
    from common.cluster.record_writer import RecordWriter
    from tests.support.cluster import free_port

    async def body() -> None:
        store = ClusterState.from_url(f"redis://127.0.0.1:{free_port()}/0")
        writer = RecordWriter(store.records)
        try:
            await writer.create("r", route="split")  # refused: kept, and retried in the background
            assert writer.pending == 1 and writer._task is not None
            retries = writer._task
            async with asyncio.timeout(10):
                await writer.close(timeout_s=0.3)
            assert retries.done() and writer.pending == 1  # stopped; the write never landed
        finally:
            await store.close()

    asyncio.run(body())


def test_a_sentinel_url_finds_the_master(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """redis+sentinel://host:port/service/db against a real Sentinel (the same redis-server binary, in
    sentinel mode) watching a real master."""
    import subprocess

    import redis as sync_redis

    from common.cluster.redis_server import RedisServer, find_redis_server_binary
    from common.cluster.state import connect
    from tests.support.cluster import free_port

    master = RedisServer().start()
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor splitserve 127.0.0.1 {master.port} 1\n")
    sentinel = subprocess.Popen(
        [find_redis_server_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                sync_redis.Redis(port=port).ping()
                break
            except sync_redis.ConnectionError:
                assert time.monotonic() < deadline, "sentinel did not start"
                time.sleep(0.1)

        async def body() -> None:
            store = ClusterState.from_url(f"redis+sentinel://127.0.0.1:{port}/splitserve/3", prefix="s:")
            try:
                await store.records.create("r1", route="split")
                rec = await store.records.get("r1")
                assert rec is not None and rec["state"] is S.QUEUED
            finally:
                await store.close()
            assert sync_redis.Redis(port=master.port, db=3).exists("s:req:r1")  # db 3 of the master

        asyncio.run(body())
        with pytest.raises(ValueError, match="names its sentinels and the service"):
            connect("redis+sentinel://127.0.0.1:1")
    finally:
        sentinel.kill()
        sentinel.wait()
        master.stop()


def test_a_dead_routers_live_requests_are_failed_by_another_router(redis_url: str) -> None:
    async def body(store: ClusterState) -> None:
        from common.cluster.owners import RouterOwnership

        dead = RouterOwnership(store.redis, store.prefix, "router-a", store.records, ttl_s=0.3)
        alive = RouterOwnership(store.redis, store.prefix, "router-b", store.records, ttl_s=5)
        for rid in ("live", "ended", "expired"):
            await store.records.create(rid, owned_by=dead.owned_set, router_id="router-a")
        await store.records.transition("live", S.RESERVED, decode_id="decode-0")
        await store.records.transition("ended", S.CANCELLED)
        await store.redis.delete(store.records.key("expired"))  # a record that has gone meanwhile
        assert await alive.sweep() == 0  # router-a's key is still there: its requests are its own
        assert (await store.records.get("live"))["state"] is S.RESERVED  # type: ignore[index]
        await asyncio.sleep(0.4)  # router-a stops heartbeating: its key expires
        assert await alive.sweep() == 1
        live, ended = await store.records.get("live"), await store.records.get("ended")
        assert live is not None and live["state"] is S.FAILED and "router router-a stopped" in live["error"]
        assert ended is not None and ended["state"] is S.CANCELLED  # an end is final
        assert not await store.redis.exists(f"{store.prefix}owned:router-a")
        assert await store.redis.smembers(f"{store.prefix}routers") == set()
        assert await alive.sweep() == 0  # nothing twice
        # A request joins its router's set with its record and leaves it with its end: nothing left to
        # sweep after it.
        await store.records.create("r2", owned_by=alive.owned_set, router_id="router-b")
        assert await store.redis.smembers(f"{store.prefix}owned:router-b") == {"r2"}
        assert await store.redis.pttl(f"{store.prefix}router:router-b") > 0  # refreshed with it
        await store.records.transition("r2", S.CANCELLED, leave=alive.owned_set)
        assert await store.redis.smembers(f"{store.prefix}owned:router-b") == set()
        assert await store.redis.smembers(f"{store.prefix}routers") == {"router-b"}
        # A refused create joins nothing (the id is someone else's record); a refused end still leaves.
        with pytest.raises(DuplicateRequest):
            await store.records.create("r2", owned_by=alive.owned_set)
        assert await store.redis.smembers(f"{store.prefix}owned:router-b") == set()
        await store.records.create("r3", owned_by=alive.owned_set)
        await store.records.transition("r3", S.FAILED, error="swept meanwhile")
        with pytest.raises(IllegalTransition):
            await store.records.transition("r3", S.CANCELLED, leave=alive.owned_set)
        assert await store.redis.smembers(f"{store.prefix}owned:router-b") == set()
        assert (await store.records.get("r3"))["state"] is S.FAILED  # type: ignore[index]

    run_with_store(redis_url, body)


def test_a_full_connection_pool_makes_commands_wait_not_fail(redis_url: str) -> None:
    """More commands at once than the pool has connections (two here, ?max_connections=2; 100 by default)
    wait for one to be free: redis-py's default pool raised MaxConnectionsError, which every caller
    takes for Redis being away (common/cluster/state.py `connect`)."""

    async def main() -> list[Any]:
        client = connect(redis_url.rstrip("/") + "/0?max_connections=2")
        try:
            # each BLPOP holds its connection for 0.2 s: six need three rounds of the two connections
            key = f"test:{uuid.uuid4().hex}"
            return await asyncio.gather(*(client.blpop([f"{key}:{i}"], timeout=0.2) for i in range(6)))
        finally:
            await client.aclose()

    assert asyncio.run(main()) == [None] * 6
