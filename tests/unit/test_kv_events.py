"""KV events from the block manager (what enters and leaves the prefix cache), and the encoding the
publisher puts them in. No Redis here: tests/integration/test_kv_events_redis.py carries them through one."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from common.cluster.kv_events import net_changes, pack_hashes, unpack_hashes
from common.kv.block_manager import BlockManager
from common.prefix_hash import prefix_chain
from tests.support.block_owner import Owner, owner_op


def computed(bm: BlockManager, tokens: list[int]) -> Owner:
    """A sequence allocated and computed to its end (its full blocks committed)."""
    o = Owner(list(tokens))
    bm.allocate(o)
    bm.commit(o, len(tokens))
    return o


def test_commit_records_stored_hashes() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.enable_kv_events()
    a = computed(bm, [1, 2, 3, 4, 5])
    chain = prefix_chain(a.token_ids, 2)
    assert bm.drain_kv_events() == [(True, h, "device") for h in chain]
    assert bm.drain_kv_events() == [], "a drain empties the buffer"
    # a prefix hit commits nothing new; freeing keeps the blocks cached, so it records nothing either
    b = computed(bm, [1, 2, 3, 4, 9])
    bm.free(a)
    bm.free(b)
    assert bm.drain_kv_events() == []
    assert sorted(bm.cached_hashes()) == sorted((h, "device") for h in chain)
    bm.check_integrity()


def test_eviction_records_removed_hashes() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.enable_kv_events()
    a = computed(bm, [1, 2, 3, 4])
    bm.free(a)
    old = prefix_chain([1, 2, 3, 4], 2)
    assert bm.drain_kv_events() == [(True, h, "device") for h in old]
    b = computed(bm, [5, 6, 7, 8, 9, 10, 11, 12])  # needs all 4 blocks: evicts both cached ones
    events = bm.drain_kv_events()
    # the tail is freed first, so it is the least recently used: evicted first
    assert events[:2] == [(False, old[1], "device"), (False, old[0], "device")]
    assert events[2:] == [(True, h, "device") for h in prefix_chain(b.token_ids, 2)]
    assert {h for h, _ in bm.cached_hashes()} == set(prefix_chain(b.token_ids, 2))
    bm.check_integrity()


def test_events_are_off_by_default() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.free(computed(bm, [1, 2, 3, 4]))
    computed(bm, [5, 6, 7, 8])  # evicts
    assert bm.kv_events is None and bm.drain_kv_events() == []


def test_hashes_pack_and_net_changes() -> None:
    hashes = [0, -1, 2**63 - 1, -(2**63), 12345]
    assert unpack_hashes(pack_hashes(hashes)) == hashes
    assert unpack_hashes(pack_hashes([])) == []
    # each hash's last event wins: stored then removed is removed, removed then stored is stored
    d = "device"
    events = [(True, 1, d), (False, 1, d), (False, 2, d), (True, 2, d), (True, 3, d), (False, 4, d)]
    assert net_changes(events) == {d: ([2, 3], [1, 4])}
    # per tier: a block leaving the pool for RAM is removed from one and stored in the other
    moved = [(True, 5, d), (False, 5, d), (True, 5, "ram"), (True, 6, "disk"), (False, 6, "disk")]
    assert net_changes(moved) == {d: ([], [5]), "ram": ([5], []), "disk": ([], [6])}
    assert net_changes([]) == {}


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "commit", "free", "drain"]),
        st.integers(0, 5),  # which owner
        st.lists(st.integers(0, 3), min_size=1, max_size=12),  # tokens (small alphabet: prefix hits)
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 10), block_size=st.integers(1, 3))
def test_replayed_events_equal_the_hash_index(ops, num_blocks, block_size) -> None:  # type: ignore[no-untyped-def]
    """Events drained at any points and replayed onto a set (in order; or as each drain's net changes,
    as the publisher sends them) give exactly the block manager's hash index."""
    bm = BlockManager(num_blocks, block_size)
    bm.enable_kv_events()
    replayed: set[int] = set()
    netted: set[int] = set()

    def drain() -> None:
        events = bm.drain_kv_events()
        for stored, h, tier in events:
            assert tier == "device", "no offload tier here"
            if stored:
                replayed.add(h)
            else:
                replayed.discard(h)
        stored, removed = net_changes(events).get("device", ([], []))
        netted.update(stored)
        netted.difference_update(removed)

    owners: dict[int, Owner] = {}
    for op, who, toks in ops:
        o = owners.get(who)
        if owner_op(bm, owners, op, who, toks):
            pass  # append, commit, free: alike in every block-manager property test
        elif op == "alloc" and o is None:
            o = Owner(list(toks))
            if bm.can_allocate(o):
                bm.allocate(o)
                owners[who] = o
        elif op == "drain":
            drain()
            assert replayed == netted == set(bm.hash_to_block) == {h for h, _ in bm.cached_hashes()}
    drain()
    assert replayed == netted == set(bm.hash_to_block) == {h for h, _ in bm.cached_hashes()}
    bm.check_integrity()
