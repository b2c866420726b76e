"""Block manager invariants under random operation sequences (property-based)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.block_manager import HOLE, BlockManager, block_hash, free_window, live_blocks
from tests.support.block_owner import Owner, owner_op


def test_allocate_free_and_prefix_reuse() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Owner(list(range(10)))  # 3 blocks
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and a.num_cached_tokens == 0
    assert bm.commit(a, 10) and a.num_hashed_blocks == 2  # two full blocks hashed
    b = Owner(list(range(8)) + [99, 98])  # shares the first two blocks
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    a_blocks = list(a.block_table)
    bm.free(a)
    bm.free(b)
    bm.check_integrity()
    assert bm.num_free_blocks == 8 and len(bm.cached_ids) == 2
    # cached blocks are reused by a later identical prefix, and evicted only when needed
    c = Owner(list(range(8)))
    bm.allocate(c)
    # at least one token is always left to compute: the last block is computed again, into a block of
    # its own (the cached one may be read by another sequence: it is never written)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a_blocks[0]
    assert c.block_table[1] != a_blocks[1]
    bm.check_integrity()


def test_eviction_and_out_of_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Owner([1, 2, 3, 4])
    bm.allocate(a)
    bm.commit(a, 4)
    bm.free(a)
    big = Owner(list(range(100, 108)))  # needs all 4 blocks: evicts both cached ones
    assert bm.can_allocate(big)
    bm.allocate(big)
    assert not bm.hash_to_block and bm.num_free_blocks == 0
    assert not bm.can_append(Owner(list(range(100, 109)), big.block_table))
    with pytest.raises(AssertionError, match="out of KV blocks"):
        bm.allocate(Owner([5]))
    bm.check_integrity()


def test_hash_is_chained_and_stable() -> None:
    assert block_hash(-1, [1, 2]) == block_hash(-1, [1, 2])
    assert block_hash(-1, [1, 2]) != block_hash(5, [1, 2])
    assert block_hash(-1, [1, 2]) != block_hash(-1, [2, 1])


def test_double_free_is_caught() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    a = Owner([1])
    bm.allocate(a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError, match="double free"):
        bm.free(a)


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "commit", "free"]),
        st.integers(0, 7),  # which owner
        st.lists(st.integers(0, 3), min_size=1, max_size=12),  # tokens (small alphabet: prefix hits)
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), caching=st.booleans())
def test_invariants_hold_under_random_operations(ops, num_blocks, block_size, caching) -> None:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    owners: dict[int, Owner] = {}
    for op, who, toks in ops:
        o = owners.get(who)
        if owner_op(bm, owners, op, who, toks):
            pass  # append, commit, free: alike in every block-manager property test
        elif op == "alloc" and o is None:
            o = Owner(list(toks))
            if bm.can_allocate(o):
                bm.allocate(o)
                assert len(o.block_table) == bm.blocks_needed(len(toks))
                assert o.num_cached_tokens < len(toks)
                owners[who] = o
        bm.check_integrity()
        held = [b for ow in owners.values() for b in ow.block_table]
        assert bm.num_used == len(set(held))
        # a shared block's ref count equals the number of tables holding it
        for bid in set(held):
            assert bm.blocks[bid].ref_count == held.count(bid)
        # two owners share a block only if they agree on its tokens
        for ow in owners.values():
            for i, bid in enumerate(ow.block_table[: ow.num_hashed_blocks]):
                assert bm.blocks[bid].tokens == tuple(ow.token_ids[i * block_size : (i + 1) * block_size])
    for o in owners.values():
        bm.free(o)
    bm.check_integrity()
    assert bm.num_free_blocks == num_blocks


# --- sliding windows: blocks released once they slid out of every layer's window ---------------------


def test_free_window_only_when_every_layer_slides() -> None:
    assert free_window((16, 16, 8)) == 16
    assert free_window((16, None)) is None  # a full layer reads every block
    assert free_window(()) is None
    with pytest.raises(ValueError, match="at least 1 token"):
        BlockManager(4, 4, window=0)


def test_release_window_leaves_holes_and_returns_the_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False, window=6)
    a = Owner(list(range(30)))  # 8 blocks
    bm.allocate(a)
    table = list(a.block_table)
    # the next query at position 12 sees keys 7..12: block 1 (positions 4..7) is still read
    assert bm.first_live(12) == 1 and bm.release_window(a, 12) == 1
    assert a.block_table == [HOLE, *table[1:]] and bm.num_held(a) == 7
    assert bm.num_free_blocks == 16 - 7 and table[0] in bm.free_ids
    assert bm.release_window(a, 12) == 0  # idempotent
    assert bm.release_window(a, 29) == 5  # keys 24..29: blocks 6 and 7 stay
    assert a.block_table == [HOLE] * 6 + table[6:]
    assert live_blocks(a.block_table) == table[6:]
    bm.check_integrity()
    bm.free(a)  # holes are skipped: no double free, nothing leaks
    bm.check_integrity()
    assert bm.num_free_blocks == 16 and bm.num_used == 0


def test_no_window_releases_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Owner(list(range(30)))
    bm.allocate(a)
    assert bm.first_live(29) == 0 and bm.release_window(a, 29) == 0 and HOLE not in a.block_table


def test_a_released_hashed_block_stays_in_the_prefix_cache() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, window=4)
    a = Owner(list(range(20)))
    bm.allocate(a)
    bm.commit(a, 20)
    first = a.block_table[0]
    bm.release_window(a, 20)  # keys 17..: blocks 0..3 released, hashed: cached, not free
    assert a.block_table[:4] == [HOLE] * 4 and first in bm.cached_ids
    b = Owner(list(range(9)))  # shares blocks 0 and 1 of a's prompt: served from the released blocks
    bm.allocate(b)
    assert b.block_table[0] == first and b.num_cached_tokens == 8
    bm.free(a)
    bm.free(b)
    bm.check_integrity()
    assert bm.num_free_blocks == 16


def test_commit_stops_at_a_hole() -> None:
    """A released block's hash is no longer in the table: the chain ends there, nothing is misfiled."""
    bm = BlockManager(num_blocks=16, block_size=4, window=2)
    a = Owner(list(range(11)))
    bm.allocate(a)
    bm.commit(a, 4)  # block 0 hashed
    bm.release_window(a, 10)  # keys 9..: blocks 0 and 1 released, block 1 never hashed
    assert a.block_table[:2] == [HOLE, HOLE]
    assert bm.commit(a, 11) == [] and a.num_hashed_blocks == 1
    bm.free(a)
    bm.check_integrity()


def test_allocate_with_leading_holes_counts_only_the_window() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, window=8)
    a = Owner(list(range(40)))  # 10 blocks, only 3 of which decoding at 40 reads (keys 33..40)
    first = bm.first_live(40)
    assert first == 8
    assert not bm.can_allocate(a) and bm.can_allocate(a, first=first)
    bm.allocate(a, first=first)
    assert a.block_table[:first] == [HOLE] * first and bm.num_held(a) == 2
    assert a.num_hashed_blocks == 0
    bm.check_integrity()
    with pytest.raises(ValueError, match="leading holes"):  # a hole the next query would read
        bm.can_allocate(Owner(list(range(40))), first=first + 1)
    with pytest.raises(ValueError, match="leading holes"):  # no window: no block may be left out
        BlockManager(8, 4).allocate(Owner(list(range(40))), first=1)
    bm.free(a)
    assert bm.num_free_blocks == 6


def test_allocate_with_holes_takes_prefix_hits_only_past_them() -> None:
    bm = BlockManager(num_blocks=32, block_size=4, window=8)
    a = Owner(list(range(40)))
    bm.allocate(a)
    bm.commit(a, 40)
    b = Owner(list(range(40)) + [7])  # the same prompt and one more token: hits on blocks 0..9
    first = bm.first_live(41)
    bm.allocate(b, first=first)
    assert b.block_table[:first] == [HOLE] * first
    assert b.block_table[first:10] == a.block_table[first:10]  # hits past the holes are shared
    assert b.num_hashed_blocks == 10 and b.num_cached_tokens == 40
    for bid in a.block_table[:first]:
        assert bm.blocks[bid].ref_count == 1  # not taken by b
    bm.free(a)
    bm.free(b)
    bm.check_integrity()
    assert bm.num_free_blocks == 32


window_ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc_window", "append", "commit", "release", "free"]),
        st.integers(0, 5),  # which owner
        st.lists(st.integers(0, 3), min_size=1, max_size=16),  # tokens (small alphabet: prefix hits)
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    ops=window_ops,
    num_blocks=st.integers(1, 12),
    block_size=st.integers(1, 4),
    window=st.integers(1, 9),
    caching=st.booleans(),
)
def test_invariants_hold_with_holes(ops, num_blocks, block_size, window, caching) -> None:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, window=window)
    owners: dict[int, Owner] = {}
    for op, who, toks in ops:
        o = owners.get(who)
        if owner_op(bm, owners, op, who, toks):
            pass  # append, commit, free: alike in every block-manager property test
        elif op in ("alloc", "alloc_window") and o is None:
            o = Owner(list(toks))
            first = bm.first_live(len(toks)) if op == "alloc_window" else 0
            if bm.can_allocate(o, first=first):
                free = bm.num_free_blocks
                bm.allocate(o, first=first)
                assert len(o.block_table) == bm.blocks_needed(len(toks))
                assert o.block_table[:first] == [HOLE] * first
                assert free - bm.num_free_blocks <= bm.num_held(o)
                owners[who] = o
        elif op == "release" and o is not None:
            bm.release_window(o, min(len(o.token_ids), len(o.block_table) * block_size))
        bm.check_integrity()
        held = [b for ow in owners.values() for b in live_blocks(ow.block_table)]
        assert bm.num_used == len(set(held))
        for bid in set(held):
            assert bm.blocks[bid].ref_count == held.count(bid)
        for ow in owners.values():
            holes = ow.block_table.count(HOLE)
            assert ow.block_table[:holes] == [HOLE] * holes, "holes are a prefix of the table"
            for i, bid in enumerate(ow.block_table[: ow.num_hashed_blocks]):
                if bid != HOLE:
                    assert bm.blocks[bid].tokens == tuple(ow.token_ids[i * block_size : (i + 1) * block_size])
    for o in owners.values():
        bm.free(o)
    bm.check_integrity()
    assert bm.num_free_blocks == num_blocks


def test_room_allocates_one_chunk_and_grow_the_next() -> None:
    bm = BlockManager(num_blocks=5, block_size=4, window=8)
    a = Owner(list(range(40)))  # 10 blocks: never all at once
    assert not bm.can_allocate(a) and bm.can_allocate(a, room=16)
    bm.allocate(a, room=16)
    assert len(a.block_table) == 4 and bm.num_held(a) == 4
    bm.commit(a, 16)
    assert bm.release_window(a, 16) == 2  # keys 9..: blocks 0 and 1 slid out
    assert bm.can_grow(a, 28) and not bm.can_grow(a, 32)  # 2 held, 3 to take: the next 12 tokens
    bm.grow(a, 28)
    assert len(a.block_table) == 7 and a.block_table[:2] == [HOLE, HOLE] and bm.num_held(a) == 5
    bm.grow(a, 28)  # has them: nothing taken
    assert bm.num_held(a) == 5 and bm.num_free_blocks == 0
    assert bm.most_held(88, 16) == (8 + 16 - 1) // 4 + 2 and BlockManager(5, 4).most_held(88, 16) == 22
    bm.free(a)
    bm.check_integrity()
    assert bm.num_free_blocks == 5
