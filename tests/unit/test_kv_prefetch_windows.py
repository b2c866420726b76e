"""Prefetch on arrival for models with sliding windows (issue 32): what `prefetch` hands the offload tiers
is exactly what the admission then asks them for.

A model whose every layer slides (one block table) loads from the tiers into its first chunk's blocks
only; a model of full and sliding layer groups (gemma2/3) reads each full group's pages for the blocks
after the pool's hit and each sliding group's for the window before the hit's end, under each group's
own key (common/kv/layer_groups.py). Under random prompts over a small pool (evictions, pool prefix hits
of every length, chunks shorter and longer than the prompt), a tier that returns whatever it is asked
for records the keys of every `prefetch` and every `load`: they must be the same runs, in order. A
prefetch that missed a key would leave the admission a disk read; one that asked for more would read
chunks nobody uses (the real store then promotes them into RAM, evicting what others need).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set

from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.block_manager import HOLE, BlockManager, live_blocks
from common.kv.layer_groups import GroupedBlockManager, group_key
from common.prefix_hash import KVEvent, KVHeld, prefix_chain
from tests.support.block_owner import Owner

BS = 4


class AskedTier:
    """Holds every key but those in `lacking` and returns the leading run of what it is asked for that
    it holds (the pool bookkeeping is what is tested, not the bytes); records the keys of each prefetch
    (its runs) and of each load (one run per `load` call)."""

    def __init__(self, lacking: frozenset[int] = frozenset(), broken: frozenset[int] = frozenset()) -> None:
        self.lacking = lacking
        self.broken = broken  # held by the index, but a read stops there (a record that does not verify)
        self.prefetched: list[list[int]] = []
        self.loaded: list[list[int]] = []

    def evicted(self, block_id: int, block_hash: int, tokens: tuple[int, ...], publish: bool = True) -> None:
        pass

    def holds(self, keys: Sequence[int]) -> list[bool]:
        return [k not in self.lacking for k in keys]

    def load(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]], block_ids: Sequence[int]) -> int:
        assert len(hashes) == len(tokens) == len(block_ids)
        self.loaded.append(list(hashes))
        read = [h not in self.lacking and h not in self.broken for h in hashes]
        return read.index(False) if False in read else len(read)

    def prefetch(self, *runs: Sequence[int]) -> bool:
        self.prefetched = [list(r) for r in runs if r]
        return True

    def enable_events(self) -> None:
        pass

    def drain_events(self) -> list[KVEvent]:
        return []

    def held_hashes(self) -> list[KVHeld]:
        return []


def held_part(tier: AskedTier, runs: list[list[int]]) -> list[list[int]]:
    """Each run as far as the tier holds it (what a real store's prefetch and read follow), empty
    ones left out."""
    out = []
    for r in runs:
        held = tier.holds(r)
        if True in held[:1]:
            out.append(r[: held.index(False)] if False in held else r)
    return out


def admit(bm: BlockManager, tier: AskedTier, tokens: list[int], max_chunk: int, ample: bool) -> None:
    """What the engine does with an arrival (prefetch) and the scheduler at admission (a windowed
    model's first chunk: `room`); the sequence then computes the rest of its prompt (growing, committing,
    releasing what slid out) and is freed. With an `ample` pool (the admission's tier run never short
    of blocks), the prefetch asked the tiers for exactly what the admission then read."""
    seq = Owner(list(tokens))
    tier.prefetched, tier.loaded = [], []
    room = min(len(tokens), max_chunk)
    if not bm.can_allocate(seq, room=room):
        return
    keys = bm.prefetch(seq, max_chunk)
    started = keys is not None
    # what the scheduler asks the tier about while the admission waits: the keys the prefetch brings
    assert (keys or []) == [k for run in tier.prefetched for k in run]
    before = bm.tier_hits
    bm.allocate(seq, room=room)
    bm.check_integrity()
    tables = bm.tables(seq) if isinstance(bm, GroupedBlockManager) else [seq.block_table]
    windows = bm.windows if isinstance(bm, GroupedBlockManager) else (bm.window,)
    for w, table in zip(windows, tables, strict=True):  # the next query's window: pages, never holes
        holes = table.count(HOLE)
        assert table[:holes] == [HOLE] * holes and len(table) * BS >= seq.num_cached_tokens + 1
        assert w is not None or holes == 0
        if w is not None:
            assert holes * BS <= max(0, seq.num_cached_tokens - w + 1), (holes, seq.num_cached_tokens, w)
    assert started == bool(tier.prefetched)
    if ample and not tier.broken:
        read = held_part(tier, tier.loaded) if bm.tier_hits > before else []
        assert held_part(tier, tier.prefetched) == read, "prefetch must ask for what the admission reads"
    done = seq.num_cached_tokens
    while done < len(tokens):
        n = min(len(tokens), done + max_chunk)
        if not bm.can_grow(seq, n):
            break
        bm.grow(seq, n)
        bm.commit(seq, n)
        bm.release_window(seq, n)
        done = n
    bm.free(seq)
    bm.check_integrity()


prompts = st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=40), min_size=1, max_size=12)
lacking = st.sets(st.integers(0, 40), max_size=6)  # blocks (by index in the prompt) the tier lacks


def tier_lacking(
    prompts: list[list[int]], blocks: set[int], groups: int, broken: frozenset[int] = frozenset()
) -> AskedTier:
    """A tier lacking, for every prompt, the `blocks`' keys of one group each (by block index), and
    whose reads of the `broken` blocks' keys (one group each) fail although its index holds them."""

    def keys(which: Set[int]) -> frozenset[int]:
        out = set()
        for p in prompts:
            chain = prefix_chain(p, BS)
            out.update(group_key(chain[i], i % groups) for i in which if i < len(chain))
        return frozenset(out)

    return AskedTier(keys(blocks), keys(broken))


# a trace: prompts, the blocks the tiers lack, those whose read fails, the window, the chunk
trace = st.tuples(
    prompts, lacking, st.frozensets(st.integers(0, 10), max_size=2), st.integers(2, 12), st.integers(3, 24)
)


def replay(make: Callable[[int, int], BlockManager], groups: int, tight: int, ample: int, case) -> None:  # type: ignore[no-untyped-def]
    """The trace through a pool of `tight` blocks (the run often short of room) and one of `ample`."""
    prompts, lack, broken, window, chunk = case
    for blocks, is_ample in ((tight, False), (ample, True)):
        bm = make(blocks, window)
        bm.tier = tier = tier_lacking(prompts, lack, groups, broken)
        for p in prompts:
            admit(bm, tier, p, chunk, is_ample)


@settings(max_examples=80, deadline=None)
@given(case=trace, num_blocks=st.integers(3, 14))
def test_every_layer_sliding_reads_a_tier_run_and_prefetches_it(case, num_blocks) -> None:  # type: ignore[no-untyped-def]
    replay(lambda blocks, w: BlockManager(blocks, BS, window=w), 1, num_blocks, 400, case)


@settings(max_examples=80, deadline=None)
@given(case=trace, num_pages=st.integers(9, 40))
def test_layer_groups_read_a_tier_run_with_whole_windows_and_prefetch_it(case, num_pages) -> None:  # type: ignore[no-untyped-def]
    """A run the index holds whose read comes back short (broken keys) is given back and the allocation
    made again without it: never a hole inside the window of the sequence's next query."""
    replay(lambda pages, w: GroupedBlockManager(pages, BS, (None, w, w)), 3, num_pages, 1200, case)


def test_a_windowed_admission_reads_the_whole_tier_run_and_its_prefetch_asks_for_it() -> None:
    """Directed: a prompt's 10 full blocks evicted to the tier; the same prompt again with chunks of 3
    blocks: every block is read back at admission (before, only the first chunk's 2), and the prefetch
    asked for them: the one table's 10 hashes; with groups, the full group's 10 keys and each sliding
    group's (window 4 tokens: one block) for block 9 only."""
    prompt = list(range(41))  # 10 full blocks and one token
    chain = prefix_chain(prompt, BS)
    for bm in (BlockManager(14, BS, window=4), GroupedBlockManager(42, BS, (None, 4, 4))):
        tier = AskedTier()
        bm.tier = tier
        seq = Owner(list(prompt))
        bm.allocate(seq, use_prefix_cache=False)
        bm.commit(seq, len(prompt))
        bm.free(seq)
        filler = Owner([99] * 56)
        bm.allocate(filler, use_prefix_cache=False)  # every block of the pool: the prompt's are evicted
        assert not bm.hash_to_block
        bm.free(filler)
        seq = Owner(list(prompt))
        assert bm.prefetch(seq, 3 * BS)
        groups = len(getattr(bm, "windows", (None,)))
        assert tier.prefetched == [chain[:10]] + [[group_key(chain[9], g)] for g in range(1, groups)]
        bm.allocate(seq, room=3 * BS)
        assert seq.num_cached_tokens == 10 * BS and bm.tier_hits == 10
        assert held_part(tier, tier.loaded) == tier.prefetched
        tables = bm.tables(seq) if isinstance(bm, GroupedBlockManager) else [seq.block_table]
        if groups > 1:  # a sliding group takes pages only for the window before the run's end
            assert [len(live_blocks(t)) for t in tables] == [11, 2, 2]
        else:  # one table: every block until the step releases those before the window
            assert len(live_blocks(seq.block_table)) == 11
        bm.release_window(seq, seq.num_cached_tokens)
        held = [len(live_blocks(t)) for t in tables]
        assert held == [11, 2, 2][-groups:], "after the step a sliding table holds the window and the chunk"
        bm.free(seq)
        bm.check_integrity()
