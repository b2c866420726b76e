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
count as cached tokens, like pool hits).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from common.prefix_hash import DEVICE, ROOT, KVEvent, KVHeld, block_hash

SNAPSHOT_TRIES = 8  # cached_hashes(): copies attempted while the engine thread changes the index


class OffloadTier(Protocol):
    """Where evicted prefix-cache blocks go, and come back from (common/kv/offload.py)."""

    def evicted(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """A hashed block leaves the pool: its KV is still in the block (copy it before the next write)."""

    def load(self, hashes: Seq[int], tokens: Seq[tuple[int, ...]], block_ids: Seq[int]) -> int:
        """Write the KV of the longest run of leading `hashes` the tier returns (verified) into
        `block_ids`; returns how many blocks it wrote."""

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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0, "need at least one block of at least one token"
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
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self.free_ids) + len(self.cached_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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
        self, seq: BlockOwner, num_tokens: int | None = None, reserve: int = 0, use_prefix_cache: bool = True
    ) -> bool:
        """Room for `num_tokens` (default: all of seq's tokens) plus `reserve` spare blocks?"""
        n = len(seq.token_ids) if num_tokens is None else num_tokens
        limit = min(n, len(seq.token_ids) - 1)
        hits = self._prefix_hits(seq.token_ids, limit, _root(seq)) if use_prefix_cache else []
        evictable_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        need = self.blocks_needed(n) - len(hits) + reserve
        return need <= self.num_free_blocks - evictable_hits

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

    def allocate(self, seq: BlockOwner, num_tokens: int | None = None, use_prefix_cache: bool = True) -> None:
        """Give seq blocks for its first `num_tokens` tokens, reusing cached prefix blocks.

        Sets seq.num_cached_tokens: tokens whose KV is already in the reused blocks. At least one
        token is always left to compute, because the step that computes it samples the next token; so
        a prompt of whole blocks reuses all but its last block, whose KV is computed again into a block
        of its own: a reused block is never written (another sequence may be reading it).
        """
        assert not seq.block_table, "sequence already holds blocks"
        n = len(seq.token_ids) if num_tokens is None else num_tokens
        limit = min(n, len(seq.token_ids) - 1)
        hits = self._prefix_hits(seq.token_ids, limit, _root(seq)) if use_prefix_cache else []
        self.prefix_queries += len(seq.token_ids) // self.block_size
        self.prefix_hits += len(hits)
        for bid in hits:
            self._ref(bid)
        fresh = [self._take() for _ in range(self.blocks_needed(n) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_hashed_blocks = len(hits)
        loaded = self._load_from_tier(seq, limit, hits, fresh) if use_prefix_cache else 0
        seq.num_cached_tokens = (len(hits) + loaded) * self.block_size

    def _load_from_tier(self, seq: BlockOwner, limit: int, hits: list[int], fresh: list[int]) -> int:
        """Continue seq's pool prefix (`hits`) with the blocks the offload tier returns, read into the
        first `fresh` blocks and hashed as a commit would; returns how many. The chain stops at a hash
        the pool holds already (its copy there stays the one in the index)."""
        if self.tier is None or not self.enable_prefix_caching:
            return 0
        bs, start = self.block_size, len(hits)
        parent = self.blocks[hits[-1]].hash if hits else _root(seq)
        assert parent is not None, "a prefix hit has a hash"
        hashes: list[int] = []
        tokens: list[tuple[int, ...]] = []
        for i in range(start, limit // bs):
            toks = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = block_hash(parent, toks)
            if parent in self.hash_to_block:
                break
            hashes.append(parent)
            tokens.append(toks)
        if not hashes:
            return 0
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

    def can_append(self, seq: BlockOwner, num_new_tokens: int = 1) -> bool:
        need = self.blocks_needed(len(seq.token_ids) + num_new_tokens - 1) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: BlockOwner, num_new_tokens: int = 1) -> None:
        """Make room for seq's tokens up to len(token_ids) + num_new_tokens - 1."""
        need = self.blocks_needed(len(seq.token_ids) + num_new_tokens - 1) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take())

    def free(self, seq: BlockOwner) -> None:
        """Release seq's blocks. Hashed blocks stay reusable (cached) until evicted."""
        for bid in reversed(seq.block_table):  # tail first: evicted before the shared prefix
            blk = self.blocks[bid]
            assert blk.ref_count > 0, f"double free of block {bid}"
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self.num_used -= 1
                if blk.hash is not None:
                    self.cached_ids[bid] = None
                else:
                    self.free_ids.append(bid)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def commit(self, seq: BlockOwner, num_computed_tokens: int) -> list[int]:
        """Hash the full blocks whose KV is now computed; returns the new hashes (for KV events)."""
        if not self.enable_prefix_caching:
            return []
        bs, new = self.block_size, []
        for i in range(seq.num_hashed_blocks, num_computed_tokens // bs):
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
