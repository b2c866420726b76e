"""Block manager invariants under random operation sequences (property-based)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.block_manager import BlockManager, block_hash
from tests.support.block_owner import Owner


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
        if op == "alloc" and o is None:
            o = Owner(list(toks))
            if bm.can_allocate(o):
                bm.allocate(o)
                assert len(o.block_table) == bm.blocks_needed(len(toks))
                assert o.num_cached_tokens < len(toks)
                owners[who] = o
        elif op == "append" and o is not None:
            o.token_ids.append(toks[0])
            if bm.can_append(o):
                bm.append_slots(o)
                assert len(o.block_table) * block_size >= len(o.token_ids)
            else:
                o.token_ids.pop()
        elif op == "commit" and o is not None:
            bm.commit(o, len(o.token_ids))
        elif op == "free" and o is not None:
            bm.free(o)
            del owners[who]
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
