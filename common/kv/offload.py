"""The KV pool's side of the offload tiers (common/kv/tiers.py): the block manager's `OffloadTier`.

Out: when the prefix cache evicts a hashed block (its KV complete: a block is hashed only once its KV
is computed, or once every layer of a transfer has arrived) the block manager calls `evicted` before
handing the block to anyone. Its id is noted; `flush` — the engine calls it after each schedule(),
before anything writes into the pool — copies the noted blocks out of the pool in one gather and
offers them to the store as one chunk (from a GPU pool: into pinned host memory, `gather_blocks`).
A write into the pool never comes between an eviction and its copy: `load` copies them out first
too, and leaves their offer to the next `flush`, after every read of the schedule.

In: at admission the block manager asks `load` for the blocks that continue a prompt's pool prefix;
what the store returns has been read and verified in host memory, so putting it into the freshly
allocated blocks cannot fail: `load` hands the bytes to the pool's `LayerLoads` (the engine's
kv_offload_load "layerwise", what "auto" means for a GPU pool), which copies them in slot by slot
(layer by layer) while the step computes, each layer's attention waiting for its own slot; every
other reader or writer of the pool (the engine after the step, swaps, the evicted blocks' copy-out,
a replayed CUDA graph) settles the copies first (common/kv/layer_loads.py). "whole" ("auto" for a
CPU pool, where a copy thread only competes with the step for the cores: `bench tier-load`; and
tensor parallelism, whose ranks each write their heads) copies them in before `load` returns
(`put_blocks`, then `scatter_blocks`: into a GPU pool one copy a run of the RAM tier's pinned
slots, or one of a pinned staging buffer for a disk read, one `index_copy_` each for K and V,
waited for: a loaded block may be pushed by a prefill's KV sender, which reads outside the compute
stream's order). Either way the block manager hashes the blocks at once: no reader outside
a step's layers sees them before the copies are done. Earlier, when the request arrived, `prefetch`
handed the store the same hashes: its prefetch worker brings the disk-only ones into RAM meanwhile
(common/kv/tiers.py, "Prefetch on arrival"), and while it does the scheduler leaves the request
waiting if others run, so `load` reads them from RAM; from the disk as before when the prefetch was
not done (nothing else ran, or its wait ran out).

Tensor parallelism (`peers`: the worker ranks, common/engine/tp_workers.py). Every rank's pool has
the same blocks, each with only its own KV heads; rank 0 (this object) holds the one store, and a
chunk holds the *whole* KV of its blocks, all heads: chunks and the layout digest do not depend on
the tensor-parallel size (`create` is given the whole model's compat record and head count). Copying
out is one synchronous round trip: rank 0 asks each worker for its heads of the blocks
(`ShardPeers.tier_out`), gathers its own meanwhile, waits for theirs and puts each in its place on the
head axis (a head replicated on several ranks, as with more ranks than KV heads, is taken from the
first one), so the blocks' KV is out of every rank before anything can write into them (an evicted
block may be handed to another sequence in the same schedule, and a decode rank's KV receiver writes
into a reservation soon after). Blocks a worker fails to hand over are not offered
(`dropped_blocks`, logged). Loading sends each worker its heads (`ShardPeers.tier_in`) and writes rank
0's own meanwhile; the blocks count as loaded only once every rank acknowledged them: a worker that
fails or is gone makes the load a miss (0, recomputed), never a partial success across ranks.

A disk dearer than recomputing (`disk_reads` "auto", the engine's default). A tier hit must cost less
than the prefill it saves, or it only adds latency: a slow or throttled disk (a network volume, a
shared device) reads a block in more time than the prefill computes its tokens. So `load` reads the
disk only while the disk's recent read cost per block (`TierStore.disk_read_s_per_block`: a moving
average over admissions' and prefetches' chunk reads) plus putting a block into the pool is at most
what recomputing a block costs now (`recompute_s_per_block`: the engine's block_size / its prefill
speed on steps of long prompts, StepSpeed.long_prefill_tps: a short prompt's step is mostly fixed cost);
otherwise it reads RAM only and leaves the rest to be computed (`disk_skipped_blocks`). Prefetches still
run (what they promote is a RAM hit later, and their reads keep the disk's figure current), but the
scheduler does not hold a request back for one (`prefetching` says no). When nothing has read the disk
for DISK_PROBE_S (a disk tier without RAM has no prefetches), the tiers' writer thread reads one chunk
to measure it again (`TierStore.probe_disk`): a disk that got faster is read again, and no admission
pays for finding out. "always" reads every hit.

KV events: what the store comes to hold and lets go of (common/kv/tiers.py) is the block manager's to
drain with its own (`drain_events`, `held_hashes`), so a service publishes one stream naming each hash's tier.

A chunk's payload is block-major: block i is one contiguous run of (2, layers, block_size, kv_heads,
head_dim) values of the cache's dtype, K then V (kv_heads: all the model's; layers: every layer, or with
layer groups a page's few, common/kv/layer_groups.py): any subset of blocks is a byte slice. One
rank's share (`gather_blocks`, `scatter_blocks`) is laid out the same way with only its heads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.kv.layer_loads import LayerLoads, runs
from common.kv.tiers import StoreStats, TierEvent, TierStore

log = logging.getLogger("splitserve.kv_tiers")

CHUNK_BLOCKS = 16  # blocks per offered chunk at most
DISK_PROBE_S = 30.0  # a disk left alone as too slow, and read by nothing else this long, is measured again
PAYLOAD_LAYOUT = "block-major-kv-v1"  # named in the digest: a payload laid out otherwise never verifies


def layout_digest(compat: str, cache: PagedKVCache | KVCacheSpec) -> bytes:
    """16 bytes naming what a tier record's bytes mean: the model and KV layout (`compat`: the
    engine's KVCompat record, fp8 scales' digest included), the cache's shape and dtype (with tensor
    parallelism: the whole model's, every KV head), and the payload layout."""
    s = cache.spec if isinstance(cache, PagedKVCache) else cache
    # a block of every layer, or with layer groups a page of a few (common/kv/layer_groups.py)
    shape = (s.shape[0], s.block_size, s.num_kv_heads, s.head_dim, str(s.dtype))
    h = hashlib.blake2b(digest_size=16, person=b"splitserve-kvtr")
    h.update(f"{compat}|{shape}|{PAYLOAD_LAYOUT}".encode())
    return h.digest()


def gather_blocks(cache: PagedKVCache, block_ids: Sequence[int], contiguous: bool = True) -> torch.Tensor:
    """The blocks' KV as host bytes, block-major: uint8 (n, 2, layers, block_size, kv_heads,
    head_dim * element size) (this cache's heads); contiguous=False: a block-major view of a copy
    (to be copied on). From a GPU pool the bytes land in pinned host memory (a direct DMA, not staged
    through a driver buffer), and are all there on return: a block evicted now may be handed to a KV
    receiver right after, which writes into it outside the compute stream's order."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=cache.k.device)
    if not cache.k.is_cuda:
        # (n, 2, L, bs, kv_heads, hd): block-major, K then V within a block
        kv = torch.stack((cache.k[:, idx], cache.v[:, idx])).permute(2, 0, 1, 3, 4, 5)
        return (kv.contiguous() if contiguous else kv).to("cpu").view(torch.uint8)
    # as bytes: the same layout, and no kernel needs to know the dtype (fp8 included)
    k, v = cache.k.view(torch.uint8), cache.v.view(torch.uint8)
    kv = torch.stack((k[:, idx], v[:, idx])).permute(2, 0, 1, 3, 4, 5).contiguous()
    host = torch.empty(kv.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(kv, non_blocking=True)
    torch.cuda.current_stream(kv.device).synchronize()
    return host


def stage_blocks(bufs: Sequence[memoryview], shape: tuple[int, ...], pin: bool = False) -> torch.Tensor:
    """Blocks' bytes (one buffer a block) gathered in one uint8 host tensor of (len(bufs), *shape);
    `pin`: in pinned memory, for one copy to a GPU."""
    out = torch.empty((len(bufs), *shape), dtype=torch.uint8, pin_memory=pin)
    for i, buf in enumerate(bufs):
        out[i] = torch.frombuffer(buf, dtype=torch.uint8).view(shape)
    return out


def put_blocks(cache: PagedKVCache, block_ids: Sequence[int], bufs: Sequence[memoryview]) -> int:
    """Write blocks read from a tier (each buffer one block of this cache's heads, block-major: one
    `gather_blocks` block) into the pool's blocks `block_ids`; done on return (`scatter_blocks`). On
    the CPU each block is written from its own buffer (staging them first took 4x as long here); for a
    GPU, buffers in pinned memory (the RAM tier's own slots) are copied from where they are, one copy
    a run of adjacent ones, and the rest are staged in one pinned buffer first. Returns the bytes
    staged (0 on a CPU, or when every buffer was pinned)."""
    s = cache.spec
    shape = (2, s.shape[0], s.block_size, s.num_kv_heads, s.head_dim * cache.k.element_size())
    if not cache.k.is_cuda:
        for buf, bid in zip(bufs, block_ids, strict=True):
            _scatter(cache, [bid], torch.frombuffer(buf, dtype=torch.uint8).view(1, *shape))
        return 0
    parts = runs(bufs, shape)
    if all(d.is_pinned() for _, d in parts):
        for first, d in parts:
            _scatter(cache, block_ids[first : first + len(d)], d, wait=False)
        torch.cuda.current_stream(cache.k.device).synchronize()
        return 0
    staged = stage_blocks(bufs, shape, pin=True)
    scatter_blocks(cache, block_ids, staged)
    return staged.numel()


def scatter_blocks(cache: PagedKVCache, block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write block-major bytes (uint8, `gather_blocks`' shape for this cache's heads, any strides
    whose last dimension is dense) into the blocks; done on return. Into a GPU pool: one copy of
    `data` (asynchronous from pinned memory) and one `index_copy_` for K and one for V, on byte views
    (no kernel needs the dtype, fp8 included), then a wait for them (a copy per block from pageable
    memory would wait for the device twice per block): other readers than the step's kernels (a
    prefill's KV sender pushing a tier hit) read the blocks outside the compute stream's order."""
    s = cache.spec
    elem = cache.k.element_size()
    want = (len(block_ids), 2, s.shape[0], s.block_size, s.num_kv_heads, s.head_dim * elem)
    if tuple(data.shape) != want or data.dtype != torch.uint8:
        raise ValueError(f"KV blocks {tuple(data.shape)} {data.dtype}: this cache needs {want} uint8")
    _scatter(cache, block_ids, data)


def _scatter(cache: PagedKVCache, block_ids: Sequence[int], data: torch.Tensor, wait: bool = True) -> None:
    """`scatter_blocks` without the shape check (data is known to be the shape); `wait=False`: the
    caller waits for the device (the copy reads `data` until then)."""
    if not cache.k.is_cuda:
        kv = data.view(cache.spec.dtype)  # (n, 2, L, bs, kv_heads, hd)
        for i, bid in enumerate(block_ids):
            cache.k[:, bid].copy_(kv[i, 0])
            cache.v[:, bid].copy_(kv[i, 1])
        return
    dev = cache.k.device
    kv = data.to(dev, non_blocking=True)
    idx = torch.tensor(list(block_ids), dtype=torch.long).to(dev, non_blocking=True)
    cache.k.view(torch.uint8).index_copy_(1, idx, kv[:, 0].transpose(0, 1))
    cache.v.view(torch.uint8).index_copy_(1, idx, kv[:, 1].transpose(0, 1))
    if wait:
        torch.cuda.current_stream(dev).synchronize()


def _pinned(nbytes: int) -> Any:
    """The RAM tier's memory for a GPU pool (common/kv/tiers.HostArena): pinned host memory, so copies
    to the device run from it asynchronously. `nbytes` is a power of two: the pinned allocator rounds
    every allocation up to one, so the tier's limit holds exactly."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


class ShardPeers(Protocol):
    """The other tensor-parallel ranks' pools (common/engine/tp_workers.TPWorkers), rank 1 first."""

    def tier_out(self, ranks: Sequence[int], block_ids: Sequence[int]) -> None:
        """Ask each of `ranks` for its heads of the blocks (`tier_out_wait` returns them); RuntimeError
        if a rank is gone."""
        ...

    def tier_out_wait(self) -> list[torch.Tensor]:
        """The last `tier_out`'s ranks' heads (`gather_blocks` on each, flat uint8), once every one has
        copied them; RuntimeError if a rank failed or is gone."""
        ...

    def tier_in(self, block_ids: Sequence[int], shards: Sequence[torch.Tensor]) -> None:
        """Send each worker its heads of the blocks to write (`shards[r - 1]`: rank r's, block-major
        uint8, `gather_blocks`' shape on that rank); `tier_in_wait` hears whether they did."""
        ...

    def tier_in_wait(self) -> str:
        """Wait for every rank's answer to the last `tier_in`: "" when all wrote their heads, else why
        not."""
        ...


class KVOffload:
    """The block manager's OffloadTier over one PagedKVCache and its TierStore (module doc).

    With tensor parallelism `peers` are the worker ranks and `head_ranges` every rank's KV heads (rank
    0 first, from common/parallel/partition.kv_head_ranges); the store's blocks hold all of them."""

    def __init__(
        self,
        cache: PagedKVCache,
        store: TierStore,
        peers: ShardPeers | None = None,
        head_ranges: Sequence[range] | None = None,
        load_mode: str = "whole",
        disk_reads: str = "always",
        recompute_s_per_block: Callable[[], float] | None = None,
    ) -> None:
        """`load_mode`: the engine's kv_offload_load (auto, layerwise, inline, whole); `disk_reads`: its
        kv_offload_disk_reads (auto: read a disk hit only while that is cheaper than recomputing it,
        with `recompute_s_per_block`: the engine's seconds to recompute one block now, 0 unknown;
        always)."""
        if disk_reads not in ("auto", "always"):
            raise ValueError(f"KV offload: disk reads {disk_reads!r}, one of auto, always")
        self.cache, self.store, self.peers = cache, store, peers
        self.disk_reads = disk_reads
        self.recompute_s_per_block = recompute_s_per_block
        s = cache.spec
        self.head_ranges = list(head_ranges) if head_ranges is not None else [range(s.num_kv_heads)]
        if len(self.head_ranges[0]) != s.num_kv_heads or (peers is None) != (len(self.head_ranges) == 1):
            raise ValueError(
                f"KV offload: head ranges {self.head_ranges} do not fit rank 0's {s.num_kv_heads} KV heads "
                f"with{'out' if peers is None else ''} worker ranks"
            )
        self.num_kv_heads = max(r.stop for r in self.head_ranges)
        # the ranks whose heads make up a whole block, in head order: a replicated head's first holder
        self._sources: list[int] = []
        covered = 0
        for rank, heads in enumerate(self.head_ranges):
            if heads.start == covered:
                self._sources.append(rank)
                covered = heads.stop
            elif not (heads.start < covered and heads.stop <= covered):
                raise ValueError(f"KV offload: head ranges {self.head_ranges} are not contiguous")
        if covered != self.num_kv_heads:
            raise ValueError(f"KV offload: head ranges {self.head_ranges} leave heads out")
        self._block_bytes = s.bytes_per_block * self.num_kv_heads // s.num_kv_heads
        assert store.block_bytes == self._block_bytes, "the store's blocks hold every KV head"
        # evicted: (block id, hash, tokens, publish: whether its tier events are published)
        self._pending: list[tuple[int, int, tuple[int, ...], bool]] = []
        # copied out of the pool, not offered yet: (hashes, tokens, block-major bytes, the quiet hashes)
        self._copied: list[tuple[list[int], list[tuple[int, ...]], torch.Tensor, set[int]]] = []
        self.offered_blocks = 0
        self.dropped_blocks = 0  # evicted blocks a worker rank did not hand over: never offered
        # the pool's side of the loads: seconds putting read blocks into the pool (with tensor
        # parallelism: the scatter to every rank and their acknowledgements), over the blocks loaded
        self.copy_in_s = 0.0
        self.copy_in_blocks = 0
        self.staged_bytes = 0  # GPU: read bytes copied into pinned memory first (0 from the RAM tier)
        # layer by layer while the step computes (common/kv/layer_loads.py), or None: each load whole
        # before the step (`load_mode` "whole", "auto" on a CPU pool; with tensor parallelism always)
        if load_mode == "auto":
            load_mode = "layerwise" if cache.k.is_cuda else "whole"
        self.loads: LayerLoads | None = None
        if load_mode != "whole" and peers is None:
            self.loads = LayerLoads(cache, "inline" if load_mode == "inline" else "auto")
            cache.loads = self.loads

    @classmethod
    def create(
        cls,
        cache: PagedKVCache,
        compat: str,
        ram_gb: float,
        disk_dir: str | None,
        disk_gb: float,
        peers: ShardPeers | None = None,
        head_ranges: Sequence[range] | None = None,
        load_mode: str = "whole",
        disk_reads: str = "always",
        recompute_s_per_block: Callable[[], float] | None = None,
    ) -> KVOffload:
        """The tiers of `cache`. With tensor parallelism (`peers`, `head_ranges`: see the class doc)
        `compat` must be the whole model's record (tp_size 1), as the store's blocks are."""
        heads = max(r.stop for r in head_ranges) if head_ranges is not None else cache.spec.num_kv_heads
        spec = dataclasses.replace(cache.spec, num_kv_heads=heads)  # what a chunk's block holds
        block_bytes = spec.bytes_per_block
        store = TierStore(
            layout_digest(compat, spec),
            spec.block_size,
            block_bytes,
            ram_bytes=int(ram_gb * 2**30),
            disk_dir=os.path.expanduser(disk_dir) if disk_dir else None,
            disk_bytes=int(disk_gb * 2**30),
            ram_allocate=_pinned if cache.k.is_cuda else None,
        )
        tiers = [f"RAM {ram_gb:g} GiB"] if ram_gb > 0 else []
        if store.slot is not None:
            tiers.append(f"disk {disk_gb:g} GiB in {store.slot}")
        ranks = f", every KV head of the {len(head_ranges)} ranks" if head_ranges is not None else ""
        try:
            off = cls(cache, store, peers, head_ranges, load_mode, disk_reads, recompute_s_per_block)
        except BaseException:
            store.close()
            raise
        how = f"layer by layer ({off.loads.mode})" if off.loads is not None else "whole before the step"
        if peers is not None and load_mode in ("layerwise", "inline"):
            how += f" (tensor parallelism: not {load_mode})"
        log.info(
            "KV offload tiers: %s (%d KiB a block%s); hits go into the KV cache %s",
            ", ".join(tiers), block_bytes // 1024, ranks, how,
        )  # fmt: skip
        return off

    # --- the block manager's OffloadTier ----------------------------------------------------------
    def evicted(self, block_id: int, block_hash: int, tokens: tuple[int, ...], publish: bool = True) -> None:
        if self.store.wants(block_hash):
            self._pending.append((block_id, block_hash, tokens, publish))
            if len(self._pending) >= CHUNK_BLOCKS:
                self._copy_out()

    def load(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]], block_ids: Sequence[int]) -> int:
        # The evicted blocks' KV out before anything is written into the pool, but offered only at the
        # next flush (after the schedule): the blocks the schedule's allocations evicted must not push
        # what they read out of a full tier (the router predicted the reads from what the tiers held; a
        # tier as small as the pool would otherwise lose a prompt's own blocks to its eviction while the
        # reads run, and a grouped pool's first group's read would push out the next group's pages).
        self._copy_out()
        got = self.store.read(hashes, tokens, disk=self.disk_worth())
        if not got:
            return 0
        ids = list(block_ids[: len(got)])
        t0 = time.perf_counter()
        loaded = self._copy_in(got, ids)
        self.copy_in_s += time.perf_counter() - t0
        self.copy_in_blocks += loaded
        return loaded

    def _copy_in(self, got: list[memoryview], ids: list[int]) -> int:
        """The read blocks into the pool's blocks `ids`; how many count as loaded (all, or 0)."""
        if self.loads is not None:  # verified host bytes: copies that cannot fail, layer by layer
            self.loads.add(ids, got)
            return len(got)
        if self.peers is None:
            self.staged_bytes += put_blocks(self.cache, ids, got)
            return len(got)
        return len(got) if self._load_shards(got, ids) else 0

    def _load_shards(self, got: list[memoryview], block_ids: list[int]) -> bool:
        """Every rank's heads of the read blocks into its pool (module doc); False: a worker did not."""
        assert self.peers is not None
        s = self.cache.spec
        elem = self.cache.k.element_size()
        whole = stage_blocks(got, (2, s.shape[0], s.block_size, self.num_kv_heads, s.head_dim * elem))
        shards = [whole[..., h.start : h.stop, :].contiguous() for h in self.head_ranges[1:]]
        self.peers.tier_in(block_ids, shards)  # the workers write theirs while rank 0 writes its own
        own = self.head_ranges[0]
        scatter_blocks(self.cache, block_ids, whole[..., own.start : own.stop, :])
        why = self.peers.tier_in_wait()
        if why:
            log.warning("KV offload: a tier read of %d blocks is a miss: %s", len(got), why)
            return False
        return True

    def prefetch(self, *runs: Sequence[int]) -> bool:
        return self.store.prefetch(*runs)

    def prefetching(self, keys: Sequence[int]) -> bool:
        # a disk dearer than recomputing is not read at admission: nothing to wait for
        return self.store.prefetching(keys) and self.disk_worth()

    def disk_worth(self, probe: bool = True) -> bool:
        """Whether a disk hit is worth reading at admission (module doc, "A disk dearer than
        recomputing"): always, or (auto) unless the disk's recent read cost per block, plus putting a
        block into the pool, is above recomputing one; a figure not measured yet counts as worth it.
        `probe`: when it is not, and nothing read the disk for DISK_PROBE_S, queue a probe (the
        engine's question; a report of the answer passes False)."""
        if self.disk_reads == "always" or self.store.disk is None or self.recompute_s_per_block is None:
            return True
        read = self.store.disk_read_s_per_block()
        recompute = self.recompute_s_per_block()
        if read is None or recompute <= 0:
            return True
        if read + self._copy_in_s_per_block() <= recompute:
            return True
        age = self.store.disk_read_age()
        if probe and age is not None and age > DISK_PROBE_S:  # no read lately (no prefetch measures it)
            self.store.probe_disk()
        return False

    def holds(self, keys: Sequence[int]) -> list[bool]:
        return self.store.holds(keys)

    def enable_events(self) -> None:
        self.store.enable_events()

    def drain_events(self) -> list[TierEvent]:
        return self.store.drain_events()

    def held_hashes(self) -> list[tuple[int, str]]:
        return self.store.held()

    def read_ms_per_block(self) -> dict[str, float]:
        """Each tier's measured cost in ms per block loaded (for the registry's load: the router weighs
        a tier hit against recomputing with it): the tier's read and verification, plus putting the
        block into the pool, the same for every tier (with tensor parallelism the round trip to every
        rank: ~0.5 ms a block at TP 2 here, as much as a RAM read); a tier that returned nothing yet
        is left out."""
        copy_in = self._copy_in_s_per_block()
        return {t: round((s + copy_in) * 1000, 4) for t, s in self.store.read_s_per_block().items()}

    def _copy_in_s_per_block(self) -> float:
        """Seconds putting a loaded block into the pool, as the engine felt it: the copies made before
        the step, plus what the step waited for layer-by-layer copies (0 before the first load)."""
        spent = self.copy_in_s + (self.loads.wait_s if self.loads is not None else 0.0)
        return spent / self.copy_in_blocks if self.copy_in_blocks else 0.0

    # --- the engine's -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Copy the blocks evicted since the last flush out of the pool and offer them (a chunk of at
        most CHUNK_BLOCKS each)."""
        self._copy_out()
        self._offer()

    def _copy_out(self) -> None:
        """Copy the pending evicted blocks out of the pool (one gather on every rank), to offer later."""
        if not self._pending:
            return
        self.cache.settle_loads()  # an evicted block loaded in this schedule: its copies done first
        pending, self._pending = self._pending, []
        ids = [b for b, _, _, _ in pending]
        if self.peers is None:
            data = gather_blocks(self.cache, ids)
        else:
            try:
                data = self._gather_shards(ids)
            except RuntimeError as e:  # a worker failed or is gone (then the next step fails, too)
                self.dropped_blocks += len(pending)
                log.warning("KV offload: %d evicted blocks not offered: %s", len(pending), e)
                return
        quiet = {h for _, h, _, publish in pending if not publish}
        self._copied.append(
            ([h for _, h, _, _ in pending], [t for _, _, t, _ in pending], data.reshape(-1), quiet)
        )

    def _gather_shards(self, block_ids: list[int]) -> torch.Tensor:
        """Every head of the blocks, block-major (module doc): the workers copy theirs while rank 0
        copies its own, each into its place on the head axis."""
        assert self.peers is not None
        workers = [r for r in self._sources if r > 0]
        self.peers.tier_out(workers, block_ids)
        own = gather_blocks(self.cache, block_ids, contiguous=False)
        n, _, layers, bs, _, row = own.shape
        whole = torch.empty((n, 2, layers, bs, self.num_kv_heads, row), dtype=torch.uint8)
        heads = self.head_ranges[0]
        whole[..., heads.start : heads.stop, :].copy_(own)
        for r, flat in zip(workers, self.peers.tier_out_wait(), strict=True):
            heads = self.head_ranges[r]
            whole[..., heads.start : heads.stop, :].copy_(flat.view(n, 2, layers, bs, len(heads), row))
        return whole

    def _offer(self) -> None:
        copied, self._copied = self._copied, []
        for hashes, tokens, data, quiet in copied:
            self.store.offer(hashes, tokens, memoryview(data.numpy().data), quiet)
            self.offered_blocks += len(hashes)

    def stats(self) -> StoreStats:
        return dataclasses.replace(self.store.stats(), unoffered_blocks=self.dropped_blocks)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self.loads is not None:
                self.loads.close()
                self.cache.loads = None
            self.store.close()
