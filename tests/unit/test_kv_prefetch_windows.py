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

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.block_manager import BlockManager
from common.kv.layer_groups import GroupedBlockManager, group_key
from common.prefix_hash import KVEvent, KVHeld, prefix_chain
from tests.support.block_owner import Owner

BS = 4


class AskedTier:
    """Returns every block it is asked for (the pool bookkeeping is what is tested, not the bytes), and
    records the keys of each prefetch (its runs) and of each load (one run per `load` call)."""

    def __init__(self) -> None:
        self.prefetched: list[list[int]] = []
        self.loaded: list[list[int]] = []

    def evicted(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        pass

    def load(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]], block_ids: Sequence[int]) -> int:
        assert len(hashes) == len(tokens) == len(block_ids)
        self.loaded.append(list(hashes))
        return len(hashes)

    def prefetch(self, *runs: Sequence[int]) -> bool:
        self.prefetched = [list(r) for r in runs if r]
        return True

    def enable_events(self) -> None:
        pass

    def drain_events(self) -> list[KVEvent]:
        return []

    def held_hashes(self) -> list[KVHeld]:
        return []


def admit(bm: BlockManager, tier: AskedTier, tokens: list[int], max_chunk: int) -> Owner | None:
    """What the engine does with an arrival (prefetch) and the scheduler at admission (a windowed
    model's first chunk: `room`); the sequence then computes the rest of its prompt (growing, committing,
    releasing what slid out) and is freed. None when the pool has no room (nothing asked then)."""
    seq = Owner(list(tokens))
    tier.prefetched, tier.loaded = [], []
    room = min(len(tokens), max_chunk)
    if not bm.can_allocate(seq, room=room):
        return None
    started = bm.prefetch(seq, max_chunk)
    bm.allocate(seq, room=room)
    assert tier.prefetched == tier.loaded, "prefetch must hand the tiers what the admission asks for"
    assert started == bool(tier.loaded)
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
    return seq


prompts = st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=40), min_size=1, max_size=12)


@settings(max_examples=80, deadline=None)
@given(prompts=prompts, num_blocks=st.integers(12, 30), window=st.integers(2, 12), chunk=st.integers(3, 24))
def test_every_layer_sliding_prefetches_the_first_chunks_blocks(prompts, num_blocks, window, chunk) -> None:  # type: ignore[no-untyped-def]
    bm = BlockManager(num_blocks, BS, window=window)
    tier = AskedTier()
    bm.tier = tier
    for p in prompts:
        admit(bm, tier, p, chunk)


@settings(max_examples=80, deadline=None)
@given(prompts=prompts, num_pages=st.integers(24, 60), window=st.integers(2, 12), chunk=st.integers(3, 24))
def test_layer_groups_prefetch_each_groups_keys(prompts, num_pages, window, chunk) -> None:  # type: ignore[no-untyped-def]
    bm = GroupedBlockManager(num_pages, BS, (None, window, window))
    tier = AskedTier()
    bm.tier = tier
    for p in prompts:
        admit(bm, tier, p, chunk)


def test_a_windowed_prefetch_stops_at_the_first_chunk_and_groups_ask_for_their_windows() -> None:
    """Directed: a prompt's 10 full blocks evicted to the tier; the same prompt again with chunks of 3
    blocks: the one table asks for blocks 0..1 (the chunk's last block is computed); with groups, the
    full group asks for blocks 0..1 and each sliding group (window 4 tokens: one block) for block 1."""
    prompt = list(range(41))  # 10 full blocks and one token
    for bm in (BlockManager(11, BS, window=4), GroupedBlockManager(33, BS, (None, 4, 4))):
        tier = AskedTier()
        bm.tier = tier
        seq = Owner(list(prompt))
        bm.allocate(seq, use_prefix_cache=False)
        bm.commit(seq, len(prompt))
        bm.free(seq)
        filler = Owner([99] * 44)
        bm.allocate(filler, use_prefix_cache=False)  # every block of the pool: the prompt's are evicted
        assert not bm.hash_to_block
        bm.free(filler)
        seq = Owner(list(prompt))
        assert bm.prefetch(seq, 3 * BS)
        h0, h1 = prefix_chain(prompt, BS)[:2]
        groups = len(getattr(bm, "windows", (None,)))
        assert tier.prefetched == [[h0, h1]] + [[group_key(h1, g)] for g in range(1, groups)]
        bm.allocate(seq, room=3 * BS)
        assert tier.loaded == tier.prefetched and seq.num_cached_tokens == 2 * BS
