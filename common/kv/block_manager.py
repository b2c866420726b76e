"""Block manager: integer bookkeeping of KV blocks. No torch, no I/O.

A block is in exactly one of three pools:
  free      ref_count == 0, no hash          -> handed out first
  used      ref_count  > 0                   -> in some sequence's block table
  cached    ref_count == 0, content hashed   -> evictable (LRU) but still reusable by a prefix hit
free + used + cached == total is checked by check_integrity().

Prefix caching: a full block whose KV has been computed gets a hash chained on its parent block's
hash, so equal hashes mean equal token prefixes. Hashes are stable across processes (blake2b), so a
router can match them against hashes another service published.

KV events: once enable_kv_events() is called, every hash that enters the prefix cache (commit, a tier
load) or leaves it (eviction, in _take) is recorded as (stored, hash, "device") in a deque the engine
thread appends to and another thread drains (drain_kv_events, with the offload tiers' own events:
(held, hash, "ram" | "disk"), recorded when a tier has stored a block a read can return or let go of
it); a publisher turns them into Redis stream entries (common/cluster/kv_events.py). A block evicted
from the pool is so "removed" from the device and, once a tier has written it, "stored" in that tier.
A freed hashed block stays cached, so freeing records nothing. Off by default, so offline use keeps no
buffer that nobody drains.

Offload tiers (`tier`, an `OffloadTier`: common/kv/offload.py): an evicted hashed block is handed to
the tier before the block is reused, and `allocate` continues a prompt's pool prefix with the blocks the
tier can return, read into the freshly taken blocks and hashed only once their KV is there (tier hits
count as cached tokens, like pool hits). `prefetch` (the engine calls it when a request arrives) hands
the tier the hashes `allocate` would ask it for, so it can bring disk blocks into RAM before admission
(with a window as without: see below).

Sliding windows (`window`, set for models whose every layer slides: the largest window; None
otherwise): a block that lies wholly before the window of every query a sequence will still make is
released (`release_window`) and its block-table entry becomes HOLE, a placeholder no attention reads
(the window masks it; common/model/attention.py and the Triton kernel never load it). Holes are always
a prefix of the table: the block holding position p - window + 1 and every later one stay. A released
block is like a freed one: cached if hashed (its KV is right for any prompt sharing that prefix), else
free. `allocate(first=...)` reserves a table whose first blocks are holes already (a decode service's
reservation for a prompt whose KV comes window-only, a swap-in), so only the window's blocks count.
An admission with a window takes blocks for its first chunk only (`room`), but with offload tiers also
for the run of blocks the tiers hold after the pool's prefix (`_tier_run`, their index), as far as free
blocks allow: a long prompt is read back whole, not only its first chunk, and the blocks before the
window are released after the step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from common.prefix_hash import DEVICE, ROOT, KVEvent, KVHeld, block_hash

SNAPSHOT_TRIES = 8  # cached_hashes(): copies attempted while the engine thread changes the index
HOLE = -1  # a block-table entry whose block slid out of every layer's window and was released


def free_window(layer_windows: Seq[int | None]) -> int | None:
    """The window outside which no layer reads a block: the largest window when every layer slides;
    None when a layer attends to everything (or no layer slides): then no block is ever released."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(w for w in layer_windows if w is not None)


def live_blocks(block_table: Seq[int]) -> list[int]:
    """The blocks a table holds, holes left out (in table order)."""
    return [b for b in block_table if b != HOLE]


class OffloadTier(Protocol):
    """Where evicted prefix-cache blocks go, and come back from (common/kv/offload.py)."""

    def evicted(self, block_id: int, block_hash: int, tokens: tuple[int, ...], publish: bool = True) -> None:
        """A hashed block leaves the pool: its KV is still in the block (copy it before the next write).
        publish=False: the tiers hold it without KV events (a key no router matches)."""

    def load(self, hashes: Seq[int], tokens: Seq[tuple[int, ...]], block_ids: Seq[int]) -> int:
        """Write the KV of the longest run of leading `hashes` the tier returns (verified) into
        `block_ids`; returns how many blocks it wrote."""

    def holds(self, keys: Seq[int]) -> list[bool]:
        """Which keys the tiers hold now (their index; no read: a read may still return fewer)."""
        ...

    def prefetch(self, *runs: Seq[int]) -> bool:
        """A request arrived whose admission will ask `load` for these keys (a leading part of each
        run; with layer groups a run per group): start bringing them nearer (off the caller's thread;
        never waits). Whether a prefetch started."""
        ...

    def prefetching(self, keys: Seq[int]) -> bool:
        """Whether a prefetch started by `prefetch` still brings any of `keys` from the disk."""
        ...

    def enable_events(self) -> None:
        """Record the tier's own KV events from now on."""

    def drain_events(self) -> list[KVEvent]:
        """(held, hash, tier) since the last drain: a tier stored a block a read can return, or let go."""
        ...

    def held_hashes(self) -> list[KVHeld]:
        """Every (hash, tier) the tiers hold now."""
        ...


class BlockOwner(Protocol):
    """What the block manager needs from a sequence."""

    token_ids: list[int]
    block_table: list[int]
    num_cached_tokens: int
    num_hashed_blocks: int


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = field(default=())  # kept to rule out hash collisions


class BlockManager:
    # Whether a prefix hit checks each layer's window only (common/kv/layer_groups.py): then KV that
    # arrived window-only may be hashed; here a hit takes every block of the prefix, so it may not.
    hits_need_windows_only = False

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int | None = None
    ) -> None:
        assert num_blocks > 0 and block_size > 0, "need at least one block of at least one token"
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {window}")
        self.window = window  # every layer's keys lie within this many positions (module doc); None: all
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached_ids: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.hash_to_block: dict[int, int] = {}
        self.num_used = 0
        self.prefix_queries = 0  # blocks looked up / found, for the prefix-cache hit rate
        self.prefix_hits = 0
        # KV events, appended by the engine thread after each change to hash_to_block and drained by
        # another thread (deque append/popleft are atomic); None while events are off.
        self.kv_events: deque[KVEvent] | None = None
        self.tier: OffloadTier | None = None  # offload tiers behind the pool (module doc); None: off
        self.tier_hits = 0  # blocks loaded from a tier at admission

    # --- capacity ---------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        """Layer groups, each with its table (common/kv/layer_groups.py): the pages a block of tokens
        takes in every table. One here."""
        return 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self.free_ids) + len(self.cached_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_live(self, num_computed: int) -> int:
        """The first block a sequence whose KV is computed up to `num_computed` tokens still reads: the
        one holding position num_computed - window + 1 (its next query is at num_computed, and later
        ones see later keys only); 0 without a window."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def most_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens, computed `max_chunk` at a time at most,
        holds at once: all of them without a window; with one, a chunk's and the window before it
        (admission and growth take the blocks of the next chunk only: `allocate(room=...)`)."""
        whole = self.blocks_needed(num_tokens)
        if self.window is None:
            return whole
        return min(whole, (self.window + max_chunk - 1) // self.block_size + 2)

    def _prefix_hits(self, token_ids: Seq[int], num_tokens: int, root: int = ROOT) -> list[int]:
        """Block ids holding the longest cached prefix of token_ids (full blocks only) under the chain
        root of the sequence's cache salt."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent, bs = root, self.block_size
        for i in range(num_tokens // bs):
            toks = token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, toks)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].tokens != tuple(toks):
                break
            hits.append(bid)
            parent = h
        return hits

    def can_allocate(
        self,
        seq: BlockOwner,
        num_tokens: int | None = None,
        reserve: int = 0,
        use_prefix_cache: bool = True,
        first: int = 0,
        room: int | None = None,
    ) -> bool:
        """Room for `num_tokens` (default: all of seq's tokens) plus `reserve` spare blocks? `first`
        and `room` as in allocate: holes need no block, and with `room` only the blocks up to the
        cached prefix plus `room` tokens count."""
        n, first, limit = self._span(seq, num_tokens, first)
        hits = self._prefix_hits(seq.token_ids, limit, _root(seq)) if use_prefix_cache else []
        held = hits[first:]
        evictable_hits = sum(1 for b in held if self.blocks[b].ref_count == 0)
        need = self.blocks_needed(self._target(n, len(hits), room)) - first - len(held) + reserve
        return need <= self.num_free_blocks - evictable_hits

    def _target(self, num_tokens: int, num_hits: int, room: int | None) -> int:
        """Tokens an allocation gives blocks for: all `num_tokens`, or with `room` the prefix hits and
        `room` tokens after them."""
        if room is None:
            return num_tokens
        assert room > 0, f"room for {room} tokens"
        return min(num_tokens, num_hits * self.block_size + room)

    def _span(self, seq: BlockOwner, num_tokens: int | None, first: int) -> tuple[int, int, int]:
        """An allocation's tokens (`num_tokens`, default all of seq's), its leading holes (checked), and
        the tokens a prefix hit may cover: all but the last token, which the step computing it samples
        from."""
        n = len(seq.token_ids) if num_tokens is None else num_tokens
        return n, self._check_first(first, n), min(n, len(seq.token_ids) - 1)

    def _check_first(self, first: int, num_tokens: int) -> int:
        if first == 0:
            return 0
        if self.window is None or not 0 < first <= self.first_live(num_tokens):
            raise ValueError(
                f"{first} leading holes for {num_tokens} tokens: only the blocks before the window of a "
                f"model whose every layer slides may be left out (window {self.window}, up to "
                f"{self.first_live(num_tokens)} blocks)"
            )
        return first

    # --- allocation -------------------------------------------------------------------------------
    def _take(self) -> int:
        if self.free_ids:
            bid = self.free_ids.popleft()
        else:
            assert self.cached_ids, "out of KV blocks: callers must check can_allocate/can_append first"
            bid, _ = self.cached_ids.popitem(last=False)  # evict the least recently used
            blk = self.blocks[bid]
            evicted, tokens, blk.hash, blk.tokens = blk.hash, blk.tokens, None, ()
            assert evicted is not None, f"cached block {bid} has no hash"
            if self.tier is not None:
                self.tier.evicted(bid, evicted, tokens)
            del self.hash_to_block[evicted]
            if self.kv_events is not None:
                self.kv_events.append((False, evicted, DEVICE))
        self.blocks[bid].ref_count = 1
        self.num_used += 1
        return bid

    def _ref(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            del self.cached_ids[bid]
            self.num_used += 1
        blk.ref_count += 1

    def allocate(
        self,
        seq: BlockOwner,
        num_tokens: int | None = None,
        use_prefix_cache: bool = True,
        first: int = 0,
        room: int | None = None,
    ) -> None:
        """Give seq blocks for its first `num_tokens` tokens, reusing cached prefix blocks.

        `room` (a windowed model's chunked prefill): blocks only up to the cached prefix and `room`
        tokens after it; `grow` adds the next chunk's before it is computed, and `release_window` lets
        go of what the window left behind, so a long prompt never holds all its blocks at once.

        `first` (> 0 only with a window): the table's first `first` entries are HOLEs, blocks nobody will
        read (before the window of the sequence's next query: at most first_live(num_tokens)); prefix
        hits among them are not taken, and the offload tiers load nothing into them.

        Sets seq.num_cached_tokens: tokens whose KV is already in the reused blocks. At least one
        token is always left to compute, because the step that computes it samples the next token; so
        a prompt of whole blocks reuses all but its last block, whose KV is computed again into a block
        of its own: a reused block is never written (another sequence may be reading it).
        """
        assert not seq.block_table, "sequence already holds blocks"
        n, first, limit = self._span(seq, num_tokens, first)
        hits = self._prefix_hits(seq.token_ids, limit, _root(seq)) if use_prefix_cache else []
        self.prefix_queries += len(seq.token_ids) // self.block_size
        self.prefix_hits += len(hits)
        held = hits[first:]
        for bid in held:
            self._ref(bid)
        target = self._target(n, len(hits), room)
        if room is not None and first == 0 and use_prefix_cache:  # a window's first chunk, after a tier run
            spare = self.num_free_blocks - (self.blocks_needed(target) - len(held))
            target = self._target(n, len(hits) + min(spare, self._tier_run(seq, hits, limit)), room)
        fresh = [self._take() for _ in range(self.blocks_needed(target) - first - len(held))]
        seq.block_table = [HOLE] * first + held + fresh
        seq.num_hashed_blocks = len(hits) if len(hits) >= first else 0  # a hole ends the hash chain
        loaded = 0
        if use_prefix_cache and len(hits) >= first:  # the tiers continue the hits, never into a hole
            # short of the prompt: the last fresh block is left for the chunk to compute into
            loaded = self._load_from_tier(seq, limit, hits, fresh[: len(fresh) - (target < n)])
        seq.num_cached_tokens = (len(hits) + loaded) * self.block_size

    def _tier_hashes(self, seq: BlockOwner, hits: Seq[int], end: int) -> list[int]:
        """The hashes of seq's blocks after its pool hit (`hits`, the blocks of its first len(hits)) up
        to block `end`, stopping at the first the pool's index holds: those a tier read may continue
        the hit with (`_load_from_tier`; the pool's copy of a block stays the one in the index)."""
        bs, out = self.block_size, []
        parent = self.blocks[hits[-1]].hash if hits else _root(seq)
        assert parent is not None, "a prefix hit has a hash"
        for i in range(len(hits), end):
            parent = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            if parent in self.hash_to_block:
                break
            out.append(parent)
        return out

    def _tier_run(self, seq: BlockOwner, hits: Seq[int], limit: int) -> int:
        """With a window, how many blocks after a pool hit (`hits`) the tiers hold now (their
        index, no read): an admission takes blocks for them besides its first chunk's, as for a pool
        hit, so a long prompt is read back whole, not only its first chunk (its blocks before the
        window are released after the step). 0 without tiers."""
        if self.tier is None or not self.enable_prefix_caching:
            return 0
        held = self.tier.holds(self._tier_hashes(seq, hits, limit // self.block_size))
        return held.index(False) if False in held else len(held)

    def _load_from_tier(self, seq: BlockOwner, limit: int, hits: list[int], fresh: list[int]) -> int:
        """Continue seq's pool prefix (`hits`) with the blocks the offload tier returns, read into the
        first `fresh` blocks and hashed as a commit would; returns how many. The chain stops at a hash
        the pool holds already (its copy there stays the one in the index)."""
        if self.tier is None or not self.enable_prefix_caching:
            return 0
        bs, start = self.block_size, len(hits)
        hashes = self._tier_hashes(seq, hits, min(limit // bs, start + len(fresh)))
        if not hashes:
            return 0
        tokens = [tuple(seq.token_ids[i * bs : (i + 1) * bs]) for i in range(start, start + len(hashes))]
        loaded = self.tier.load(hashes, tokens, fresh[: len(hashes)])
        for h, toks, bid in zip(hashes[:loaded], tokens, fresh, strict=False):
            blk = self.blocks[bid]
            blk.hash, blk.tokens = h, toks
            self.hash_to_block[h] = bid
            if self.kv_events is not None:
                self.kv_events.append((True, h, DEVICE))
        seq.num_hashed_blocks = start + loaded
        self.tier_hits += loaded
        return loaded

    def prefetch(self, seq: BlockOwner, max_chunk: int | None = None) -> list[int] | None:
        """A sequence arrived: hand the offload tier the hashes its admission would ask the tier for if
        the pool stayed as it is now (the full prompt blocks after the pool's prefix, up to a hash the
        pool holds), so it can start reading them (common/kv/tiers.py, "Prefetch on arrival"). With a
        window, `max_chunk` is the admission's first chunk (the most a step computes; None: the whole
        prompt): it takes blocks for the run the tiers hold and that chunk (`allocate`). The keys, if
        the tier started a prefetch (`OffloadTier.prefetching` tells when it is done); else None."""
        if self.tier is None or not self.enable_prefix_caching:
            return None
        n = len(seq.token_ids)
        limit = n - 1
        hits = self._prefix_hits(seq.token_ids, limit, _root(seq))
        target = self._target(n, len(hits), None)
        if self.window is not None and max_chunk is not None:
            target = self._target(n, len(hits) + self._tier_run(seq, hits, limit), max_chunk)
        end = min(limit // self.block_size, self.blocks_needed(target) - (target < n))  # as allocate
        hashes = self._tier_hashes(seq, hits, end)
        return hashes if hashes and self.tier.prefetch(hashes) else None

    def can_append(self, seq: BlockOwner, num_new_tokens: int = 1) -> bool:
        need = self.blocks_needed(len(seq.token_ids) + num_new_tokens - 1) - len(seq.block_table)
        return need <= self.num_free_blocks

    def can_grow(self, seq: BlockOwner, num_tokens: int) -> bool:
        """Room to give seq blocks up to its first `num_tokens` tokens?"""
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: BlockOwner, num_tokens: int) -> None:
        """Give seq blocks up to its first `num_tokens` tokens (none if it has them)."""
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take())

    def append_slots(self, seq: BlockOwner, num_new_tokens: int = 1) -> None:
        """Make room for seq's tokens up to len(token_ids) + num_new_tokens - 1."""
        need = self.blocks_needed(len(seq.token_ids) + num_new_tokens - 1) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take())

    def _unref(self, bid: int) -> None:
        blk = self.blocks[bid]
        assert blk.ref_count > 0, f"double free of block {bid}"
        blk.ref_count -= 1
        if blk.ref_count == 0:
            self.num_used -= 1
            if blk.hash is not None:
                self.cached_ids[bid] = None
            else:
                self.free_ids.append(bid)

    def free(self, seq: BlockOwner) -> None:
        """Release seq's blocks. Hashed blocks stay reusable (cached) until evicted."""
        for bid in reversed(seq.block_table):  # tail first: evicted before the shared prefix
            if bid != HOLE:
                self._unref(bid)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def release_window(self, seq: BlockOwner, num_computed: int) -> int:
        """Release seq's blocks that lie wholly before the window of its next query (at `num_computed`,
        the tokens whose KV is computed), leaving HOLEs in their place; returns how many. Commit first:
        a block released unhashed stays so. A no-op without a window."""
        table, released = seq.block_table, 0
        i = min(self.first_live(num_computed), len(table)) - 1
        while i >= 0 and table[i] != HOLE:  # holes are a prefix: stop at the first one met
            self._unref(table[i])
            table[i] = HOLE
            released += 1
            i -= 1
        return released

    def live_pages(self, seq: BlockOwner, width: int | None = None) -> list[int]:
        """The blocks seq's table holds among its first `width` entries (all: None), holes left out, in
        table order: what a swap copies out, and back into the same places."""
        return [b for b in seq.block_table[:width] if b != HOLE]

    def num_held(self, seq: BlockOwner) -> int:
        """Blocks seq holds: its table less the holes."""
        return sum(1 for b in seq.block_table if b != HOLE)

    def commit(self, seq: BlockOwner, num_computed_tokens: int) -> list[int]:
        """Hash the full blocks whose KV is now computed; returns the new hashes (for KV events)."""
        if not self.enable_prefix_caching:
            return []
        bs, new = self.block_size, []
        for i in range(seq.num_hashed_blocks, num_computed_tokens // bs):
            if seq.block_table[i] == HOLE or (i > 0 and seq.block_table[i - 1] == HOLE):
                break  # a released block's hash is gone from the table: the chain ends there
            parent = self.blocks[seq.block_table[i - 1]].hash if i > 0 else _root(seq)
            if parent is None:  # parent's content is owned elsewhere under that hash: stop the chain
                break
            toks = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, toks)
            blk = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block and blk.hash is None:
                blk.hash, blk.tokens = h, toks
                self.hash_to_block[h] = blk.block_id
                new.append(h)
                if self.kv_events is not None:
                    self.kv_events.append((True, h, DEVICE))
            elif blk.hash != h:
                break  # same content computed twice concurrently; keep this copy private
            seq.num_hashed_blocks = i + 1
        return new

    # --- KV events -------------------------------------------------------------------------------
    def enable_kv_events(self) -> None:
        """Record KV events from now on (see the module docstring); drain them regularly."""
        if self.kv_events is None:
            self.kv_events = deque()
        if self.tier is not None:
            self.tier.enable_events()

    def drain_kv_events(self) -> list[KVEvent]:
        """The events recorded since the last drain, oldest first: the pool's, then the tiers' (each
        hash's events keep their order within a tier, and tiers are independent). Safe to call from
        another thread than the engine's (one drainer at a time)."""
        events = self.kv_events
        if events is None:
            return []
        out = [events.popleft() for _ in range(len(events))]
        if self.tier is not None:
            out += self.tier.drain_events()
        return out

    def cached_hashes(self) -> list[KVHeld]:
        """Every (hash, tier) held now, for a snapshot: the prefix cache's (blocks in use and cached
        ones) as "device", then the offload tiers'. Safe from another thread: a copy the engine thread
        disturbs is taken again."""
        held = self.tier.held_hashes() if self.tier is not None else []
        for _ in range(SNAPSHOT_TRIES - 1):
            try:
                return [(h, DEVICE) for h in self.hash_to_block] + held
            except RuntimeError:  # "dictionary changed size during iteration"
                continue
        return [(h, DEVICE) for h in self.hash_to_block] + held

    # --- invariants -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        free, cached = len(self.free_ids), len(self.cached_ids)
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert used == self.num_used, f"used count drifted: counted {used}, tracked {self.num_used}"
        assert free + used + cached == self.num_blocks, (
            f"block accounting broken: free {free} + used {used} + cached {cached} != {self.num_blocks}"
        )
        assert len(set(self.free_ids)) == free, "a block is twice in the free list"
        for bid in self.free_ids:
            b = self.blocks[bid]
            assert b.ref_count == 0 and b.hash is None, f"free block {bid} is referenced or hashed"
        for bid in self.cached_ids:
            b = self.blocks[bid]
            assert b.ref_count == 0 and b.hash is not None, f"cached block {bid} is referenced or unhashed"
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h, f"hash index points at block {bid} with another hash"


def _root(seq: object) -> int:
    """The chain root of a sequence's cache salt (common/prefix_hash.py); ROOT for owners without one."""
    return int(getattr(seq, "cache_root", ROOT))
