"""The KV pool's side of the offload tiers (common/kv/tiers.py): the block manager's `OffloadTier`.

Out: when the prefix cache evicts a hashed block (its KV complete: a block is hashed only once its KV
is computed, or once every layer of a transfer has arrived) the block manager calls `evicted` before
handing the block to anyone. Its id is noted; `flush` — the engine calls it after each schedule(),
before anything writes into the pool — copies the noted blocks out of the pool in one gather and
offers them to the store as one chunk. A write into the pool never comes between an eviction and its
copy: `load` copies them out first too, and offers them once its own read is done.

In: at admission the block manager asks `load` for the blocks that continue a prompt's pool prefix;
what the store returns (verified) is copied into the freshly allocated blocks before the block manager
hashes them, so a block is in the prefix cache only once its KV is there. Earlier, when the request
arrived, `prefetch` handed the store the same hashes: its prefetch worker brings the disk-only ones
into RAM meanwhile (common/kv/tiers.py, "Prefetch on arrival"), so `load` reads them from RAM when the
prefetch finished first, and from the disk as before when not.

KV events: what the store comes to hold and lets go of (common/kv/tiers.py) is the block manager's to
drain with its own (`drain_events`, `held_hashes`), so a service publishes one stream naming each hash's tier.

A chunk's payload is block-major: block i is one contiguous run of (2, layers, block_size, kv_heads,
head_dim) values of the cache's dtype, K then V: any subset of blocks is a byte slice.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence

import torch

from common.kv.kv_cache import PagedKVCache
from common.kv.tiers import StoreStats, TierEvent, TierStore

log = logging.getLogger("splitserve.kv_tiers")

CHUNK_BLOCKS = 16  # blocks per offered chunk at most
PAYLOAD_LAYOUT = "block-major-kv-v1"  # named in the digest: a payload laid out otherwise never verifies


def layout_digest(compat: str, cache: PagedKVCache) -> bytes:
    """16 bytes naming what a tier record's bytes mean: the model and KV layout (`compat`: the
    engine's KVCompat record, fp8 scales' digest and tensor-parallel shard included), the cache's shape
    and dtype, and the payload layout."""
    s = cache.spec
    shape = (s.num_layers, s.block_size, s.num_kv_heads, s.head_dim, str(s.dtype))
    h = hashlib.blake2b(digest_size=16, person=b"splitserve-kvtr")
    h.update(f"{compat}|{shape}|{PAYLOAD_LAYOUT}".encode())
    return h.digest()


class KVOffload:
    """The block manager's OffloadTier over one PagedKVCache and its TierStore (module doc)."""

    def __init__(self, cache: PagedKVCache, store: TierStore) -> None:
        self.cache, self.store = cache, store
        s = cache.spec
        self.block_shape = (2, s.num_layers, s.block_size, s.num_kv_heads, s.head_dim)
        self._pending: list[tuple[int, int, tuple[int, ...]]] = []  # (block id, hash, tokens), evicted
        # copied out of the pool, not offered yet: (hashes, tokens, block-major bytes)
        self._copied: list[tuple[list[int], list[tuple[int, ...]], torch.Tensor]] = []
        self.offered_blocks = 0

    @classmethod
    def create(
        cls,
        cache: PagedKVCache,
        compat: str,
        ram_gb: float,
        disk_dir: str | None,
        disk_gb: float,
    ) -> KVOffload:
        s = cache.spec
        block_bytes = s.bytes_per_block
        store = TierStore(
            layout_digest(compat, cache),
            s.block_size,
            block_bytes,
            ram_bytes=int(ram_gb * 2**30),
            disk_dir=os.path.expanduser(disk_dir) if disk_dir else None,
            disk_bytes=int(disk_gb * 2**30),
        )
        tiers = [f"RAM {ram_gb:g} GiB"] if ram_gb > 0 else []
        if store.slot is not None:
            tiers.append(f"disk {disk_gb:g} GiB in {store.slot}")
        log.info("KV offload tiers: %s (%d KiB a block)", ", ".join(tiers), block_bytes // 1024)
        return cls(cache, store)

    # --- the block manager's OffloadTier ----------------------------------------------------------
    def evicted(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        if self.store.wants(block_hash):
            self._pending.append((block_id, block_hash, tokens))
            if len(self._pending) >= CHUNK_BLOCKS:
                self._copy_out()

    def load(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]], block_ids: Sequence[int]) -> int:
        # The evicted blocks' KV out before anything is written into the pool, but offered only after
        # the read: the blocks this allocation evicted must not push what it reads out of a full tier
        # (the router predicted the read from what the tiers held; a tier as small as the pool would
        # otherwise lose the prompt's own blocks to its eviction while the read runs).
        self._copy_out()
        try:
            got = self.store.read(hashes, tokens)
            for buf, bid in zip(got, block_ids, strict=False):
                kv = (
                    torch.frombuffer(buf, dtype=torch.uint8)
                    .view(self.cache.spec.dtype)
                    .view(self.block_shape)
                )
                self.cache.k[:, bid].copy_(kv[0])
                self.cache.v[:, bid].copy_(kv[1])
        finally:
            self._offer()
        return len(got)

    def prefetch(self, hashes: Sequence[int]) -> bool:
        return self.store.prefetch(hashes)

    def enable_events(self) -> None:
        self.store.enable_events()

    def drain_events(self) -> list[TierEvent]:
        return self.store.drain_events()

    def held_hashes(self) -> list[tuple[int, str]]:
        return self.store.held()

    def read_ms_per_block(self) -> dict[str, float]:
        """Each tier's measured read cost in ms per block (for the registry's load: the router weighs
        a tier hit against recomputing with it); a tier that returned nothing yet is left out."""
        return {t: round(s * 1000, 4) for t, s in self.store.read_s_per_block().items()}

    # --- the engine's -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Copy the blocks evicted since the last flush out of the pool and offer them (a chunk of at
        most CHUNK_BLOCKS each)."""
        self._copy_out()
        self._offer()

    def _copy_out(self) -> None:
        """Copy the pending evicted blocks out of the pool (one gather), to offer later."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        idx = torch.tensor([b for b, _, _ in pending], dtype=torch.long, device=self.cache.k.device)
        # (n, 2, L, bs, kv_heads, hd): block-major, K then V within a block
        kv = torch.stack((self.cache.k[:, idx], self.cache.v[:, idx])).permute(2, 0, 1, 3, 4, 5)
        data = kv.contiguous().to("cpu").view(torch.uint8).reshape(-1)
        self._copied.append(([h for _, h, _ in pending], [t for _, _, t in pending], data))

    def _offer(self) -> None:
        copied, self._copied = self._copied, []
        for hashes, tokens, data in copied:
            self.store.offer(hashes, tokens, memoryview(data.numpy().data))
            self.offered_blocks += len(hashes)

    def stats(self) -> StoreStats:
        return self.store.stats()

    def close(self) -> None:
        self.flush()
        self.store.close()
