"""KV events name the tier (issue 32, point 3): a tier publishes a block hash only once a read can
return it, and removes it when it lets go of it; the block manager drains them with its own; the
router's index keeps each hash's tiers and matches a prompt the way the engine reuses it. No Redis here
(tests/integration/test_kv_events_redis.py carries the stream through one)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from common.cluster.kv_events import FORMAT, KVIndex, TierMatch, net_changes, pack_hashes
from common.kv import tiers
from common.kv.block_manager import BlockManager
from common.kv.tiers import TierStore
from common.prefix_hash import ROOT, prefix_chain
from tests.support.block_owner import Owner
from tests.unit.test_kv_tiers import BB, BS, DIGEST, StuckDisk, blocks, encode, put, store


def readable(s: TierStore) -> set[tuple[int, str]]:
    """(hash, tier) of every block a read of that tier alone returns, verified."""
    out = set()
    for h, name in s.held():
        tier = s.ram if name == "ram" else s.disk
        assert tier is not None
        key, i = tier.where[h]
        chunk = tier.chunks[key]
        if s._read_chunk(tier, chunk) is not None:
            out.add((h, name))
    return out


def replay(events: Sequence[tuple[bool, int, str]], into: set[tuple[int, str]]) -> set[tuple[int, str]]:
    for stored, h, tier in events:
        (into.add if stored else into.discard)((h, tier))
    return into


def test_ram_events_follow_what_a_read_returns() -> None:
    s = store(ram_blocks=2)
    s.enable_events()
    try:
        a, _ = put(s, 100)
        assert s.drain_events() == [(True, a[0], "ram")]
        b, _ = put(s, 200)
        c, _ = put(s, 300)  # over the limit: the least recently used (100) goes
        assert s.drain_events() == [(True, b[0], "ram"), (False, a[0], "ram"), (True, c[0], "ram")]
        put(s, 0, n=3)  # larger than the tier: not stored, so not published
        assert s.drain_events() == []
        assert set(s.held()) == readable(s) == {(b[0], "ram"), (c[0], "ram")}
    finally:
        s.close()


def test_disk_events_only_past_the_reuse_filter_and_removed_when_a_read_fails(tmp_path: Path) -> None:
    s = store(tmp_path, disk_blocks=8)
    s.enable_events()
    try:
        put(s, 0, n=2)  # seen once: kept off the disk, nothing published
        assert s.drain_events() == []
        hashes, toks = put(s, 0, n=2, times=1)  # the second sighting: stored
        assert s.drain_events() == [(True, h, "disk") for h in hashes]
        (path,) = list(s.slot.glob("*.kv"))  # type: ignore[union-attr]
        path.write_bytes(path.read_bytes()[:-7])  # truncated under the store
        assert s.read(hashes, toks) == []
        assert s.drain_events() == [(False, h, "disk") for h in hashes]
        assert s.held() == []
    finally:
        s.close()


def test_quiet_keys_are_held_and_read_but_never_announced(tmp_path: Path) -> None:
    """A layer group's pages after the first are offered quiet (keys no prompt's hash is): RAM and disk
    hold them and a read returns them, but no event and no snapshot names them, also once a prefetch
    promotes them from the disk back into RAM."""
    s = store(tmp_path, ram_blocks=2, disk_blocks=8)
    s.enable_events()
    try:
        hashes, toks, payload = blocks(100, 2)
        loud, quiet = hashes
        for h in hashes + hashes:  # evicted twice: past the disk's reuse filter
            s.wants(h)
        assert s.offer(hashes, toks, payload, quiet=[quiet]) and s.wait_idle(10)
        assert sorted(s.drain_events()) == sorted([(True, loud, "ram"), (True, loud, "disk")])
        assert set(s.held()) == {(loud, "ram"), (loud, "disk")}
        assert len(s.read(hashes, toks)) == 2, "a quiet key is read like any"
        put(s, 500, n=2)  # pushes the chunk out of RAM
        assert s.ram is not None and not s.ram.holds(quiet)
        assert [e for e in s.drain_events() if e[1] in hashes] == [(False, loud, "ram")]
        assert s.prefetch(hashes) and s.wait_prefetched(10)
        assert s.ram.holds(quiet) and s.ram.holds(loud)
        assert [e for e in s.drain_events() if e[1] in hashes] == [(True, loud, "ram")]
        assert {h for h, _ in s.held()} & set(hashes) == {loud}
    finally:
        s.close()


def test_a_dropped_offer_is_never_published(tmp_path: Path) -> None:
    rec = len(encode(DIGEST, BS, *blocks(0, 1)))
    s = StuckDisk(DIGEST, BS, BB, disk_dir=tmp_path, disk_bytes=64 * rec, queue_chunks=1)
    s.enable_events()
    try:
        offered = []
        for first in (0, 100, 200):  # the writer takes one and hangs, one waits, one is dropped
            hashes, toks, payload = blocks(first, 1)
            s.wants(hashes[0])
            s.wants(hashes[0])
            offered.append(s.offer(hashes, toks, payload))
            if first == 0:
                assert s.writing.wait(10)
        assert offered == [True, True, False]
        assert s.drain_events() == [], "nothing is published before it is written"
        s.go.set()
        assert s.wait_idle(10)
        published = {h for _, h, _ in s.drain_events()}
        assert published == {blocks(0, 1)[0][0], blocks(100, 1)[0][0]}, "the dropped one never is"
    finally:
        s.go.set()
        s.close()


class StoreTier:
    """The block manager's OffloadTier over a real TierStore, without torch: a block's "KV" is its id's
    byte, offered at once and waited for (what KVOffload does with a real pool, minus the copy)."""

    def __init__(self, s: TierStore) -> None:
        self.s = s

    def evicted(self, block_id: int, block_hash: int, tokens: tuple[int, ...], publish: bool = True) -> None:
        if self.s.wants(block_hash):
            quiet = () if publish else [block_hash]
            self.s.offer([block_hash], [tokens], memoryview(bytes([block_id % 256]) * BB), quiet)
            assert self.s.wait_idle(10)

    def load(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]], block_ids: Sequence[int]) -> int:
        return len(self.s.read(hashes, tokens))

    def prefetch(self, *runs: Sequence[int]) -> bool:
        return self.s.prefetch(*runs)

    def holds(self, keys: Sequence[int]) -> list[bool]:
        return self.s.holds(keys)

    def enable_events(self) -> None:
        self.s.enable_events()

    def drain_events(self) -> list[tuple[bool, int, str]]:
        return self.s.drain_events()

    def held_hashes(self) -> list[tuple[int, str]]:
        return self.s.held()


def test_a_prefetch_on_arrival_is_read_from_ram_at_admission_and_announced_truthfully(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt whose 3 blocks are on the disk only (offered twice, then pushed out of RAM): the
    block manager's `prefetch` (what the engine calls on arrival) hands the tier the hashes its
    admission asks for; once promoted, the admission reads them from RAM (no disk read on the
    admission's thread), and the drained events, replayed, are what the pool and tiers hold."""
    s = store(tmp_path, ram_blocks=4, disk_blocks=16)
    prompt = list(range(1, 3 * BS + 2))  # 3 full blocks + 1 token
    chain = prefix_chain(prompt, BS, root=ROOT)[:3]
    toks = [tuple(prompt[i * BS : (i + 1) * BS]) for i in range(3)]
    payload = b"".join(bytes([i + 7]) * BB for i in range(3))
    for h in chain + chain:
        s.wants(h)
    assert s.offer(chain, toks, memoryview(payload)) and s.wait_idle(10)
    put(s, 500, n=3)  # offered once: RAM only, and the prompt's chunk leaves RAM for it
    assert s.ram is not None and not any(s.ram.holds(h) for h in chain)
    bm = BlockManager(8, BS)
    bm.tier = StoreTier(s)
    bm.enable_kv_events()
    replayed = set(bm.cached_hashes())
    disk_reads: list[str] = []
    real = tiers._read_file

    def read_file(path: Path) -> bytearray:
        disk_reads.append(threading.current_thread().name)
        return real(path)

    monkeypatch.setattr(tiers, "_read_file", read_file)
    try:
        seq = Owner(prompt)
        assert bm.prefetch(seq)
        assert s.wait_prefetched(10) and disk_reads == ["kv-tier-prefetch"]
        replay(bm.drain_kv_events(), replayed)
        assert replayed == {(h, "device") for h in bm.hash_to_block} | readable(s)
        assert {(h, "ram") for h in chain} <= replayed, "promoted: held by RAM too"
        disk_reads.clear()  # (readable() reads every chunk)
        bm.allocate(seq)
        assert seq.num_cached_tokens == 3 * BS and bm.tier_hits == 3
        assert disk_reads == [], "the admission read RAM"
        assert s.stats().prefetch.in_time == 1
        replay(bm.drain_kv_events(), replayed)
        assert replayed == {(h, "device") for h in bm.hash_to_block} | readable(s)
        assert not bm.prefetch(Owner(prompt)), "the pool holds the prefix now: nothing to bring"
        bm.check_integrity()
    finally:
        s.close()


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "commit", "free", "drain"]),
        st.integers(0, 4),  # which owner
        st.lists(st.integers(0, 2), min_size=1, max_size=10),  # tokens (small alphabet: prefix hits)
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, num_blocks=st.integers(2, 6), ram_blocks=st.integers(1, 4))
def test_replayed_events_equal_what_the_pool_and_tier_hold(ops, num_blocks, ram_blocks) -> None:  # type: ignore[no-untyped-def]
    """Events drained at any point, replayed (or netted, as the publisher sends them), give exactly the
    pool's hash index as "device" and the tier's readable blocks as "ram"."""
    s = store(ram_blocks=ram_blocks)
    bm = BlockManager(num_blocks, BS)
    bm.tier = StoreTier(s)
    bm.enable_kv_events()
    replayed: set[tuple[int, str]] = set()
    netted: set[tuple[int, str]] = set()

    def drain() -> None:
        events = bm.drain_kv_events()
        replay(events, replayed)
        for tier, (stored, removed) in net_changes(events).items():
            netted.update((h, tier) for h in stored)
            netted.difference_update((h, tier) for h in removed)
        held = {(h, "device") for h in bm.hash_to_block} | readable(s)
        assert replayed == netted == held == set(bm.cached_hashes())

    owners: dict[int, Owner] = {}
    try:
        for op, who, toks in ops:
            o = owners.get(who)
            if op == "alloc" and o is None:
                o = Owner([t for t in toks for _ in range(2)])  # runs of equal tokens: whole blocks repeat
                if bm.can_allocate(o):
                    bm.allocate(o)
                    owners[who] = o
            elif op == "commit" and o is not None:
                bm.commit(o, len(o.token_ids))
            elif op == "free" and o is not None:
                bm.free(o)
                del owners[who]
            elif op == "drain":
                drain()
        drain()
        bm.check_integrity()
    finally:
        s.close()


# --- the router's index ---------------------------------------------------------------------------


def index_with(held: dict[int, set[str]]) -> KVIndex:
    index = KVIndex(aioredis.Redis(), "t:")  # never connects: only the memory side is used here
    index.set_workers([("w0", "inc", BS)])
    bits = {"device": 1, "ram": 2, "disk": 4}
    index.workers["w0"].hashes = {h: sum(bits[t] for t in ts) for h, ts in held.items()}
    return index


def test_a_match_follows_the_engine_pool_run_then_tier_run() -> None:
    d, r, k = {"device"}, {"ram"}, {"disk"}
    index = index_with({1: d, 2: d | r, 3: r, 4: k, 5: r | k, 6: d, 7: r})
    assert index.matched("w0", [1, 2, 3, 4, 5, 6, 7]) == TierMatch(2, 2, 1), "stops at the pool's again"
    assert index.matched("w0", [3, 4, 1]) == TierMatch(0, 1, 1)
    assert index.matched("w0", [1, 9, 3]) == TierMatch(1, 0, 0), "a hole ends it"
    # a worker reading no disk hit now (its disk dearer than recomputing): a disk-only block ends it
    assert index.matched("w0", [1, 2, 3, 4, 5], disk=False) == TierMatch(2, 1, 0)
    assert index.matched("w0", [3, 5, 7], disk=False) == TierMatch(0, 3, 0), "RAM's copy is read"
    assert index.matched_blocks("w0", [1, 2, 3, 4, 5]) == 5
    assert index.matched("other", [1]) == TierMatch() and index.matched("w0", []) == TierMatch()


def test_entries_move_a_hash_between_tiers_and_unknown_formats_are_refused() -> None:
    index = index_with({})
    t = index.workers["w0"]
    t.synced = True
    p = pack_hashes
    index._apply("k", t, [("1-0", {"inc": "inc", "seq": "1", "v": str(FORMAT), "s": p([1, 2]), "r": p([])})])
    index._apply("k", t, [("2-0", {"inc": "inc", "seq": "2", "s": p([]), "r": p([2]), "s.ram": p([2])})])
    assert index.matched("w0", [1, 2]) == TierMatch(1, 1, 0), "moved to RAM, not removed"
    index._apply("k", t, [("3-0", {"inc": "inc", "seq": "3", "s": p([]), "r": p([]), "r.ram": p([2])})])
    assert index.matched("w0", [1, 2]) == TierMatch(1, 0, 0) and 2 not in t.hashes
    # a later format, or a field of a tier this reader does not know: nothing held rather than misread
    for fields in ({"v": str(FORMAT + 1)}, {"s.nvme": p([1])}):
        t.synced, t.hashes = True, {1: 1}
        index._apply("k", t, [("4-0", {"inc": "inc", "seq": "4", "s": p([]), "r": p([]), **fields})])
        assert t.hashes == {} and not t.synced and t.refused
    assert index.refused == 2
