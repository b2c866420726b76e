"""One page pool for models that mix full-attention and sliding-window layers (gemma2, gemma3): the plan
of layer groups and the allocator that gives each group its own block table.

Why. With one block table for every layer, a sliding layer holds a whole prompt's blocks although it
reads only its window: Gemma 3 270M (3 full layers, 15 sliding with a 512-token window) at 32k tokens
keeps ~6x the KV it needs. Releasing what slid out needs a table per kind of layer; sizing a separate
pool per kind (a fixed full:sliding ratio) would waste whichever pool the workload leaves idle. So the
layers are cut into groups of `k` layers of one kind each, `k` dividing every kind's layer count (3
for Gemma 3 270M: one full group, five sliding groups), and the cache is a pool of *pages* of `k`
layers (one page: one block of tokens for `k` layers, K and V). Each group has a block table of page
ids; a sliding group's table releases the pages that slid out of its window (HOLEs, as a model whose
every layer slides does today: common/kv/block_manager.py), a full group's never does. Every group's
page for token-block i is taken when block i is first needed, so the tables stay index-aligned.

`plan_layer_groups` makes the plan from the model's per-layer windows; a model whose layers are all of
one kind is one group of all its layers (k = num_layers, a page is today's block: nothing changes).

`GroupedBlockManager` is the allocator for a plan of more than one group. A sequence's table of group 0
(a full group: groups are ordered full first) is its `block_table`, those of groups 1.. its
`group_tables`. Prefix caching is per group, keyed by the same chained block hashes: a prompt's first m
blocks are a hit when every full group holds pages for blocks 0..m-1 and every sliding group for the
blocks its window still sees from position m*block_size (earlier ones are holes in its table). The
hash chain runs through group 0 (it has no holes). KV events (what the router matches prompts against)
name a hash only while every group holds a page for its block (`published`): a prefix of such blocks
is a hit whatever the windows, so the router never counts on a hit this pool cannot serve; it may see
less than is served (a prompt whose old sliding pages were released still hits up to the window
before its end, which the router does not predict). The offload tiers' events are per record: group
0's key is the block hash, so the router may count on a tier hit whose sliding pages the tier lost
(then the load is a miss, recomputed: shorter, never wrong).

The engine uses it for such a model (common/engine/llm_engine.py), on the local path, across the
split and with the offload tiers (each group's pages are their records, under `group_key`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from math import gcd
from typing import Protocol

from common.kv.block_manager import HOLE, SNAPSHOT_TRIES, BlockManager, _root, free_window
from common.prefix_hash import DEVICE, KVHeld, block_hash


@dataclass(frozen=True)
class LayerGroups:
    """Which group and which slot of its pages each layer is: `windows[g]` is group g's sliding window
    (None: full attention), `group_of[l]` and `slot_of[l]` layer l's group and its index among the
    group's `layers_per_page` layers (the page's layer slot)."""

    windows: tuple[int | None, ...]
    group_of: tuple[int, ...]
    slot_of: tuple[int, ...]
    layers_per_page: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def layers(self, group: int) -> list[int]:
        """Group `group`'s layers, in slot order."""
        return [layer for layer, g in enumerate(self.group_of) if g == group]

    def pages(self, num_blocks: int) -> int:
        """The pages of a pool as large as `num_blocks` blocks of every layer (the same bytes)."""
        return num_blocks * len(self.group_of) // self.layers_per_page


def plan_layer_groups(layer_windows: Seq[int | None], num_layers: int) -> LayerGroups:
    """The layer groups of a model whose layer l slides over `layer_windows[l]` tokens (None: full
    attention; an empty `layer_windows`: no layer slides). One group of every layer unless full and
    sliding layers mix; then groups of k layers of one kind (one window), k the greatest common
    divisor of each kind's layer count, full groups first, each kind's layers in model order."""
    windows = tuple(layer_windows) or (None,) * num_layers
    if len(windows) != num_layers or num_layers < 1:
        raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"a sliding window must be at least 1 token: {windows}")
    if None not in windows or all(w is None for w in windows):  # one kind: today's single table
        return one_group(windows, num_layers)
    kinds: dict[int | None, list[int]] = {None: []}  # full first, then each window in order of first use
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    k = 0
    for members in kinds.values():
        k = gcd(k, len(members))
    group_windows: list[int | None] = []
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for w, members in kinds.items():
        for start in range(0, len(members), k):
            for slot, layer in enumerate(members[start : start + k]):
                group_of[layer], slot_of[layer] = len(group_windows), slot
            group_windows.append(w)
    return LayerGroups(tuple(group_windows), tuple(group_of), tuple(slot_of), k)


def group_key(block_hash_: int, group: int) -> int:
    """The offload tiers' key of layer group `group`'s page for a block: the block hash itself for group
    0 (what the router matches, through the tiers' KV events), a hash of it and the group for the
    others (their records are other bytes: another page of the same block)."""
    if group == 0:
        return block_hash_
    h = hashlib.blake2b(
        block_hash_.to_bytes(8, "little", signed=True), digest_size=8, person=b"splitserve-lgrp"
    )
    h.update(group.to_bytes(4, "little"))
    return int.from_bytes(h.digest(), "little", signed=True)


def one_group(layer_windows: Seq[int | None], num_layers: int) -> LayerGroups:
    """Every layer in one group, one table (a page is a block of every layer): its window is the one
    outside which no layer reads (`free_window`: the largest when every layer slides, else None)."""
    return LayerGroups((free_window(layer_windows),), (0,) * num_layers, tuple(range(num_layers)), num_layers)


class GroupOwner(Protocol):
    """What the grouped allocator needs from a sequence: the block manager's `BlockOwner` and the
    tables of groups 1.. (group 0's is `block_table`)."""

    token_ids: list[int]
    block_table: list[int]
    group_tables: list[list[int]]
    num_cached_tokens: int
    num_hashed_blocks: int


class GroupedBlockManager(BlockManager):
    """A page pool shared by layer groups, a block table per group (module doc). The scheduler's view is
    the block manager's: `window` (the largest sliding window: allocation goes a chunk at a time and
    `release_window` runs after each step), `first_live` (the leading holes every sliding group may
    have), `blocks_needed` (token-blocks, i.e. table entries), `num_free_blocks` (pages). The offload
    tiers hold each group's evicted pages under `group_key`; a load continues a pool hit with every
    full group's pages, then each sliding group's for the window the longer hit reads (`_load_groups`)."""

    hits_need_windows_only = True  # a hit takes a sliding group's pages for its window only

    def __init__(
        self, num_pages: int, block_size: int, windows: Seq[int | None], enable_prefix_caching: bool = True
    ) -> None:
        windows = tuple(windows)
        if len(windows) < 2 or windows[0] is not None or all(w is None for w in windows):
            raise ValueError(
                f"a grouped pool is for full and sliding groups, full first (plan_layer_groups): {windows}"
            )
        super().__init__(num_pages, block_size, enable_prefix_caching, max(w for w in windows if w))
        self.windows = windows
        self.group_of_page = [0] * num_pages  # which group's table a used or cached page is in
        self.index: list[dict[int, int]] = [self.hash_to_block] + [{} for _ in windows[1:]]
        self.published: set[int] = set()  # hashes every group holds: the KV events' (module doc)

    # --- tables ---------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def tables(self, seq: GroupOwner) -> list[list[int]]:
        """seq's block table of each group (group 0's is seq.block_table)."""
        return [seq.block_table, *seq.group_tables]

    def _first_live_of(self, group: int, num_computed: int) -> int:
        w = self.windows[group]
        return 0 if w is None else max(0, num_computed - w + 1) // self.block_size

    def first_live(self, num_computed: int) -> int:
        """The leading holes every sliding group's table may have for a sequence computed up to
        `num_computed` tokens: the fewest any sliding group may (full groups have none)."""
        return min(self._first_live_of(g, num_computed) for g, w in enumerate(self.windows) if w is not None)

    def most_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most pages a sequence of `num_tokens` tokens, computed `max_chunk` at a time, holds at
        once: every block in a full group, a chunk's and the window before it in a sliding one."""
        whole = self.blocks_needed(num_tokens)
        return sum(
            whole if w is None else min(whole, (w + max_chunk - 1) // self.block_size + 2)
            for w in self.windows
        )

    def live_pages(self, seq: GroupOwner, width: int | None = None) -> list[int]:  # type: ignore[override]
        """Every group's live pages among its table's first `width` entries, group by group."""
        return [b for t in self.tables(seq) for b in t[:width] if b != HOLE]

    def num_held(self, seq: GroupOwner) -> int:  # type: ignore[override]
        return sum(1 for t in self.tables(seq) for b in t if b != HOLE)

    # --- prefix hits ----------------------------------------------------------------------------
    def _chain(self, token_ids: Seq[int], num_tokens: int, root: int) -> list[int]:
        bs, parent, out = self.block_size, root, []
        for i in range(num_tokens // bs):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    def _cached(self, group: int, h: int, toks: Seq[int]) -> int | None:
        bid = self.index[group].get(h)
        return bid if bid is not None and self.blocks[bid].tokens == tuple(toks) else None

    def _grouped_hits(self, seq: GroupOwner, limit: int, first: int) -> tuple[int, list[list[int]]]:
        """The longest prefix hit m (blocks) of seq's first `limit` tokens and, per group, the pages it
        reuses: a full group's for blocks 0..m-1, a sliding group's from the later of `first` and the
        first block its window sees from position m * block_size."""
        if not self.enable_prefix_caching:
            return 0, [[] for _ in self.windows]
        bs, toks = self.block_size, seq.token_ids
        chain = self._chain(toks, limit, _root(seq))
        found = [
            [self._cached(g, h, toks[i * bs : (i + 1) * bs]) for i, h in enumerate(chain)]
            for g in range(self.num_groups)
        ]
        full = [g for g, w in enumerate(self.windows) if w is None]
        run = 0  # the full groups' common run from block 0
        while run < len(chain) and all(found[g][run] is not None for g in full):
            run += 1
        for m in range(run, 0, -1):  # the longest m whose window blocks every sliding group holds
            held = [found[g][self._holes(g, first, m) : m] for g in range(self.num_groups)]
            if all(b is not None for pages in held for b in pages):
                return m, [[b for b in pages if b is not None] for pages in held]
        return 0, [[] for _ in self.windows]

    # --- capacity and allocation ----------------------------------------------------------------
    def _holes(self, group: int, first: int, hit: int) -> int:
        """Leading holes of `group`'s table for an allocation with `first` holes and a hit of `hit`
        blocks: none in a full group."""
        if self.windows[group] is None:
            return 0
        return max(first, self._first_live_of(group, hit * self.block_size))

    def can_allocate(  # type: ignore[override]
        self,
        seq: GroupOwner,
        num_tokens: int | None = None,
        reserve: int = 0,
        use_prefix_cache: bool = True,
        first: int = 0,
        room: int | None = None,
    ) -> bool:
        n, first, limit = self._span(seq, num_tokens, first)
        m, held = self._grouped_hits(seq, limit, first) if use_prefix_cache else (0, [[]] * self.num_groups)
        width = self.blocks_needed(self._target(n, m, room))
        need = reserve
        evictable = 0
        for g in range(self.num_groups):
            holes = min(self._holes(g, first, m), width)
            need += max(0, width - holes - len(held[g]))
            evictable += sum(1 for b in held[g] if self.blocks[b].ref_count == 0)
        return need <= self.num_free_blocks - evictable

    def _take_for(self, group: int) -> int:
        bid = self._take()
        self.group_of_page[bid] = group
        return bid

    def _take(self) -> int:
        if self.free_ids:
            bid = self.free_ids.popleft()
        else:
            bid, _ = self.cached_ids.popitem(last=False)  # the least recently used, from its group's index
            blk, group = self.blocks[bid], self.group_of_page[bid]
            assert blk.hash is not None, f"cached page {bid} has no hash"
            if self.tier is not None:  # its KV is still in the page: the tier copies it before a write
                # only group 0's key is a block hash a router matches: the others' pages go unannounced
                self.tier.evicted(bid, group_key(blk.hash, group), blk.tokens, publish=group == 0)
            del self.index[group][blk.hash]
            self._unpublish(blk.hash)
            blk.hash, blk.tokens = None, ()
        self.blocks[bid].ref_count = 1
        self.num_used += 1
        return bid

    # --- KV events: a hash is published once every group holds a page for it -----------------------
    def _publish(self, h: int) -> None:
        """h's block is now in every group's index: a prefix of such blocks is a hit whatever the
        windows (module doc), so the router may count on it."""
        if h not in self.published and all(h in index for index in self.index):
            self.published.add(h)
            if self.kv_events is not None:
                self.kv_events.append((True, h, DEVICE))

    def _unpublish(self, h: int) -> None:
        if h in self.published:
            self.published.discard(h)
            if self.kv_events is not None:
                self.kv_events.append((False, h, DEVICE))

    def cached_hashes(self) -> list[KVHeld]:
        """The published hashes (every group holds their block), then the offload tiers' (group 0's
        keys: the block hashes; the later groups' pages are held quiet), for a snapshot; safe from
        another thread as the block manager's is."""
        held = self.tier.held_hashes() if self.tier is not None else []
        for _ in range(SNAPSHOT_TRIES - 1):
            try:
                return [(h, DEVICE) for h in self.published] + held
            except RuntimeError:  # "set changed size during iteration"
                continue
        return [(h, DEVICE) for h in self.published] + held

    def allocate(  # type: ignore[override]
        self,
        seq: GroupOwner,
        num_tokens: int | None = None,
        use_prefix_cache: bool = True,
        first: int = 0,
        room: int | None = None,
    ) -> None:
        """As BlockManager.allocate, a table per group (module doc); `first`: leading holes of the
        sliding groups' tables (a decode service's reservation for window-only KV, a swap-in).

        A first chunk (`room`) continues the pool's hit with the run of blocks the offload tiers hold
        (`_grouped_run`, their index) when free pages allow: every full group takes pages for the run,
        a sliding group only for the window before its end (earlier entries are holes, as after a pool
        hit). Such a read must return the whole run: a shorter one (a record that does not verify)
        would leave holes inside a window, so the pages are given back and the allocation is made
        again without the run (its first chunk's pages only, as without tiers' runs)."""
        assert not seq.block_table and not any(seq.group_tables), "sequence already holds pages"
        n, first, limit = self._span(seq, num_tokens, first)
        self.prefix_queries += len(seq.token_ids) // self.block_size
        extend = room is not None and first == 0 and use_prefix_cache
        if not (extend and self._take_pages(seq, n, limit, room, first, use_prefix_cache, extend=True)):
            self._take_pages(seq, n, limit, room, first, use_prefix_cache, extend=False)

    def _take_pages(
        self, seq: GroupOwner, n: int, limit: int, room: int | None, first: int, use_prefix_cache: bool,
        extend: bool,
    ) -> bool:  # fmt: skip
        """allocate's tables, with the tiers' run (`extend`) or without; False (nothing held): no run,
        or its read came back short."""
        bs = self.block_size
        m, held = self._grouped_hits(seq, limit, first) if use_prefix_cache else (0, [[]] * self.num_groups)
        run = self._grouped_run(seq, held, limit, room or n) if extend else 0
        if extend and not run:
            return False
        width = self.blocks_needed(self._target(n, m + run, room))
        keep = []  # each group's hit pages still inside its window after the run
        for g in range(self.num_groups):
            drop = min(self._holes(g, first, m + run), width) - min(self._holes(g, first, m), width)
            keep.append(held[g][drop:])
        for pages in keep:  # every group's hits first: a fresh page taken below never evicts one
            for bid in pages:
                self._ref(bid)
        tables: list[list[int]] = []
        for g in range(self.num_groups):
            holes = min(self._holes(g, first, m + run), width)
            fresh = [self._take_for(g) for _ in range(width - holes - len(keep[g]))]
            tables.append([HOLE] * holes + keep[g] + fresh)
        seq.block_table, seq.group_tables = tables[0], tables[1:]
        loaded = 0
        if use_prefix_cache and self.tier is not None and self.enable_prefix_caching:
            # short of the prompt: the last block is left for the chunk to compute into
            end = m + run if run else min(limit // bs, width - (width * bs < n))
            loaded = self._load_groups(seq, tables, m, end, whole=bool(run))
        if run and loaded < run:
            self.free(seq)
            return False
        self.prefix_hits += m
        seq.num_hashed_blocks = m + loaded
        seq.num_cached_tokens = (m + loaded) * bs
        return True

    def _grouped_run(self, seq: GroupOwner, held: list[list[int]], limit: int, room: int) -> int:
        """The longest run of blocks after a pool hit (`held`: each group's hit pages, as
        `_grouped_hits` gives them) that the tiers hold now (their index, no read) as a load reads it —
        every full group's pages for the blocks, each sliding group's for the window before the run's
        end — and whose pages the pool has free: each group's table grows to the run and a first chunk
        of `room` tokens after it, a sliding group's from the window before that chunk. 0: none."""
        if self.tier is None or not self.enable_prefix_caching:
            return 0
        bs, n, m = self.block_size, len(seq.token_ids), len(held[0])
        hashes = self._tier_hashes(seq, held[0], limit // bs)
        flags = [self.tier.holds([group_key(h, g) for h in hashes]) for g in range(self.num_groups)]
        run = len(hashes)
        for g, w in enumerate(self.windows):  # every full group's pages
            if w is None and False in flags[g][:run]:
                run = flags[g].index(False)
        # lacking[g][i]: 1 + the last of the run's first i blocks whose page group g's tiers lack (0: none)
        lacking = []
        for row in flags:
            last, out = 0, [0]
            for i, ok in enumerate(row):
                last = last if ok else i + 1
                out.append(last)
            lacking.append(out)
        # the pages a run can take: the free ones, less the evictable hits it keeps (conservatively: all)
        free = self.num_free_blocks - sum(1 for pages in held for b in pages if self.blocks[b].ref_count == 0)
        for r in range(run, 0, -1):
            width = self.blocks_needed(self._target(n, m + r, room))
            holes = [min(self._first_live_of(g, (m + r) * bs), width) for g in range(self.num_groups)]
            kept = [len(p) - max(0, h - (m - len(p))) for p, h in zip(held, holes, strict=True)]
            if sum(width - h - k for h, k in zip(holes, kept, strict=True)) > free:
                continue  # the pool has no room for that run's pages
            if all(
                lacking[g][r] <= max(m, holes[g]) - m for g, w in enumerate(self.windows) if w is not None
            ):
                return r
        return 0

    def _load_groups(
        self, seq: GroupOwner, tables: list[list[int]], m: int, end: int, whole: bool = False
    ) -> int:
        """Continue seq's pool hit of `m` blocks with what the offload tiers return, up to block `end`:
        every full group's pages for the blocks m.., then each sliding group's for the window the
        longer hit reads (all of them, or the tiers' pages count for nothing: a hit needs each window
        whole). `whole`: every block up to `end` or nothing (the sliding tables' holes end at the
        window before `end`). The pages read are hashed; returns how many blocks the hit grew by. Each
        group's pages are the tier's records under `group_key`."""
        assert self.tier is not None
        bs = self.block_size
        hashes = self._tier_hashes(seq, tables[0][:m], end)
        tokens = [tuple(seq.token_ids[i * bs : (i + 1) * bs]) for i in range(m, m + len(hashes))]
        run = len(hashes)
        for g, w in enumerate(self.windows):  # the full groups: the longest run every one returns
            if w is None and run:
                keys = [group_key(h, g) for h in hashes[:run]]
                run = min(run, self.tier.load(keys, tokens[:run], tables[g][m : m + run]))
        if not run or (whole and run < end - m):
            return 0
        starts = []
        for g, w in enumerate(self.windows):  # the sliding groups: the window before block m + run
            if w is None:
                starts.append(m)
                continue
            table = tables[g]
            start = max(m, self._first_live_of(g, (m + run) * bs), table.count(HOLE))
            keys = [group_key(h, g) for h in hashes[start - m : run]]
            if keys and self.tier.load(keys, tokens[start - m : run], table[start : m + run]) < len(keys):
                return 0  # a window not whole: the pages read are fresh pages to compute into
            starts.append(start)
        for i in range(m, m + run):  # the blocks read, hashed as a commit would (a group's index holding
            h, toks = hashes[i - m], tokens[i - m]  # that hash already keeps its own page)
            for g, table in enumerate(tables):
                page = table[i]
                if i >= starts[g] and h not in self.index[g]:
                    self.blocks[page].hash, self.blocks[page].tokens = h, toks
                    self.index[g][h] = page
            self._publish(h)
        self.tier_hits += run
        return run

    def can_append(self, seq: GroupOwner, num_new_tokens: int = 1) -> bool:  # type: ignore[override]
        return self.can_grow(seq, len(seq.token_ids) + num_new_tokens - 1)

    def can_grow(self, seq: GroupOwner, num_tokens: int) -> bool:  # type: ignore[override]
        return (
            self.blocks_needed(num_tokens) - len(seq.block_table)
        ) * self.num_groups <= self.num_free_blocks

    def grow(self, seq: GroupOwner, num_tokens: int) -> None:  # type: ignore[override]
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            for g, table in enumerate(self.tables(seq)):
                table.append(self._take_for(g))

    def append_slots(self, seq: GroupOwner, num_new_tokens: int = 1) -> None:  # type: ignore[override]
        self.grow(seq, len(seq.token_ids) + num_new_tokens - 1)

    def free(self, seq: GroupOwner) -> None:  # type: ignore[override]
        for table in self.tables(seq):
            for bid in reversed(table):  # tail first: evicted before the shared prefix
                if bid != HOLE:
                    self._unref(bid)
        seq.block_table, seq.group_tables = [], [[] for _ in self.windows[1:]]
        seq.num_hashed_blocks = 0

    def release_window(self, seq: GroupOwner, num_computed: int) -> int:  # type: ignore[override]
        """Release each sliding group's pages wholly before its window (HOLEs in their place); returns
        how many. Commit first: a page released unhashed stays so."""
        released = 0
        for g, table in enumerate(self.tables(seq)):
            if self.windows[g] is None:
                continue
            i = min(self._first_live_of(g, num_computed), len(table)) - 1
            while i >= 0 and table[i] != HOLE:
                self._unref(table[i])
                table[i] = HOLE
                released += 1
                i -= 1
        return released

    def commit(self, seq: GroupOwner, num_computed_tokens: int) -> list[int]:  # type: ignore[override]
        """Hash the full blocks whose KV is now computed, in every group's page for them (a released or
        never-taken page: a hole, skipped); returns the hashes published (module doc: KV events)."""
        if not self.enable_prefix_caching:
            return []
        bs, new, tables = self.block_size, [], self.tables(seq)
        for i in range(seq.num_hashed_blocks, num_computed_tokens // bs):
            parent = self.blocks[seq.block_table[i - 1]].hash if i > 0 else _root(seq)
            if parent is None:  # the parent's content is owned elsewhere under that hash: stop the chain
                break
            toks = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, toks)
            blk = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block and blk.hash is None:
                blk.hash, blk.tokens = h, toks
                self.hash_to_block[h] = blk.block_id
            elif blk.hash != h:
                break  # the same content computed twice concurrently: this copy stays private
            for g in range(1, self.num_groups):
                page = tables[g][i]
                if page != HOLE and h not in self.index[g] and self.blocks[page].hash is None:
                    self.blocks[page].hash, self.blocks[page].tokens = h, toks
                    self.index[g][h] = page
            if h not in self.published:
                self._publish(h)
                if h in self.published:
                    new.append(h)
            seq.num_hashed_blocks = i + 1
        return new

    def prefetch(self, seq: GroupOwner, max_chunk: int | None = None) -> list[int] | None:  # type: ignore[override]
        """As BlockManager.prefetch, the keys `_load_groups` would read if the pool stayed as it is: each
        full group's for the blocks of the tier run after the pool's hit (`_grouped_run`), each sliding
        group's for the window before its end; one run per group. Nothing when the tiers hold no run
        with whole windows (such a load reads nothing either) or the pool has no room for one."""
        if self.tier is None or not self.enable_prefix_caching:
            return None
        n = len(seq.token_ids)
        m, held = self._grouped_hits(seq, n - 1, 0)
        room = max_chunk if max_chunk is not None else n
        run = self._grouped_run(seq, held, n - 1, room)
        if not run:
            return None
        hashes = self._tier_hashes(seq, held[0], m + run)
        runs = []
        for g, w in enumerate(self.windows):
            start = m if w is None else max(m, self._first_live_of(g, (m + run) * self.block_size))
            runs.append([group_key(h, g) for h in hashes[start - m :]])
        return [k for r in runs for k in r] if self.tier.prefetch(*runs) else None

    def check_integrity(self) -> None:
        super().check_integrity()
        for g, index in enumerate(self.index):
            for h, bid in index.items():
                assert self.blocks[bid].hash == h, f"group {g}'s index points at page {bid} with another hash"
                assert self.group_of_page[bid] == g, f"group {g}'s index holds page {bid} of another group"
        for h in self.published:
            assert all(h in index for index in self.index), f"published hash {h} is not in every group"
