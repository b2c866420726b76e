"""common.state against a real Redis server (the session's `redis_url`).

Each test runs its body with asyncio.run and its own uuid key prefix, so tests never see each
other's keys and no asyncio pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from common.state import (
    Heartbeat,
    IllegalTransition,
    RequestState,
    StateStore,
    UnknownRequest,
)

S = RequestState


def run_with_store(redis_url: str, body: Callable[[StateStore], Awaitable[Any]], **kwargs: Any) -> Any:
    async def main() -> Any:
        store = StateStore.from_url(redis_url, prefix=f"test:{uuid.uuid4().hex}:", **kwargs)
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def test_split_path_records_every_transition_in_order(redis_url: str) -> None:
    async def body(store: StateStore) -> None:
        await store.create("r1", router_id="router-0", model="smollm2", route="split", prompt_tokens=12)
        await store.transition("r1", S.RESERVED, decode_id="decode-0")
        await store.transition("r1", S.PREFILLING, prefill_id="prefill-0")
        await store.transition("r1", S.TRANSFERRING)
        await store.transition("r1", S.DECODING)
        await store.transition("r1", S.FINISHED, output_tokens=7, finish_reason="stop")

        rec = await store.get("r1")
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
        assert await store.get("missing") is None

    run_with_store(redis_url, body)


def test_local_prefill_path_skips_prefill_states(redis_url: str) -> None:
    async def body(store: StateStore) -> None:
        await store.create("r1", route="local:short_prompt")
        for state in (S.RESERVED, S.DECODING, S.FINISHED):
            await store.transition("r1", state)
        rec = await store.get("r1")
        assert rec is not None
        assert [s for s, _ in rec["history"]] == [S.QUEUED, S.RESERVED, S.DECODING, S.FINISHED]
        assert "t_prefilling" not in rec and rec["route"] == "local:short_prompt"

    run_with_store(redis_url, body)


def test_illegal_transitions_are_refused_and_leave_the_record_alone(redis_url: str) -> None:
    async def body(store: StateStore) -> None:
        await store.create("r1")
        with pytest.raises(IllegalTransition, match="QUEUED -> DECODING"):
            await store.transition("r1", S.DECODING)
        with pytest.raises(IllegalTransition, match="QUEUED -> FINISHED"):
            await store.transition("r1", S.FINISHED)
        await store.transition("r1", S.CANCELLED, error="client went away")
        # A late FINISHED after CANCELLED must neither succeed nor overwrite anything.
        with pytest.raises(IllegalTransition, match="CANCELLED -> FINISHED") as info:
            await store.transition("r1", S.FINISHED, finish_reason="stop", output_tokens=3)
        assert (info.value.current, info.value.new) == (S.CANCELLED, S.FINISHED)
        rec = await store.get("r1")
        assert rec is not None
        assert rec["state"] is S.CANCELLED and "finish_reason" not in rec and "output_tokens" not in rec
        assert [s for s, _ in rec["history"]] == [S.QUEUED, S.CANCELLED]

        with pytest.raises(UnknownRequest):
            await store.transition("nope", S.RESERVED)
        with pytest.raises(ValueError, match="already exists"):
            await store.create("r1")
        with pytest.raises(ValueError, match="unknown request field"):
            await store.transition("r1", S.FAILED, prompt_tokenz=1)

    run_with_store(redis_url, body)


def test_terminal_state_sets_ttl(redis_url: str) -> None:
    async def body(store: StateStore) -> None:
        await store.create("r1")
        await store.transition("r1", S.RESERVED)
        assert await store.redis.ttl(store._req_key("r1")) == -1  # live records do not expire
        await store.transition("r1", S.FAILED, error="decode died")
        assert 0 < await store.redis.ttl(store._req_key("r1")) <= 120

    run_with_store(redis_url, body, request_ttl_s=120)


def test_concurrent_terminal_transitions_exactly_one_wins(redis_url: str) -> None:
    async def body(store: StateStore) -> None:
        for i in range(20):
            rid = f"r{i}"
            await store.create(rid)
            for state in (S.RESERVED, S.DECODING):
                await store.transition(rid, state)
            targets = [S.FINISHED, S.FAILED, S.CANCELLED] * 3
            results = await asyncio.gather(
                *(store.transition(rid, t) for t in targets), return_exceptions=True
            )
            winners = [t for t, r in zip(targets, results, strict=True) if isinstance(r, float)]
            assert len(winners) == 1, results
            assert all(isinstance(r, (float, IllegalTransition)) for r in results), results
            rec = await store.get(rid)
            assert rec is not None and rec["state"] is winners[0]
            assert [s for s, _ in rec["history"]][-1] is winners[0] and len(rec["history"]) == 4

    run_with_store(redis_url, body)


LOAD = {"running": 0, "waiting": 0, "free_blocks": 100, "total_blocks": 100}


def test_worker_registry_expires_without_heartbeats(redis_url: str) -> None:
    async def body(store: StateStore) -> None:
        await store.register(
            "d0", "decode", "http://127.0.0.1:9001", "tcp://127.0.0.1:9101", {"blocks": 100}, LOAD
        )
        await store.register("p0", "prefill", "http://127.0.0.1:9002", "tcp://127.0.0.1:9102", {}, LOAD)
        [d0] = await store.alive("decode")
        assert (d0.id, d0.role, d0.url, d0.kv_endpoint) == (
            "d0",
            "decode",
            "http://127.0.0.1:9001",
            "tcp://127.0.0.1:9101",
        )
        assert d0.capacity == {"blocks": 100} and d0.load == LOAD and d0.last_seen > 0
        assert [w.id for w in await store.alive("prefill")] == ["p0"]

        assert await store.heartbeat("d0", {**LOAD, "running": 3})
        [d0] = await store.alive("decode")
        assert d0.load["running"] == 3

        await asyncio.sleep(1.5)
        assert await store.alive("decode") == [] and await store.alive("prefill") == []
        # The lazy cleanup dropped the expired ids from the index, and a late heartbeat says so.
        assert await store.redis.smembers(store._index_key("decode")) == set()
        assert not await store.heartbeat("d0", LOAD)

        await store.register("d1", "decode", "http://x", "tcp://x", {}, LOAD)
        await store.deregister("d1")
        assert await store.alive("decode") == []

    run_with_store(redis_url, body, worker_ttl_s=1.0)


def test_heartbeat_keeps_worker_alive_and_reports_load(redis_url: str) -> None:
    async def body(store: StateStore) -> None:
        running = iter(range(1000))
        hb = Heartbeat(
            store, "d0", "decode", "http://127.0.0.1:9001", "tcp://127.0.0.1:9101", {"blocks": 100},
            lambda: {**LOAD, "running": next(running)}, interval_s=0.2,
        )  # fmt: skip
        await hb.start()
        await asyncio.sleep(1.6)  # well past the 1 s TTL
        [d0] = await store.alive("decode")
        assert d0.load["running"] >= 4  # beats happened and carried fresh load
        # A registration lost meanwhile (e.g. Redis restarted) comes back on the next beat.
        await store.redis.delete(store._worker_key("d0"))
        await asyncio.sleep(0.5)
        assert [w.id for w in await store.alive("decode")] == ["d0"]
        await hb.stop()
        assert await store.alive("decode") == []

    run_with_store(redis_url, body, worker_ttl_s=1.0)


def test_leases_acquire_renew_release(redis_url: str) -> None:
    async def body(store: StateStore) -> None:
        assert await store.acquire_lease("r1", "decode", "d0", 0.5, [3, 4, 5])
        assert not await store.acquire_lease("r1", "decode", "d1", 5, [6])  # held by d0
        assert await store.acquire_lease("r1", "decode", "d0", 0.5, [3, 4, 5])  # retry by holder is fine
        assert await store.acquire_lease("r1", "prefill", "p0", 5, [1])  # other side is its own lease
        lease = await store.get_lease("r1", "decode")
        assert (
            lease is not None and (lease.owner, lease.blocks) == ("d0", [3, 4, 5]) and 0 < lease.ttl_s <= 0.5
        )

        assert not await store.renew_lease("r1", "decode", "d1", 5)
        assert await store.renew_lease("r1", "decode", "d0", 5)
        await asyncio.sleep(0.7)  # past the original 0.5 s: only the renewal keeps it
        lease = await store.get_lease("r1", "decode")
        assert lease is not None and lease.ttl_s > 3

        assert not await store.release_lease("r1", "decode", "d1")
        assert await store.release_lease("r1", "decode", "d0")
        assert await store.get_lease("r1", "decode") is None
        assert not await store.renew_lease("r1", "decode", "d0", 5)  # nothing left to renew

        assert await store.acquire_lease("r2", "decode", "d0", 0.2, [7])
        await asyncio.sleep(0.4)
        assert await store.get_lease("r2", "decode") is None  # expired by itself
        assert await store.acquire_lease("r2", "decode", "d1", 5, [7])  # free for someone else
        with pytest.raises(ValueError, match="lease side"):
            await store.acquire_lease("r3", "router", "x", 1, [])

    run_with_store(redis_url, body)
