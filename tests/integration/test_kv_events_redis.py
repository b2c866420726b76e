"""KV events through a real Redis (the session's `redis_url`): a block manager's prefix cache, its
publisher, and a router-side KVIndex that must end up holding exactly the block manager's hashes, also
after a late start, a trimmed stream, a lost entry and a worker restart.

Each test runs its body with asyncio.run under its own uuid key prefix, as tests/integration/
test_state.py does. Publishers are flushed by hand (their own task ticks once an hour) and indexes
polled by hand, so every step is deterministic; a few tests run the index's task for real (its
blocking XREAD: woken by an entry, few reads when idle).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
import redis.exceptions

from common.cluster.kv_events import (
    FORMAT,
    KVEvent,
    KVEventPublisher,
    KVIndex,
    TierMatch,
    snapshot_key,
    socket_timeout_s,
    stream_key,
)
from common.cluster.state import connect
from common.kv.block_manager import BlockManager
from common.prefix_hash import prefix_chain
from tests.support.block_owner import Owner

BS = 2  # tokens per block
HOUR = 3600.0  # a task interval that never comes around during a test


def run(redis_url: str, body: Callable[[aioredis.Redis, str], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        client = connect(redis_url)
        try:
            return await body(client, f"test:{uuid.uuid4().hex}:")
        finally:
            await client.aclose()

    return asyncio.run(main())


def event_queue() -> tuple[list[KVEvent], Callable[[], list[KVEvent]]]:
    """A list a test appends events to, and a publisher source that drains it."""
    pending: list[KVEvent] = []

    def source() -> list[KVEvent]:
        events = list(pending)
        pending.clear()
        return events

    return pending, source


def worker(client: aioredis.Redis, prefix: str, num_blocks: int, incarnation: str = "inc-a", **kwargs: Any):  # type: ignore[no-untyped-def]
    """A block manager with events on, and its publisher as worker w0 (not started)."""
    bm = BlockManager(num_blocks, BS)
    bm.enable_kv_events()
    kwargs = {"interval_s": HOUR, "snapshot_s": HOUR, **kwargs}
    pub = KVEventPublisher(
        client, prefix, "w0", incarnation, BS, bm.drain_kv_events, bm.cached_hashes, **kwargs
    )
    return bm, pub


def compute(bm: BlockManager, tokens: list[int], keep: bool = False) -> list[int]:
    """Prefill `tokens` (commit their full blocks), free them unless `keep`; returns their chain."""
    o = Owner(list(tokens))
    bm.allocate(o)
    bm.commit(o, len(tokens))
    if not keep:
        bm.free(o)
    return prefix_chain(tokens, BS)


async def until(cond: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def poll_until(index: KVIndex, cond: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the index did not get there in time"
        await index.poll()
        await asyncio.sleep(0.005)


def held(index: KVIndex, worker_id: str = "w0") -> set[int]:
    return set(index.workers[worker_id].hashes)


def test_events_reach_the_index_and_eviction_removes(redis_url: str) -> None:
    """Both tasks running: commits show up in the index, evictions leave it."""

    async def body(client: aioredis.Redis, prefix: str) -> None:
        bm, pub = worker(client, prefix, num_blocks=4, interval_s=0.01, snapshot_s=0.2)
        index = KVIndex(client, prefix, poll_s=0.01)
        index.set_workers([("w0", "inc-a", BS)])
        await pub.start()
        await index.start()
        try:
            a = compute(bm, [1, 2, 3, 4, 5])  # two full blocks
            await until(lambda: index.matched_blocks("w0", a) == 2)
            b = compute(bm, [6, 7, 8, 9, 10, 11, 12, 13])  # four blocks: evicts both of a's
            await until(lambda: index.matched_blocks("w0", b) == 4 and index.matched_blocks("w0", a) == 0)
            assert held(index) == set(bm.hash_to_block) == set(b)
            assert index.events_applied >= 8 and index.resyncs == 1 and index.errors == 0
            assert 0 <= index.lag_s < 5
        finally:
            await index.stop()
            await pub.stop()
        assert not await client.exists(stream_key(prefix, "w0"), snapshot_key(prefix, "w0"))

    run(redis_url, body)


def test_matched_blocks_counts_leading_blocks_only(redis_url: str) -> None:
    async def body(client: aioredis.Redis, prefix: str) -> None:
        pending, source = event_queue()

        pub = KVEventPublisher(client, prefix, "w0", "inc-a", 16, source, list, interval_s=HOUR)
        index = KVIndex(client, prefix)
        index.set_workers([("w0", "inc-a", 16)])
        await pub.start()
        pending.extend([(True, 1, "device"), (True, 3, "device"), (True, 4, "device")])
        await pub.flush()
        await poll_until(index, lambda: held(index) == {1, 3, 4})
        assert index.matched_blocks("w0", [1, 2, 3, 4]) == 1, "a hole ends the match"
        assert index.matched_blocks("w0", [2, 3, 4]) == 0
        assert index.matched_blocks("w0", [1]) == 1 and index.matched_blocks("w0", []) == 0
        assert index.matched_blocks("unknown", [1]) == 0
        assert index.block_size("w0") == 16 and index.block_size("unknown") is None
        pending.extend([(True, 2, "device"), (False, 4, "device")])
        await pub.flush()
        await poll_until(index, lambda: index.matched_blocks("w0", [1, 2, 3, 4]) == 3)
        index.set_workers([])  # gone from the registry: dropped
        assert index.matched_blocks("w0", [1]) == 0 and not index.workers
        await pub.stop()

    run(redis_url, body)


def test_a_late_index_catches_up_from_snapshot_and_stream(redis_url: str) -> None:
    """A router that starts (or restarts) after the worker: the snapshot, then the entries after it."""

    async def body(client: aioredis.Redis, prefix: str) -> None:
        bm, pub = worker(client, prefix, num_blocks=16)
        await pub.start()
        a = compute(bm, [1, 2, 3, 4], keep=True)
        await pub.flush()  # entry 1
        await pub.write_snapshot()  # a: in the snapshot (seq 1)
        b = compute(bm, [7, 8, 9, 10, 11, 12], keep=True)
        await pub.flush()  # entry 2: b, only in the stream

        index = KVIndex(client, prefix)
        index.set_workers([("w0", "inc-a", BS)])
        await index.poll()  # one poll: the sync and the stream after it
        assert held(index) == set(a) | set(b) == set(bm.hash_to_block)
        assert index.resyncs == 1 and index.events_applied == len(b) and index.workers["w0"].seq == 2
        await pub.stop()

    run(redis_url, body)


def test_a_trimmed_stream_resyncs_from_the_snapshot(redis_url: str) -> None:
    """A reader left behind a stream trimmed past it sees the gap in seq and loads a newer snapshot
    (the publisher writes one every maxlen/2 entries, so one newer than the stream's tail exists)."""

    async def body(client: aioredis.Redis, prefix: str) -> None:
        bm, pub = worker(client, prefix, num_blocks=20, maxlen=10)
        index = KVIndex(client, prefix, resync_s=0.05)
        index.set_workers([("w0", "inc-a", BS)])
        await pub.start()
        await index.poll()  # synced at seq 0
        for i in range(300):  # one entry each; the cache of 20 blocks keeps evicting
            compute(bm, [i, i + 1000])
            await pub.flush()
        assert pub.seq == 300 and await client.xlen(stream_key(prefix, "w0")) < 300, "not trimmed"
        await poll_until(index, lambda: index.workers["w0"].seq == 300)
        assert held(index) == set(bm.hash_to_block) and len(held(index)) == 20
        assert index.resyncs == 2
        await pub.stop()

    run(redis_url, body)


def test_a_lost_entry_resyncs_from_the_next_snapshot(redis_url: str) -> None:
    """An entry Redis did not take is lost; its seq is used up, so readers see the gap, and the next
    tick that reaches Redis writes a snapshot covering it."""

    async def body(client: aioredis.Redis, prefix: str) -> None:
        bm, pub = worker(client, prefix, num_blocks=16)
        index = KVIndex(client, prefix, resync_s=0.05)
        index.set_workers([("w0", "inc-a", BS)])
        await pub.start()
        a = compute(bm, [1, 2, 3, 4])
        await pub.flush()
        await poll_until(index, lambda: held(index) == set(a))

        async def down(*args: Any, **kwargs: Any) -> Any:
            raise redis.exceptions.ConnectionError("Redis is away")

        pub.redis.xadd = down  # type: ignore[method-assign]
        b = compute(bm, [5, 6, 7, 8])
        try:
            await pub.flush()
        except redis.exceptions.ConnectionError:
            pass
        else:
            raise AssertionError("the flush should have failed")
        del pub.redis.xadd  # Redis is back
        c = compute(bm, [9, 10])
        await pub.flush()  # entry 3 after entry 1, and a snapshot
        await poll_until(index, lambda: held(index) == set(a) | set(b) | set(c))
        assert held(index) == set(bm.hash_to_block) and index.resyncs == 2
        await pub.stop()

    run(redis_url, body)


def test_a_restarted_worker_drops_the_old_hashes(redis_url: str) -> None:
    """A worker that restarts (new incarnation) holds nothing: its publisher's start clears the stream
    and the snapshot. The index drops the old hashes when it reads the new incarnation's entries, and
    when the registry says so; then it follows the new incarnation."""

    async def body(client: aioredis.Redis, prefix: str) -> None:
        bm, pub = worker(client, prefix, num_blocks=16)
        index = KVIndex(client, prefix, resync_s=0.05)
        index.set_workers([("w0", "inc-a", BS)])
        await pub.start()
        a = compute(bm, [1, 2, 3, 4])
        await pub.flush()
        await poll_until(index, lambda: index.matched_blocks("w0", a) == 2)
        await pub.stop(delete=False)  # the process dies

        bm2, pub2 = worker(client, prefix, num_blocks=16, incarnation="inc-b")
        await pub2.start()
        c = compute(bm2, [1, 2, 5, 6])  # shares a's first block
        await pub2.flush()
        # the registry still says inc-a: the new incarnation's entries end the old hashes
        await poll_until(index, lambda: not held(index))
        assert index.matched_blocks("w0", a) == 0
        index.set_workers([("w0", "inc-b", BS)])  # the registry caught up
        await poll_until(index, lambda: index.matched_blocks("w0", c) == 2)
        assert held(index) == set(c) and index.matched_blocks("w0", a) == 1
        await pub2.stop()

    run(redis_url, body)


def blocked_reads(info: list[dict[str, Any]], name: str) -> int:
    """How many of the connections named `name` (CLIENT LIST) wait in an XREAD BLOCK."""
    return sum(c["name"] == name and c["cmd"] == "xread" and "b" in c["flags"] for c in info)


async def until_blocked(client: aioredis.Redis, name: str, timeout_s: float = 10.0) -> None:
    """Until Redis shows the index's read waiting on the streams (the sync and first read are done)."""
    deadline = time.monotonic() + timeout_s
    while not blocked_reads(await client.client_list(), name):
        assert time.monotonic() < deadline, "the index's read never blocked"
        await asyncio.sleep(0.01)


def count_xreads(client: aioredis.Redis) -> list[int]:
    """Count the XREADs sent through this client (its own calls only: other tests' clients on the
    shared server, a router's index among them, cannot add to it); the count is the list's one item."""
    calls = [0]
    xread = client.xread

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await xread(*args, **kwargs)

    client.xread = counted  # type: ignore[method-assign]
    return calls


def index_client(redis_url: str, name: str, **kwargs: Any) -> aioredis.Redis:
    """A client like the router's (state.connect) whose connections are named, for CLIENT LIST."""
    return aioredis.Redis.from_url(redis_url, decode_responses=True, client_name=name, **kwargs)


def test_a_blocked_read_wakes_on_an_entry_and_stop_cancels_it(redis_url: str) -> None:
    """The index's task waits in XREAD BLOCK (a long one here); an entry published meanwhile is applied
    at once, well before the block time; the pool still answers others while the read waits; stop
    cancels the read (and its connection goes away) without waiting for the block to end."""
    block_s = 60.0

    async def body(client: aioredis.Redis, prefix: str) -> None:
        pending, source = event_queue()

        name = f"kvindex-{uuid.uuid4().hex[:8]}"
        reader = index_client(redis_url, name, socket_timeout=2 * block_s)  # room for the whole block
        pub = KVEventPublisher(client, prefix, "w0", "inc-a", 16, source, list, interval_s=HOUR)
        index = KVIndex(reader, prefix, block_s=block_s)
        assert index.block_s == block_s
        index.set_workers([("w0", "inc-a", 16)])
        await pub.start()
        await index.start()
        try:
            await until_blocked(client, name)
            assert await reader.ping(), "the pool answers while the index's read is blocked"
            pending.extend([(True, 1, "device"), (True, 2, "device")])
            await pub.flush()
            await until(lambda: held(index) == {1, 2}, timeout_s=block_s / 6)
            pending.append((False, 1, "device"))
            await pub.flush()
            await until(lambda: held(index) == {2}, timeout_s=block_s / 6)
            await until_blocked(client, name)  # back to waiting
        finally:
            started = time.monotonic()
            await index.stop()
            stopped_s = time.monotonic() - started
            await pub.stop()
        assert stopped_s < block_s / 6, f"stop waited {stopped_s:.1f} s for the blocked read"
        deadline = time.monotonic() + 10
        while blocked_reads(await client.client_list(), name):  # the cancelled read's connection closes
            assert time.monotonic() < deadline, "the cancelled read still waits in Redis"
            await asyncio.sleep(0.01)
        assert index.errors == 0 and index.resyncs == 1 and index.events_applied == 3
        await reader.aclose()

    run(redis_url, body)


def test_an_idle_index_sends_few_xreads(redis_url: str) -> None:
    """Over ~1 s with nothing published, the index with its defaults (XREAD BLOCK 1 s) sends one or two
    XREADs; read without blocking (block_s=0, every poll_s: how it read before) it sends about 20."""
    window_s = 1.0

    async def idle_reads(client: aioredis.Redis, prefix: str, **kwargs: Any) -> int:
        name = f"kvindex-{uuid.uuid4().hex[:8]}"
        reader = index_client(redis_url, name)
        calls = count_xreads(reader)
        index = KVIndex(reader, prefix, **kwargs)
        index.set_workers([("w0", "inc-a", 16)])
        await index.start()
        try:
            await until(lambda: index.resyncs == 1)
            if index.block_s:
                await until_blocked(client, name)
            before = calls[0]
            await asyncio.sleep(window_s)  # the idle window measured, not a timing assertion
            sent = calls[0] - before
        finally:
            await index.stop()
            await reader.aclose()
        assert index.errors == 0
        return sent

    async def body(client: aioredis.Redis, prefix: str) -> tuple[int, int]:
        pub = KVEventPublisher(client, prefix, "w0", "inc-a", 16, list, list, interval_s=HOUR)
        await pub.start()  # an empty snapshot and no entries: nothing to read
        try:
            blocking = await idle_reads(client, prefix)
            polling = await idle_reads(client, prefix, block_s=0)
        finally:
            await pub.stop()
        return blocking, polling

    blocking, polling = run(redis_url, body)
    print(f"XREADs over {window_s} s idle: {blocking} blocking, {polling} polling every 50 ms")
    assert blocking <= 5, f"{blocking} XREADs in {window_s} s idle"
    assert polling >= 5, f"the count is off: {polling} XREADs polling every 50 ms"  # the measure works


def test_the_block_stays_under_the_socket_timeout(redis_url: str) -> None:
    """A client with a socket timeout (here from the URL) bounds every reply, a blocked XREAD's too:
    the index blocks for half of it at most, and such a read ends without an error."""

    async def body(client: aioredis.Redis, prefix: str) -> None:
        sep = "&" if "?" in redis_url else "?"
        timed = connect(f"{redis_url}{sep}socket_timeout=1.2")  # 0.6 s to spare on a loaded machine
        try:
            index = KVIndex(timed, prefix)
            assert index.block_s == 0.6
            assert socket_timeout_s(timed) == 1.2
            plain = aioredis.Redis()  # redis-py's defaults (never connects): 5 s since its version 8
            default = socket_timeout_s(plain)
            assert default in (None, 5.0), default
            assert KVIndex(plain, prefix).block_s == 1.0  # under either default
            assert KVIndex(plain, prefix, block_s=60).block_s == (default / 2 if default else 60)
            await plain.aclose()
            pub = KVEventPublisher(client, prefix, "w0", "inc-a", 16, list, list, interval_s=HOUR)
            await pub.start()
            index.set_workers([("w0", "inc-a", 16)])
            await index.poll()  # the sync
            for _ in range(3):
                await index.poll(block_ms=round(index.block_s * 1000))  # nothing comes: a full block
            assert index.resyncs == 1 and not held(index)
            await pub.stop()
        finally:
            await timed.aclose()

    run(redis_url, body)


def test_workers_added_while_the_index_waits_are_followed(redis_url: str) -> None:
    """With no worker to read, the index's wait ends when set_workers adds one (here the block is far
    longer than the deadline); with a read blocked on other workers, a worker added meanwhile is
    synced and read once that read ends, within the block time (1 s here)."""

    async def body(client: aioredis.Redis, prefix: str) -> None:
        queues = {w: event_queue() for w in ("w0", "w1")}
        pending = {w: q[0] for w, q in queues.items()}

        def publisher(worker_id: str) -> KVEventPublisher:
            source = queues[worker_id][1]
            return KVEventPublisher(client, prefix, worker_id, "inc-a", 16, source, list, interval_s=HOUR)

        pubs = [publisher("w0"), publisher("w1")]
        for pub, h in zip(pubs, (1, 2), strict=True):
            await pub.start()  # an empty snapshot
            pending[pub.worker_id].append((True, h, "device"))
            await pub.flush()  # then one entry
        waiting, blocked = KVIndex(client, prefix, block_s=60), KVIndex(client, prefix, block_s=1)
        blocked.set_workers([("w0", "inc-a", 16)])
        await waiting.start()
        await blocked.start()
        try:
            await until(lambda: held(blocked, "w0") == {1})
            await asyncio.sleep(0.1)  # nothing to do: waits (no deadline to hold)
            waiting.set_workers([("w0", "inc-a", 16)])
            await until(lambda: held(waiting, "w0") == {1}, timeout_s=10)
            blocked.set_workers([("w0", "inc-a", 16), ("w1", "inc-a", 16)])
            await until(lambda: held(blocked, "w1") == {2}, timeout_s=10)
            assert held(blocked, "w0") == {1} and blocked.resyncs == 2 and blocked.errors == 0
            assert waiting.errors == 0
        finally:
            await waiting.stop()
            await blocked.stop()
            for pub in pubs:
                await pub.stop()

    run(redis_url, body)


def test_tiers_travel_in_entries_and_snapshots_and_later_formats_are_refused(redis_url: str) -> None:
    """Format 2: a hash moved from the pool to RAM is held in RAM, not gone, by a reader of the stream
    and by one that syncs from the snapshot; a format-1 snapshot still reads (device only); a later
    format is refused (nothing held) rather than misread."""

    async def body(client: aioredis.Redis, prefix: str) -> None:
        pending, source = event_queue()
        now: list[tuple[int, str]] = []  # what the worker holds, for its snapshots
        pub = KVEventPublisher(client, prefix, "w0", "inc-a", BS, source, lambda: list(now), interval_s=HOUR)
        await pub.start()
        following = KVIndex(client, prefix)
        following.set_workers([("w0", "inc-a", BS)])
        await following.poll()  # synced from the empty snapshot: reads the stream from here on
        pending.extend([(True, 1, "device"), (True, 2, "device")])
        pending.extend([(False, 2, "device"), (True, 2, "ram"), (True, 3, "disk")])  # 2 evicted to RAM
        now[:] = [(1, "device"), (2, "ram"), (3, "disk")]
        await pub.flush()
        fields = (await client.xrange(stream_key(prefix, "w0")))[-1][1]
        assert fields["v"] == str(FORMAT) and {"s", "r", "s.ram", "s.disk"} <= set(fields)
        await poll_until(following, lambda: following.matched("w0", [1, 2, 3]) == TierMatch(1, 1, 1))
        await pub.write_snapshot()
        late = KVIndex(client, prefix)
        late.set_workers([("w0", "inc-a", BS)])
        await late.poll()
        assert late.matched("w0", [1, 2, 3]) == TierMatch(1, 1, 1) and late.resyncs == 1

        snap = msgspec.json.decode(await client.get(snapshot_key(prefix, "w0")))
        assert snap["version"] == FORMAT and set(snap["tiers"]) == {"ram", "disk"}
        old = {k: v for k, v in snap.items() if k not in ("version", "tiers")}  # a format-1 worker's
        await client.set(snapshot_key(prefix, "w0"), msgspec.json.encode(old))
        v1 = KVIndex(client, prefix)
        v1.set_workers([("w0", "inc-a", BS)])
        await v1.poll()
        assert v1.matched("w0", [1, 2, 3]) == TierMatch(1, 0, 0) and v1.refused == 0
        await client.set(snapshot_key(prefix, "w0"), msgspec.json.encode({**snap, "version": FORMAT + 1}))
        later = KVIndex(client, prefix)
        later.set_workers([("w0", "inc-a", BS)])
        await later.poll()
        assert later.matched_blocks("w0", [1]) == 0 and later.refused == 1 and not later.workers["w0"].synced
        await pub.stop()

    run(redis_url, body)
