"""Layer groups and the grouped page pool (common/kv/layer_groups.py): the plan per model kind, what a
sequence holds per group, prefix hits that need only each group's window, and, under random operations,
that no page is ever read by a sequence for a block whose KV another computed for other tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.block_manager import HOLE
from common.kv.layer_groups import GroupedBlockManager, LayerGroups, plan_layer_groups
from tests.support.block_owner import Owner

GEMMA3_270M = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))  # 5 sliding : 1 full


def test_models_of_one_kind_are_one_group_of_every_layer() -> None:
    for windows in ((), (None,) * 4, (64,) * 4, (64, 32, 64, 32)):
        plan = plan_layer_groups(windows, 4)
        assert plan.num_groups == 1 and plan.layers_per_page == 4
        assert plan.group_of == (0,) * 4 and plan.slot_of == (0, 1, 2, 3)
        assert plan.pages(100) == 100  # a page is a block of every layer: the pool is unchanged
    assert plan_layer_groups((64, 32), 2).windows == (64,)  # every layer slides: the largest window


def test_gemma3_is_one_full_group_and_five_sliding_groups_of_three_layers() -> None:
    plan = plan_layer_groups(GEMMA3_270M, 18)
    assert plan.layers_per_page == 3 and plan.windows == (None,) + (512,) * 5
    assert plan.layers(0) == [5, 11, 17]  # the full layers, in model order
    assert plan.layers(1) == [0, 1, 2] and plan.layers(2) == [3, 4, 6] and plan.layers(5) == [14, 15, 16]
    for layer in range(18):
        assert plan.layers(plan.group_of[layer])[plan.slot_of[layer]] == layer
    assert plan.pages(10) == 60  # the same bytes: 10 blocks of 18 layers, 60 pages of 3


def test_uneven_kinds_cut_into_their_common_divisor() -> None:
    plan = plan_layer_groups((None, 8, 8, 8, None, 8, 8, 8), 8)  # 2 full, 6 sliding
    assert plan.layers_per_page == 2 and plan.windows == (None, 8, 8, 8)
    plan = plan_layer_groups((None, 8, 8, None, 8, 16), 6)  # 2 full, 3 of window 8, 1 of window 16
    assert plan.layers_per_page == 1 and plan.windows == (None, None, 8, 8, 8, 16)
    assert isinstance(plan, LayerGroups)


def test_a_plan_refuses_what_it_cannot_place() -> None:
    with pytest.raises(ValueError, match="3 layer windows for 4 layers"):
        plan_layer_groups((None, 8, 8), 4)
    with pytest.raises(ValueError, match="at least 1 token"):
        plan_layer_groups((None, 0), 2)
    with pytest.raises(ValueError, match="full first"):
        GroupedBlockManager(8, 4, (8, None))
    with pytest.raises(ValueError, match="full and sliding"):
        GroupedBlockManager(8, 4, (None,))


def owner(tokens: list[int]) -> Owner:
    return Owner(list(tokens))


def test_a_long_sequence_holds_every_full_block_and_only_the_window_of_the_sliding_groups() -> None:
    bm = GroupedBlockManager(num_pages=64, block_size=4, windows=(None, 8, 8))
    a = owner(list(range(40)))  # 10 blocks
    assert bm.most_held(40, 8) == 10 + 2 * ((8 + 8 - 1) // 4 + 2)
    bm.allocate(a, room=8)
    assert len(a.block_table) == 2 and [len(t) for t in a.group_tables] == [2, 2]
    for computed in range(8, 41, 8):
        bm.commit(a, computed)
        bm.release_window(a, computed)
        if computed < 40:
            bm.grow(a, computed + 8)
    assert HOLE not in a.block_table and len(a.block_table) == 10
    for table in a.group_tables:  # keys from position 40 - 8 + 1 = 33: block 8 on
        assert table[:8] == [HOLE] * 8 and HOLE not in table[8:]
    assert bm.num_held(a) == 10 + 2 * 2
    assert bm.num_free_blocks == 64 - 14
    bm.free(a)
    bm.check_integrity()
    assert bm.num_free_blocks == 64 and a.group_tables == [[], []]


def test_a_prefix_hit_needs_the_full_blocks_and_the_sliding_window_before_it() -> None:
    bm = GroupedBlockManager(num_pages=64, block_size=4, windows=(None, 8))
    a = owner(list(range(40)))
    bm.allocate(a)
    bm.commit(a, 40)
    bm.release_window(a, 40)
    bm.free(a)  # every page cached: the full group's 10, the sliding group's 10 (released first)
    b = owner([*range(40), 99])
    bm.allocate(b)
    assert b.num_cached_tokens == 40 and b.num_hashed_blocks == 10
    # the hit computes on from position 40: the sliding group reads keys 33.. only, blocks 8 and 9
    assert b.group_tables[0][:8] == [HOLE] * 8 and len(b.group_tables[0]) == 11
    assert bm.num_held(b) == 11 + 3
    bm.free(b)
    bm.check_integrity()


def test_an_evicted_sliding_page_shortens_the_hit_to_where_the_window_is_whole() -> None:
    bm = GroupedBlockManager(num_pages=12, block_size=4, windows=(None, 8))
    a = owner(list(range(24)))  # 6 blocks: 12 pages
    bm.allocate(a)
    bm.commit(a, 24)
    sliding = list(a.group_tables[0])
    bm.free(a)
    for page in a_full_pages(bm, sliding):
        bm.cached_ids.move_to_end(page)  # the full group's pages used last: the sliding ones go first
    bm._take_for(1)  # noqa: SLF001 - what another sequence's allocation does: evicts blocks 5 and 4's
    bm._take_for(1)  # noqa: SLF001
    b = owner([*range(24), 7])
    m, held = bm._grouped_hits(b, 24, 0)  # noqa: SLF001
    # a hit of 6 blocks needs the sliding pages of blocks 4 and 5 (keys 17.. of the query at 24); of 5,
    # those of 3 and 4; of 4 blocks, those of 2 and 3 (keys 9..): the longest whole one
    assert m == 4 and len(held[0]) == 4
    assert held[1] == sliding[2:4]
    bm.check_integrity()


def a_full_pages(bm: GroupedBlockManager, sliding: list[int]) -> list[int]:
    return [p for p in list(bm.cached_ids) if p not in sliding]


def test_a_fresh_page_never_evicts_a_hit_of_another_group() -> None:
    bm = GroupedBlockManager(num_pages=6, block_size=1, windows=(None, 2))
    a = owner([1, 2, 3])
    bm.allocate(a)
    bm.commit(a, 3)
    kept = a.group_tables[0][2]  # the sliding page a hit from position 3 reads (keys 2..)
    bm.free(a)  # all 6 pages cached, the full group's least recent
    b = owner([1, 2, 3, 4])
    assert bm.can_allocate(b)
    bm.allocate(b)  # 3 full pages and 1 sliding page reused, 2 fresh ones: evictions
    assert b.num_hashed_blocks == 3 and b.group_tables[0][:3] == [HOLE, HOLE, kept]
    pages = [p for t in bm.tables(b) for p in t if p != HOLE]
    assert len(pages) == len(set(pages)) == 6, "a page in two tables: one of them reads the other's KV"
    bm.check_integrity()


def test_leading_holes_count_only_in_the_sliding_groups() -> None:
    bm = GroupedBlockManager(num_pages=64, block_size=4, windows=(None, 8))
    a = owner(list(range(41)))
    first = bm.first_live(41)  # the query at 41 sees keys 34..: block 8 on
    assert first == 8
    assert bm.can_allocate(a, first=first)
    bm.allocate(a, first=first)
    assert HOLE not in a.block_table and len(a.block_table) == 11
    assert a.group_tables[0] == [HOLE] * 8 + a.group_tables[0][8:] and len(a.group_tables[0]) == 11
    assert bm.num_held(a) == 11 + 3
    with pytest.raises(ValueError, match="leading holes"):
        bm.allocate(owner(list(range(41))), first=first + 1)
    bm.free(a)
    bm.check_integrity()


def test_a_window_only_reservation_hashes_only_the_pages_its_transfer_wrote() -> None:
    """What the scheduler does when KV arrives window-only (kv_arrived): release, then commit. A group
    with a smaller window than the largest was reserved pages its transfer never wrote: released, never
    hashed; every page kept is hashed, and a later prompt extending this one hits its full blocks."""
    bm = GroupedBlockManager(num_pages=64, block_size=4, windows=(None, 8, 16))
    a = owner(list(range(40)))
    first = bm.first_live(40)  # the larger window's: (40 - 16 + 1) // 4 = 6
    bm.allocate(a, first=first)
    assert [t.count(HOLE) for t in bm.tables(a)] == [0, 6, 6]
    bm.release_window(a, 40)  # the window-8 group reads from block (40 - 8 + 1) // 4 = 8 only
    bm.commit(a, 40)
    assert [t.count(HOLE) for t in bm.tables(a)] == [0, 8, 6]
    for g, table in enumerate(bm.tables(a)):
        assert all(bm.blocks[p].hash is not None for p in table if p != HOLE), f"group {g}"
    assert bm.num_free_blocks == 64 - (10 + 2 + 4)  # the two unwritten pages went back free
    bm.free(a)
    b = owner(list(range(40)) + [7] * 8)
    bm.allocate(b, first=bm.first_live(48))  # decodes from 48: reads blocks 8.. (window 16)
    assert b.num_cached_tokens == 40
    bm.free(b)
    bm.check_integrity()


def test_growth_takes_a_page_per_group_and_is_refused_when_short() -> None:
    bm = GroupedBlockManager(num_pages=5, block_size=4, windows=(None, 8, 8))
    a = owner(list(range(4)))
    bm.allocate(a)
    assert bm.num_free_blocks == 2
    a.token_ids.append(4)
    assert not bm.can_append(a)  # a new block takes 3 pages
    assert not bm.can_grow(a, 5)
    a.token_ids.pop()
    b = owner([9])
    assert not bm.can_allocate(b)
    bm.free(a)
    assert bm.can_allocate(b)


KV = dict[int, tuple[int, tuple[int, ...]]]  # page -> (group, the tokens its KV is of)


def contents_ok(bm: GroupedBlockManager, o: Owner, kv: KV) -> None:
    """Every page o holds for a block whose KV is in place has the KV of o's tokens up to that block,
    written for its group."""
    bs = bm.block_size
    for g, table in enumerate(bm.tables(o)):
        for i, page in enumerate(table[: o.num_cached_tokens // bs]):
            if page != HOLE:
                assert kv[page] == (g, tuple(o.token_ids[: (i + 1) * bs])), f"group {g} block {i}: wrong KV"


def write_kv(bm: GroupedBlockManager, o: Owner, kv: KV, start: int) -> None:
    """o computes its tokens from `start`: the KV of each block it covers, in each group's page."""
    bs = bm.block_size
    for g, table in enumerate(bm.tables(o)):
        for i in range(start // bs, len(table)):
            if table[i] != HOLE:
                kv[table[i]] = (g, tuple(o.token_ids[: (i + 1) * bs]))


grouped_ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc_window", "share", "share", "append", "commit", "release", "free"]),
        st.integers(0, 4),  # which owner
        st.lists(st.integers(0, 1), min_size=1, max_size=16),  # tokens (small alphabet: prefix hits)
    ),
    min_size=20,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    ops=grouped_ops,
    num_pages=st.integers(4, 40),
    block_size=st.integers(1, 3),
    windows=st.lists(st.integers(1, 9), min_size=1, max_size=2),
    full=st.integers(1, 2),
    caching=st.booleans(),
)
def test_no_page_is_read_for_another_prefix_and_nothing_leaks(
    ops, num_pages, block_size, windows, full, caching
) -> None:
    bm = GroupedBlockManager(num_pages, block_size, (None,) * full + tuple(windows), caching)
    owners: dict[int, Owner] = {}
    kv: KV = {}
    for op, who, toks in ops:
        o = owners.get(who)
        if op == "share" and o is None and owners:  # a prompt that shares a running one's prefix
            other = list(owners.values())[len(toks) % len(owners)].token_ids
            op, toks = "alloc", other[: max(1, len(other) - len(toks))] + toks[:1]
        if op in ("alloc", "alloc_window") and o is None:
            o = owner(toks)
            first = bm.first_live(len(toks)) if op == "alloc_window" else 0
            if bm.can_allocate(o, first=first):
                free = bm.num_free_blocks
                bm.allocate(o, first=first)
                assert free - bm.num_free_blocks <= bm.num_held(o)
                assert all(len(t) == bm.blocks_needed(len(toks)) for t in bm.tables(o))
                contents_ok(bm, o, kv)  # a prefix hit reads only pages of its own tokens
                write_kv(bm, o, kv, o.num_cached_tokens)
                o.num_cached_tokens = len(o.token_ids)  # (the test's own record: what is written)
                owners[who] = o
        elif op == "append" and o is not None:
            o.token_ids.append(toks[0])
            if bm.can_append(o):
                bm.append_slots(o)
                write_kv(bm, o, kv, len(o.token_ids) - 1)
                o.num_cached_tokens = len(o.token_ids)
            else:
                o.token_ids.pop()
        elif op == "commit" and o is not None:
            bm.commit(o, len(o.token_ids))
        elif op == "release" and o is not None:
            bm.release_window(o, len(o.token_ids))
        elif op == "free" and o is not None:
            bm.free(o)
            del owners[who]
        bm.check_integrity()
        held = [b for ow in owners.values() for t in bm.tables(ow) for b in t if b != HOLE]
        assert bm.num_used == len(set(held))
        for bid in set(held):
            assert bm.blocks[bid].ref_count == held.count(bid)
        for ow in owners.values():
            assert HOLE not in ow.block_table, "a full group never releases"
            for t in bm.tables(ow):
                holes = t.count(HOLE)
                assert t[:holes] == [HOLE] * holes, "holes are a prefix of the table"
            contents_ok(bm, ow, kv)
    for o in owners.values():
        bm.free(o)
    bm.check_integrity()
    assert bm.num_free_blocks == num_pages
