"""KV offload tiers behind a service's KV pool: host RAM and disk. Bytes only: no torch, no engine.

What goes in. The engine hands over KV blocks the prefix cache evicts from its pool (complete, hashed
blocks only: `common/kv/offload.py`), a step's worth at a time, as one *chunk*: whole blocks, each
`block_bytes` long, with their prefix-cache hashes and tokens. `offer` only queues the chunk (a bounded
queue; a chunk that finds it full is dropped and counted): a background thread writes it, so no engine
step waits on a tier write.

Where it goes. Every tier is an LRU of chunks under a hard byte limit; a chunk that would pass the
limit first evicts the least recently used ones, and one larger than the whole tier is not stored.
- RAM: every offered block not held yet.
- disk: only blocks whose hash was offered at least twice (the reuse filter: a block evicted from the
  pool twice was computed twice, so it is reused; a one-off prompt never reaches the disk). The tier
  holds one folder of its own under `disk_dir` (`slot-N`, held with an exclusive `flock` while the
  store lives, emptied when taken): several services may share `disk_dir`, and a restart leaves no
  stale files behind. A write that fails (disk full, EFBIG, any OSError) stores nothing: the blocks
  are then a miss, never an error.
Both tiers are written to (write-through): a block evicted from RAM may still be on disk.

RAM memory. The RAM tier's blocks live in a `HostArena`: fixed slots of one block's payload each,
allocated in segments (a power of two bytes, at most 256 MiB) as they are first needed, never more
than the tier's size in all, so its limit is a limit on memory, not on a count. A chunk's record is
its head (kept as a small bytes object: ~8 bytes per token) and its blocks' slots. For a GPU pool
the segments are pinned host memory (common/kv/offload.py passes the allocator): a read hands back
views of the slots themselves, from which the copies to the device run asynchronously with no
staging copy; on a CPU pool they are anonymous memory maps — the same code. A slot goes back to the
free list only when its chunk has left the index *and* nothing refers to its bytes any more: a read
hands out views of numpy arrays whose finalizers report them gone, and a tensor made from a view
(an asynchronous copy's source) keeps them alive, so the LRU can never hand a slot to a new write
while a copy still reads it. A write that finds the room but not the free slots (readers still hold
them) stores nothing (`write_failures["busy"]`).

What comes out. `read(hashes, tokens)` returns the verified bytes of the longest run of leading
blocks some tier holds, RAM first. Every chunk is stored as one record, the same bytes in RAM and on
disk: a header (magic, format version, the model/KV-layout digest, block count, block size, payload
length, checksum), the block hashes, the tokens of each block, then the payload. A read verifies all
of it: the length (a truncated file), the checksum of every byte, the digest (another model, KV dtype,
block size, fp8 scales or KV head count wrote it), and that the block at that place has the
hash and tokens asked for. A read that fails or does not verify is a miss: counted
(`TierStats.verify_failures`, by cause), logged once per tier and cause, the chunk dropped from the
index (and its file deleted) — never data.

The checksum is zlib.crc32 over the whole record (header with its checksum field zeroed, hashes,
tokens, payload). What it guards against is accidental damage: a torn or truncated write, a flipped
bit, a file another process rewrote or emptied; crc32 catches every burst of up to 32 bits and any
other corruption but one in 2^32, and runs at ~3.6 GB/s here (blake2b: ~0.8 GB/s), which matters
because reads run on the engine thread in this version. A cryptographic hash would buy nothing more
without a secret key: whoever can write the slot folder (0700, this process's user) could recompute
any unkeyed digest.

KV events. Once `enable_events` is called, every block hash a tier comes to hold (a chunk stored, so
a read can return it) or lets go of (the LRU, a record that did not verify) is recorded as
(held, hash, tier name), under the store's lock; `drain_events` hands them to the service's KV event
publisher (common/cluster/kv_events.py), `held` lists every (hash, tier) for a snapshot. A write that
was dropped (queue full), filtered or failed stores nothing, so it is never published. Keys offered
`quiet` (a layer group's pages after the first: keys no prompt's hash is, so no router could match
them) are held and read like any, with no event and out of `held`; a chunk promoted from the disk
keeps them quiet.

Reads run on the caller's thread (the engine's, at admission): the record read (from RAM: views of
its slots) and verified in host memory; putting the verified bytes into the pool is the pool's side
(common/kv/offload.py: on a GPU layer by layer while the step computes, common/kv/layer_loads.py).
The index is guarded by one lock, held for index changes only, never across I/O.

Prefetch on arrival. When a request reaches the engine (`add_request`), `prefetch(*runs)` is handed the
keys its admission's reads will ask for: the prompt's leading block hashes past the pool's prefix (with
layer groups, one run of keys per group: common/kv/layer_groups.py); the leading run of each the tiers
hold (what a read would return), less what RAM holds already, is one *prefetch*: a worker thread of its
own (never the engine's) reads the disk chunks holding those blocks, verifies them as a read does (a
failure is counted in `verify_failures` and the chunk forgotten: a miss, exactly as a read's) and
inserts the blocks asked for into RAM (a chunk's others stay on the disk only), where the admission's
read then finds them. The insert is one index change under the lock, of a record complete in its slots, so
a reader sees the whole chunk or none of it, and the block's (held, hash, "ram") event is recorded only
then. A promotion evicts RAM's LRU chunks as any RAM write does, except those an admission's read is
reading now (pinned for the read's length); it is given up when only pinned chunks could make room.
Bounded: at most `prefetch_jobs` prefetches queued or running; an arrival past that is dropped
(counted). A block already covered by a pending prefetch is not asked for twice. `prefetching(keys)`
says whether one still brings any of them: the scheduler leaves such a request waiting while other
sequences run (common/engine/scheduler.py), so its admission reads RAM; the engine's thread never
blocks on a prefetch. One that has not finished when the read comes (nothing else ran, or its wait ran
out) is *late* — the read goes to the disk as before, and a late prefetch reads no further chunk (the
chunk it is reading is still promoted; one that has not started is skipped). `PrefetchStats`:
started, dropped, completed, in time (an admission read a block it promoted from RAM), late, and the
blocks promoted. Prefetch reads stay out of `read_latency` (the router's read cost per block
returned).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import fcntl
import heapq
import logging
import mmap
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.prefix_hash import DISK, RAM, KVEvent

log = logging.getLogger("splitserve.kv_tiers")

MAGIC, VERSION = b"SSKV", 1
# magic, version, flags, layout digest (16 bytes), blocks, block size (tokens), payload bytes, crc32
_HEADER = struct.Struct("<4sHH16sIIQI")
_CRC_AT = _HEADER.size - 4
_ALIGN = 64  # the payload starts at a multiple of this: views of it as any KV dtype are aligned
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
REUSE_WINDOW = 1 << 16  # block hashes the reuse filter remembers (LRU): bounded memory
MAX_SLOTS = 64  # services sharing one disk_dir
VERIFY_CAUSES = ("missing", "io", "truncated", "checksum", "layout", "block")
PREFETCH_JOBS = 4  # prefetches queued or running at once (module doc); an arrival past them is dropped


class VerifyError(Exception):
    """A record that does not verify; `cause` is one of VERIFY_CAUSES."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode_head(
    digest: bytes,
    block_size: int,
    hashes: Sequence[int],
    tokens: Sequence[Sequence[int]],
    payload: Sequence[memoryview],
) -> bytes:
    """A record's head (see the module doc: header, hashes, tokens, padding) for the payload whose bytes
    are the `payload` parts in order, its checksum taken over the head and those parts."""
    n = len(hashes)
    assert len(tokens) == n and all(len(t) == block_size for t in tokens), "whole blocks only"
    meta = array("q", hashes).tobytes() + array("q", [t for blk in tokens for t in blk]).tobytes()
    head = bytearray(_pad(_HEADER.size + len(meta)))
    nbytes = sum(p.nbytes for p in payload)
    _HEADER.pack_into(head, 0, MAGIC, VERSION, 0, digest, n, block_size, nbytes, 0)
    head[_HEADER.size : _HEADER.size + len(meta)] = meta
    crc = zlib.crc32(head)
    for part in payload:
        crc = zlib.crc32(part, crc)
    struct.pack_into("<I", head, _CRC_AT, crc)
    return bytes(head)


def encode(
    digest: bytes,
    block_size: int,
    hashes: Sequence[int],
    tokens: Sequence[Sequence[int]],
    payload: memoryview,
) -> bytearray:
    """One chunk's record in one buffer (the disk's): its head (`encode_head`), then the payload."""
    return bytearray(encode_head(digest, block_size, hashes, tokens, [payload])) + payload


@dataclass(frozen=True)
class Decoded:
    hashes: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    blocks: Sequence[memoryview]  # block i's payload bytes (block_bytes), views of the record's memory


def decode(rec: bytearray, digest: bytes, block_size: int, block_bytes: int) -> Decoded:
    """The record's contents, verified (module doc); VerifyError naming the cause otherwise."""
    if len(rec) < _HEADER.size:
        raise VerifyError("truncated", f"{len(rec)} bytes, shorter than a header")
    mv = memoryview(rec)
    head = _head_len(mv)
    payload = mv[head:]
    hashes, toks = _verify(mv[:head], [payload], len(rec), digest, block_size, block_bytes)
    blocks = [payload[i * block_bytes : (i + 1) * block_bytes] for i in range(len(hashes))]
    return Decoded(hashes, toks, blocks)


def decode_parts(
    head: bytes, blocks: Sequence[memoryview], digest: bytes, block_size: int, block_bytes: int
) -> Decoded:
    """A record kept as its head and one buffer per block (the RAM tier's), verified as `decode` does."""
    if len(head) < _HEADER.size:
        raise VerifyError("truncated", f"a head of {len(head)} bytes, shorter than a header")
    if _head_len(memoryview(head)) != len(head):
        raise VerifyError("truncated", f"a head of {len(head)} bytes, the header says otherwise")
    total = len(head) + sum(b.nbytes for b in blocks)
    hashes, toks = _verify(memoryview(head), blocks, total, digest, block_size, block_bytes)
    if len(blocks) != len(hashes):
        raise VerifyError("truncated", f"{len(blocks)} block buffers for {len(hashes)} blocks")
    return Decoded(hashes, toks, blocks)


def _head_len(mv: memoryview) -> int:
    n, bs = _HEADER.unpack_from(mv, 0)[4:6]
    return _pad(_HEADER.size + 8 * n + 8 * n * bs)


def _verify(
    head: memoryview,
    payload: Sequence[memoryview],
    total: int,
    digest: bytes,
    block_size: int,
    block_bytes: int,
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Check a record (its head, its payload in parts; `total`: the record's length) and return its
    block hashes and tokens; VerifyError naming the cause otherwise."""
    magic, version, _, got_digest, n, bs, payload_len, crc = _HEADER.unpack_from(head, 0)
    if magic != MAGIC:
        raise VerifyError("checksum", f"bad magic {magic!r}")
    if total != len(head) + payload_len:
        raise VerifyError("truncated", f"{total} bytes, the header says {len(head) + payload_len}")
    # the checksum field counted as 0
    actual = zlib.crc32(head[_CRC_AT + 4 :], zlib.crc32(b"\0\0\0\0", zlib.crc32(head[:_CRC_AT])))
    for part in payload:
        actual = zlib.crc32(part, actual)
    if actual != crc:
        raise VerifyError("checksum", f"crc32 {actual:08x}, stored {crc:08x}")
    if version != VERSION or got_digest != digest or bs != block_size or payload_len != n * block_bytes:
        raise VerifyError(
            "layout", f"version {version}, digest {got_digest.hex()}, block size {bs}, payload {payload_len}"
        )
    words = array("q")
    words.frombytes(head[_HEADER.size : _HEADER.size + 8 * n + 8 * n * bs])
    hashes = tuple(words[:n])
    toks = tuple(tuple(words[n + i * bs : n + (i + 1) * bs]) for i in range(n))
    return hashes, toks


class HostArena:
    """The RAM tier's memory (module doc, "RAM memory"): `slots` fixed slots of one block's payload
    each (`stride`: block_bytes rounded up to _ALIGN), in segments of a power of two bytes (at most
    SEGMENT) allocated when a slot in them is first taken, never more than `capacity` bytes in all.
    `allocate(nbytes)`: a writable buffer; by default an anonymous mmap (its pages are touched only
    when written), for a GPU pool pinned host memory (common/kv/offload.py). The store's lock guards
    the free list (`alloc`, `free`); a segment is allocated by the first `raw` of one of its slots,
    under a lock of the arena's own, so the writer thread does it outside the store's lock (pinning
    256 MiB takes a while: no reader waits for it)."""

    SEGMENT = 1 << 28

    def __init__(self, block_bytes: int, capacity: int, allocate: Callable[[int], Any] | None = None) -> None:
        self.stride = _pad(block_bytes)
        self.block_bytes = block_bytes
        self._allocate = allocate or (lambda n: mmap.mmap(-1, n))
        self._first: list[int] = []  # per segment: its first slot
        self._size: list[int] = []  # per segment: its bytes
        left, slots = capacity, 0
        while left >= self.stride:
            size = min(self.SEGMENT, 1 << (left.bit_length() - 1))  # a power of two: the pinned
            if size < self.stride:  # allocator rounds every allocation up to one
                break
            self._first.append(slots)
            self._size.append(size)
            slots += size // self.stride
            left -= size
        self.slots = slots
        self._seg: list[Any] = [None] * len(self._first)
        self._raw: list[memoryview | None] = [None] * len(self._first)
        self._free = list(range(slots))  # a heap: the lowest free slot first, so a chunk's slots
        # tend to be adjacent (one copy a run) and the touched memory stays compact
        self.allocated_bytes = 0  # segments allocated so far
        self._grow = threading.Lock()  # allocating a segment (`_segment`)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n free slots, lowest first; None when fewer are free."""
        if n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, slots: Sequence[int]) -> None:
        for s in slots:
            heapq.heappush(self._free, s)

    def raw(self, slot: int) -> memoryview:
        """Slot `slot`'s bytes (block_bytes), for the store's own writes and checks."""
        seg = self._segment(slot)
        raw = self._raw[seg]
        assert raw is not None
        at = (slot - self._first[seg]) * self.stride
        return raw[at : at + self.block_bytes]

    def export(self, slots: Sequence[int], gone: Callable[[], None]) -> tuple[list[memoryview], int]:
        """Views of the slots' bytes (one a slot, in order) for readers, and how many arrays hold them:
        one numpy array per run of adjacent slots, whose finalizer calls `gone` once nothing refers to
        it any more (no view of it, no tensor made from one: a copy reading from them keeps them
        alive)."""
        out: list[memoryview] = []
        arrays = 0
        i = 0
        while i < len(slots):
            seg = self._segment(slots[i])
            j = i + 1
            while j < len(slots) and slots[j] == slots[j - 1] + 1 and self._segment(slots[j]) == seg:
                j += 1
            at = (slots[i] - self._first[seg]) * self.stride
            arr = np.frombuffer(self._seg[seg], dtype=np.uint8, count=(j - i) * self.stride, offset=at)
            weakref.finalize(arr, gone).atexit = False
            arrays += 1
            mv = arr.data  # a memoryview whose object is arr: each slice keeps it alive
            out.extend(mv[k * self.stride : k * self.stride + self.block_bytes] for k in range(j - i))
            i = j
        return out, arrays

    def _segment(self, slot: int) -> int:
        seg = bisect.bisect_right(self._first, slot) - 1
        if self._raw[seg] is None:
            with self._grow:
                if self._raw[seg] is None:  # (another thread may have allocated it meanwhile)
                    mem = self._allocate(self._size[seg])
                    self._seg[seg] = mem
                    self.allocated_bytes += self._size[seg]
                    self._raw[seg] = memoryview(mem).cast("B")  # last: published whole
        return seg


class Latency:
    """A histogram of seconds with fixed buckets (LATENCY_BUCKETS), for the service's /metrics."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: over the largest bucket
        self.sum = 0.0

    def observe(self, s: float) -> None:
        i = next((i for i, b in enumerate(LATENCY_BUCKETS) if s <= b), len(LATENCY_BUCKETS))
        self.counts[i] += 1
        self.sum += s

    def copy(self) -> Latency:
        c = Latency()
        c.counts, c.sum = list(self.counts), self.sum
        return c


@dataclass
class TierStats:
    """One tier's figures (a copy: `TierStore.stats`)."""

    tier: str
    capacity_bytes: int
    bytes: int = 0
    blocks: int = 0
    hits: int = 0  # blocks read back and verified
    misses: int = 0  # blocks looked up here and not returned (not held, or held and failed to verify)
    writes: int = 0  # blocks stored
    write_failures: Counter[str] = field(default_factory=Counter)  # by cause: full, too_large, io, busy
    verify_failures: Counter[str] = field(default_factory=Counter)  # by cause: VERIFY_CAUSES
    evicted: int = 0  # blocks the LRU let go of
    read_latency: Latency = field(default_factory=Latency)  # one chunk read and verified
    write_latency: Latency = field(default_factory=Latency)  # one chunk encoded and stored

    def copy(self) -> TierStats:
        return TierStats(
            self.tier, self.capacity_bytes, self.bytes, self.blocks, self.hits, self.misses, self.writes,
            Counter(self.write_failures), Counter(self.verify_failures), self.evicted,
            self.read_latency.copy(), self.write_latency.copy(),
        )  # fmt: skip


@dataclass
class PrefetchStats:
    """Prefetches on arrival (module doc), each one arrival's disk-only leading blocks."""

    started: int = 0  # queued for the prefetch worker
    dropped: int = 0  # not started: `prefetch_jobs` were queued or running already
    completed: int = 0  # ran to the end: its chunks read, and promoted unless they did not verify (a late
    # one stops before its next chunk read, and one still queued is skipped: not completed)
    in_time: int = 0  # an admission then read a block it promoted from RAM
    late: int = 0  # an admission read its blocks before it had promoted them (from the disk, as before)
    blocks: int = 0  # blocks promoted from the disk into RAM
    no_room: int = 0  # chunks not promoted: only chunks an admission was reading could have made room


@dataclass
class StoreStats:
    """A copy of the store's figures (`TierStore.stats`)."""

    tiers: list[TierStats]  # RAM first
    dropped_blocks: int  # offered while the write queue was full: stored nowhere
    filtered_blocks: int  # kept off the disk by the reuse filter
    prefetch: PrefetchStats = field(default_factory=PrefetchStats)
    # evicted blocks never offered: a tensor-parallel worker rank did not hand its heads over
    # (common/kv/offload.py; the store never sees them, so KVOffload.stats fills this in)
    unoffered_blocks: int = 0
    # blocks the disk held that reads left to be recomputed: reading them cost more (`read(disk=False)`)
    disk_skipped_blocks: int = 0


@dataclass
class _Prefetch:
    """One arrival's prefetch: the disk-only leading block keys it promotes, in the order asked."""

    hashes: list[int]
    outcome: str = ""  # "in_time" or "late" once an admission's read decided it (counted once)


@dataclass
class _Chunk:
    key: int
    hashes: tuple[int, ...]
    nbytes: int
    head: bytes = b""  # RAM: the record's head (its payload: the slots); disk: all in the chunk's file
    slots: list[int] | None = None  # RAM: the arena slots of its blocks, in order
    exports: int = 0  # RAM: views of its slots handed to readers and still referred to
    forgotten: bool = False  # RAM: out of the index (its slots are freed once `exports` is 0 too)
    prefetch: _Prefetch | None = None  # RAM: the prefetch that promoted it from the disk
    quiet: frozenset[int] = frozenset()  # keys held without KV events (offer's `quiet`)


TierEvent = KVEvent  # (held, block hash, tier name): a tier's KV events are the block manager's kind


class _Tier:
    """One tier's index: chunks in LRU order (oldest first), and which chunk holds each block hash.
    Guarded by the store's lock; `events` (the store's, None while off) records what it comes to hold
    and lets go of."""

    def __init__(self, name: str, capacity: int, on_forget: Callable[[_Chunk], None] | None = None) -> None:
        self.name = name
        self.on_forget = on_forget  # called (under the lock) for each chunk it lets go of
        self.chunks: OrderedDict[int, _Chunk] = OrderedDict()
        self.where: dict[int, tuple[int, int]] = {}  # block hash -> (chunk key, index in the chunk)
        self.stats = TierStats(name, capacity)
        self.events: deque[TierEvent] | None = None

    def holds(self, h: int) -> bool:
        return h in self.where

    def room_for(self, nbytes: int, keep: Container[int] = ()) -> list[_Chunk]:
        """Evict LRU chunks, but none whose key is in `keep`, until nbytes fit (check `fits` first when
        keeping any); returns them (their files are the caller's to delete)."""
        out, st = [], self.stats
        lru = iter(list(self.chunks.values()) if keep else ())  # (a copy only when keeping any)
        while self.chunks and st.bytes + nbytes > st.capacity_bytes:
            if keep:
                c = next(c for c in lru if c.key not in keep)  # `fits` said there is one
                del self.chunks[c.key]
            else:
                _, c = self.chunks.popitem(last=False)
            self._forget(c)
            st.evicted += len(c.hashes)
            out.append(c)
        return out

    def fits(self, nbytes: int, keep: Container[int]) -> bool:
        """Whether room_for(nbytes, keep) can make room."""
        st = self.stats
        kept = sum(c.nbytes for k, c in self.chunks.items() if k in keep)
        return kept + nbytes <= st.capacity_bytes

    def add(self, c: _Chunk) -> None:
        """Index a stored chunk. A hash the tier holds already (in another chunk: a write and a
        prefetch raced) keeps its place, and no second event: each event is one index change."""
        self.chunks[c.key] = c
        for i, h in enumerate(c.hashes):
            if h in self.where:
                continue
            self.where[h] = (c.key, i)
            if self.events is not None and h not in c.quiet:
                self.events.append((True, h, self.name))
        self.stats.bytes += c.nbytes
        self.stats.blocks += len(c.hashes)
        self.stats.writes += len(c.hashes)

    def drop(self, key: int) -> _Chunk | None:
        c = self.chunks.pop(key, None)
        if c is not None:
            self._forget(c)
        return c

    def _forget(self, c: _Chunk) -> None:
        for i, h in enumerate(c.hashes):
            if self.where.get(h) == (c.key, i):
                del self.where[h]
                if self.events is not None and h not in c.quiet:
                    self.events.append((False, h, self.name))
        self.stats.bytes -= c.nbytes
        self.stats.blocks -= len(c.hashes)
        if self.on_forget is not None:
            self.on_forget(c)


class _Probe:
    """A disk probe queued for the writer thread (`TierStore.probe_disk`)."""


@dataclass
class _Offer:
    hashes: list[int]
    tokens: list[tuple[int, ...]]
    payload: memoryview
    quiet: frozenset[int] = frozenset()


class TierStore:
    """The tiers of one KV pool (module doc). `digest`: 16 bytes naming the model and KV layout (what
    a record must carry to be read back); `block_bytes`: one block's payload."""

    def __init__(
        self,
        digest: bytes,
        block_size: int,
        block_bytes: int,
        ram_bytes: int = 0,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 0,
        queue_chunks: int = 16,
        prefetch_jobs: int = PREFETCH_JOBS,
        ram_allocate: Callable[[int], Any] | None = None,
    ) -> None:
        """`ram_allocate`: how the RAM tier's memory is allocated (HostArena)."""
        assert len(digest) == 16, "the layout digest is 16 bytes"
        assert ram_bytes > 0 or disk_dir is not None, "a store needs a tier"
        self.digest, self.block_size, self.block_bytes = digest, block_size, block_bytes
        self._lock = threading.Lock()
        self.arena: HostArena | None = None
        self.ram: _Tier | None = None
        self._gone: deque[_Chunk] = deque()  # RAM chunks an exported view of has died (HostArena.export)
        if ram_bytes > 0:
            self.arena = HostArena(block_bytes, ram_bytes, ram_allocate)
            self.ram = _Tier(RAM, self.arena.slots * self.arena.stride, self._ram_forgot)
        self.disk = _Tier(DISK, disk_bytes) if disk_dir is not None else None
        self.slot: Path | None = None
        self._slot_fd: int | None = None
        if disk_dir is not None:
            self.slot, self._slot_fd = _claim_slot(Path(disk_dir))
        self._seen: OrderedDict[int, int] = OrderedDict()  # the reuse filter: hash -> times offered
        self.dropped_blocks = 0  # offered while the write queue was full
        self.filtered_blocks = 0  # kept off the disk by the reuse filter
        self._keys = 0
        self.disk_skipped_blocks = 0  # held on the disk, left to be recomputed (`read(disk=False)`)
        self._disk_recent = 0.0  # seconds a block of recent disk chunk reads (EWMA), prefetches' too
        self._disk_read_at = 0.0  # time.monotonic() of the last disk chunk read (0: none yet)
        self.disk_probes = 0  # disk chunks read by `probe_disk`
        self._events: deque[TierEvent] = deque()  # shared by the tiers once enable_events is called
        self._logged: set[tuple[str, str]] = set()
        self._queue: queue.Queue[_Offer | _Probe | None] = queue.Queue(maxsize=queue_chunks)
        self._probing = False  # a disk probe is queued (`probe_disk`)
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        # prefetch on arrival (module doc): only with both tiers (it promotes disk chunks into RAM)
        if prefetch_jobs < 0:
            raise ValueError(f"prefetch_jobs must be >= 0, got {prefetch_jobs}")
        self.prefetch_jobs = prefetch_jobs
        self._pf = PrefetchStats()
        self._pf_pending: dict[int, _Prefetch] = {}  # block hash -> the queued or running prefetch of it
        self._pf_in_flight = 0
        self._pf_idle = threading.Condition(self._lock)  # notified when a prefetch ends
        self._pf_queue: queue.SimpleQueue[_Prefetch | None] = queue.SimpleQueue()
        self._pinned: Counter[int] = Counter()  # RAM chunk keys an admission's read is reading
        self._prefetcher: threading.Thread | None = None
        if self.ram is not None and self.disk is not None and prefetch_jobs > 0:
            self._prefetcher = threading.Thread(
                target=self._prefetch_loop, name="kv-tier-prefetch", daemon=True
            )
            self._prefetcher.start()

    # --- the engine's side --------------------------------------------------------------------------
    def wants(self, h: int) -> bool:
        """Count one more sighting of block hash h (the reuse filter) and say whether an offer of it
        would store anything: a tier it would go to does not hold it yet."""
        with self._lock:
            seen = self._seen.pop(h, 0) + 1
            self._seen[h] = seen
            if len(self._seen) > REUSE_WINDOW:
                self._seen.popitem(last=False)
            ram = self.ram is not None and not self.ram.holds(h)
            disk = self.disk is not None and not self.disk.holds(h)
            if disk and seen < 2:
                self.filtered_blocks += 1
                disk = False
            return ram or disk

    def offer(
        self,
        hashes: list[int],
        tokens: list[tuple[int, ...]],
        payload: memoryview,
        quiet: Collection[int] = (),
    ) -> bool:
        """Queue whole blocks for the tiers (never waits). False, and counted, when the queue is full.
        The payload must not change afterwards. `quiet`: keys among `hashes` to hold without KV events
        (no router matches them: a layer group's pages after the first, common/kv/layer_groups.py)."""
        assert payload.nbytes == len(hashes) * self.block_bytes, "whole blocks only"
        if payload.ndim != 1 or payload.format != "B":  # bytes, so that block i is a slice of them
            payload = payload.cast("B")
        if self._closed or not hashes:
            return False
        try:
            self._queue.put_nowait(_Offer(hashes, tokens, payload, frozenset(quiet)))
            return True
        except queue.Full:
            self.dropped_blocks += len(hashes)
            self._log_once("queue", "full", "the tier write queue is full: evicted KV blocks are dropped")
            return False

    def read(
        self, hashes: Sequence[int], tokens: Sequence[Sequence[int]], disk: bool = True
    ) -> list[memoryview]:
        """The verified bytes of the longest run of leading blocks some tier holds (RAM first), one
        memoryview of `block_bytes` per block; it stops at the first block no tier returns. The RAM
        chunks holding `hashes` are pinned while it runs: a prefetch does not evict them. A view of
        RAM is of the tier's own memory, kept from reuse for as long as anything refers to it (a
        tensor made from it included): copy what is needed and let go of the views. `disk=False`: RAM
        only (the caller judged a disk read dearer than recomputing); the blocks the disk holds where
        the read stops are counted in `disk_skipped_blocks`."""
        out: list[memoryview] = []
        cache: dict[tuple[str, int], Decoded | None] = {}  # chunks read in this call
        pins = self._pin(hashes)
        try:
            for h, toks in zip(hashes, tokens, strict=True):
                if self._pf_pending:  # a prefetch of h not done: this read overtook it (module doc)
                    self._overtook(h)
                got = None
                for tier in (self.ram, self.disk) if disk else (self.ram,):
                    if tier is None:
                        continue
                    got = self._read_block(tier, h, tuple(toks), cache)
                    if got is not None:
                        break
                if got is None:
                    break
                out.append(got)
        finally:
            self._unpin(pins)
        if not disk and self.disk is not None and len(out) < len(hashes):
            with self._lock:
                for h in hashes[len(out) :]:
                    if not self.disk.holds(h):
                        break
                    self.disk_skipped_blocks += 1
        return out

    def disk_read_s_per_block(self) -> float | None:
        """The disk's recent read cost: seconds a block of its chunk reads and their verification (a
        moving average over admissions', prefetches' and probes' reads); None before the first."""
        return self._disk_recent or None

    def disk_read_age(self) -> float | None:
        """Seconds since the disk's last chunk read (None: none yet)."""
        return time.monotonic() - self._disk_read_at if self._disk_read_at else None

    def probe_disk(self) -> bool:
        """Measure the disk again without an admission paying for it: the writer thread reads and
        verifies the disk's most recently used chunk (its time goes into `disk_read_s_per_block`; a
        chunk that fails is counted and forgotten as any read's). For a caller that stopped reading
        the disk because it was slow: without a probe its figure would never change again. Never
        waits; False if a probe is queued already, the queue is full, or there is no disk."""
        if self.disk is None or self._closed or self._probing:
            return False
        self._probing = True  # before the put: the writer clears it once the probe is done
        try:
            self._queue.put_nowait(_Probe())
        except queue.Full:
            self._probing = False
            return False
        return True

    def _probe(self) -> None:
        try:
            disk = self.disk
            assert disk is not None
            with self._lock:
                chunk = next(reversed(disk.chunks.values()), None)
            if chunk is not None:
                self._read_chunk(disk, chunk, observe=False)
                self.disk_probes += 1
        finally:
            self._probing = False

    def holds(self, keys: Sequence[int]) -> list[bool]:
        """Which of `keys` some tier holds now: an index lookup, no I/O (a read may still find a record
        that does not verify: then it returns fewer)."""
        with self._lock:
            return [any(t is not None and t.holds(h) for t in (self.ram, self.disk)) for h in keys]

    def _pin(self, hashes: Sequence[int]) -> list[int]:
        if self._prefetcher is None or self.ram is None:
            return []
        with self._lock:
            keys = [at[0] for at in map(self.ram.where.get, hashes) if at is not None]
            self._pinned.update(keys)
        return keys

    def _unpin(self, keys: list[int]) -> None:
        if keys:
            with self._lock:
                self._pinned.subtract(keys)
                self._pinned += Counter()  # drops the keys at 0

    def _overtook(self, h: int) -> None:
        with self._lock:
            job = self._pf_pending.get(h)
            if job is not None and not job.outcome:
                job.outcome = "late"
                self._pf.late += 1

    def _read_block(
        self, tier: _Tier, h: int, toks: tuple[int, ...], cache: dict[tuple[str, int], Decoded | None]
    ) -> memoryview | None:
        with self._lock:
            at = tier.where.get(h)
            chunk = tier.chunks.get(at[0]) if at is not None else None
            if at is None or chunk is None:
                tier.stats.misses += 1
                return None
            tier.chunks.move_to_end(chunk.key)  # recently used
        key, index = at
        if (tier.name, key) not in cache:
            cache[(tier.name, key)] = self._read_chunk(tier, chunk)
        dec = cache[(tier.name, key)]
        cause = None
        if dec is not None and (dec.hashes[index] != h or dec.tokens[index] != toks):
            cause = "block"  # the record verifies, but holds other blocks than the index says
            self._failed(tier, chunk, VerifyError(cause, f"block {index} is not hash {h:x}"))
        with self._lock:
            if dec is None or cause is not None:
                tier.stats.misses += 1
                return None
            tier.stats.hits += 1
            job = chunk.prefetch
            if job is not None and not job.outcome:  # a prefetch brought this block here in time
                job.outcome = "in_time"
                self._pf.in_time += 1
        return dec.blocks[index]

    def _read_chunk(self, tier: _Tier, chunk: _Chunk, observe: bool = True) -> Decoded | None:
        """The chunk's record, read and verified; None, counted and the chunk forgotten, if it fails
        (module doc); None too for a RAM chunk the LRU let go of since it was looked up. `observe`: its
        time goes into the tier's read latency."""
        t0 = time.perf_counter()
        try:
            if chunk.slots is not None:  # RAM: views of its slots, which stay its own while they live
                assert self.arena is not None
                with self._lock:
                    if chunk.forgotten:
                        return None
                    views, arrays = self.arena.export(chunk.slots, lambda: self._gone.append(chunk))
                    chunk.exports += arrays
                dec = decode_parts(chunk.head, views, self.digest, self.block_size, self.block_bytes)
            else:
                assert self.slot is not None
                rec = _read_file(self.slot / _name(chunk.key))
                dec = decode(rec, self.digest, self.block_size, self.block_bytes)
        except VerifyError as e:
            self._failed(tier, chunk, e)
            return None
        except OSError as e:
            cause = "missing" if e.errno == errno.ENOENT else "io"
            self._failed(tier, chunk, VerifyError(cause, str(e)))
            return None
        spent = time.perf_counter() - t0
        with self._lock:
            if observe:
                tier.stats.read_latency.observe(spent)
            if tier is self.disk:
                self._disk_read_at = time.monotonic()
                per = spent / max(1, len(chunk.hashes))
                self._disk_recent = (
                    per if not self._disk_recent else self._disk_recent + 0.2 * (per - self._disk_recent)
                )
        return dec

    def _failed(self, tier: _Tier, chunk: _Chunk, e: VerifyError) -> None:
        """A chunk that did not read back: counted, logged once per cause, forgotten. One the LRU let go
        of while it was being read (its file deleted under the reader) is a plain miss."""
        with self._lock:
            if chunk.key not in tier.chunks:
                return
            tier.stats.verify_failures[e.cause] += 1
            gone = tier.drop(chunk.key)
        if gone is not None and gone.slots is None and self.slot is not None:
            with contextlib.suppress(OSError):
                (self.slot / _name(chunk.key)).unlink()
        self._log_once(tier.name, e.cause, f"a KV chunk did not read back ({e}): a miss, recomputed")

    # --- prefetch on arrival (module doc) -------------------------------------------------------------
    def prefetch(self, *runs: Sequence[int]) -> bool:
        """Queue the promotion into RAM of the disk-only blocks among the leading run the tiers hold of
        each of `runs` (each: keys in the order a read will ask for them, such as a prompt's block
        hashes past the pool's prefix; with layer groups one run per group), as one prefetch; never
        waits. True if a prefetch was started; False if nothing needs one (or a pending one covers
        it), the store has not both tiers, or `prefetch_jobs` are in flight (then counted as dropped)."""
        if self._prefetcher is None or self._closed:
            return False
        assert self.ram is not None and self.disk is not None
        with self._lock:
            want: dict[int, None] = {}  # in order, each once
            for hashes in runs:
                for h in hashes:
                    if self.ram.holds(h):
                        continue
                    if not self.disk.holds(h):
                        break  # a read stops here
                    if h not in self._pf_pending:
                        want[h] = None
            if not want:
                return False
            if self._pf_in_flight >= self.prefetch_jobs:
                self._pf.dropped += 1
                return False
            job = _Prefetch(list(want))
            for h in want:
                self._pf_pending[h] = job
            self._pf_in_flight += 1
            self._pf.started += 1
        self._pf_queue.put(job)
        return True

    def prefetching(self, keys: Sequence[int]) -> bool:
        """Whether a prefetch queued or running still brings any of `keys` into RAM (an index lookup)."""
        with self._lock:
            return bool(self._pf_pending) and any(k in self._pf_pending for k in keys)

    def _prefetch_loop(self) -> None:
        while True:
            job = self._pf_queue.get()
            if job is None:
                return
            try:
                self._prefetch(job)
            except Exception:  # a bug here must not stop later prefetches
                log.exception("KV tier prefetch failed")
            finally:
                with self._lock:
                    for h in job.hashes:
                        if self._pf_pending.get(h) is job:
                            del self._pf_pending[h]
                    self._pf_in_flight -= 1
                    self._pf_idle.notify_all()

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Wait until no prefetch is queued or running; False on timeout (for tests and benchmarks: the
        engine's thread never blocks on one)."""
        with self._pf_idle:
            return self._pf_idle.wait_for(lambda: self._pf_in_flight == 0, timeout)

    def _prefetch(self, job: _Prefetch) -> None:
        """Read, verify and promote into RAM the disk chunks holding job's blocks (each once)."""
        ram, disk = self.ram, self.disk
        assert ram is not None and disk is not None
        with self._lock:
            if job.outcome == "late" or self._closed:  # an admission read them already; or closing
                return
            chunks: dict[int, _Chunk] = {}
            for h in job.hashes:
                at = disk.where.get(h)
                if at is not None and not ram.holds(h) and at[0] in disk.chunks:
                    chunks.setdefault(at[0], disk.chunks[at[0]])
        for chunk in chunks.values():
            if job.outcome == "late":  # overtaken: the admission reads the rest itself
                return
            dec = self._read_chunk(disk, chunk, observe=False)  # a failure: counted, forgotten, a miss
            if dec is not None:
                self._promote(dec, job, chunk.quiet)
        with self._lock:
            self._pf.completed += 1

    def _promote(self, dec: Decoded, job: _Prefetch, quiet: frozenset[int] = frozenset()) -> None:
        """Insert a verified disk record into RAM: the blocks the job asked for that RAM does not hold
        yet (a chunk's other blocks, another prompt's or a later part of this one, would take RAM from
        what admissions read), in one index change (module doc)."""
        ram = self.ram
        assert ram is not None
        wanted = set(job.hashes)
        with self._lock:
            keep = [i for i, h in enumerate(dec.hashes) if h in wanted and not ram.holds(h)]
        if keep:
            self._put_ram(
                [dec.hashes[i] for i in keep], [dec.tokens[i] for i in keep], [dec.blocks[i] for i in keep],
                quiet, job,
            )  # fmt: skip

    def _put_ram(
        self,
        hashes: list[int],
        tokens: list[tuple[int, ...]],
        blocks: Sequence[memoryview],
        quiet: frozenset[int],
        job: _Prefetch | None = None,
    ) -> None:
        """Store blocks in RAM as one chunk: the LRU makes room (a promotion's, for `job`, evicts no
        chunk an admission's read is reading, and is given up if only those could make room), free
        slots are taken, the blocks copied into them and the chunk indexed once its head is made.
        Slots a reader still refers to stay taken (HostArena.export): with too few free, a write is
        not stored (`write_failures["busy"]`), a promotion counted in `no_room`."""
        ram, arena = self.ram, self.arena
        assert ram is not None and arena is not None
        t0 = time.perf_counter()
        n = len(hashes)
        nbytes = n * arena.stride
        with self._lock:
            self._reap()
            if job is not None:
                if all(ram.holds(h) for h in hashes):  # a write raced it in meanwhile
                    return
                if not ram.fits(nbytes, self._pinned):
                    self._pf.no_room += 1
                    return
                ram.room_for(nbytes, self._pinned)
            elif nbytes > ram.stats.capacity_bytes:
                ram.stats.write_failures["too_large"] += n
                self._log_once(RAM, "too_large", f"a KV chunk of {n} blocks is larger than the tier")
                return
            else:
                ram.room_for(nbytes)
            slots = arena.alloc(n)
            if slots is None:  # the room is there, but readers still hold the slots that make it
                if job is not None:
                    self._pf.no_room += 1
                else:
                    ram.stats.write_failures["busy"] += n
                return
            self._keys += 1
            key = self._keys
        for slot, block in zip(slots, blocks, strict=True):  # slots taken, not indexed: no reader sees them
            arena.raw(slot)[:] = block
        head = encode_head(self.digest, self.block_size, hashes, tokens, [arena.raw(s) for s in slots])
        with self._lock:
            ram.add(_Chunk(key, tuple(hashes), nbytes, head, slots, prefetch=job, quiet=quiet))
            if job is None:
                ram.stats.write_latency.observe(time.perf_counter() - t0)
                return
            self._pf.blocks += n
            for h in hashes:  # promoted: an admission from now on finds it in RAM, in time
                if self._pf_pending.get(h) is job:
                    del self._pf_pending[h]

    def _ram_forgot(self, c: _Chunk) -> None:
        """The RAM tier let go of c (under the lock): its slots are free once no reader refers to them."""
        c.forgotten = True
        if c.exports == 0 and c.slots is not None:
            assert self.arena is not None
            self.arena.free(c.slots)

    def _reap(self) -> None:
        """Count the exported views that died (under the lock); free the slots of forgotten chunks
        nothing refers to any more."""
        while self._gone:
            c = self._gone.popleft()
            c.exports -= 1
            if c.exports == 0 and c.forgotten and c.slots is not None:
                assert self.arena is not None
                self.arena.free(c.slots)

    # --- KV events -------------------------------------------------------------------------------
    def enable_events(self) -> None:
        """Record what the tiers come to hold and let go of from now on (module doc); drain regularly."""
        with self._lock:
            for tier in (self.ram, self.disk):
                if tier is not None and tier.events is None:
                    tier.events = self._events

    def drain_events(self) -> list[TierEvent]:
        """The events recorded since the last drain, oldest first (any thread, one drainer at a time)."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out

    def held(self) -> list[tuple[int, str]]:
        """Every (block hash, tier name) the tiers hold now, RAM's first: what a read can return (quiet
        keys left out, as from the events)."""
        with self._lock:
            return [
                (h, t.name)
                for t in (self.ram, self.disk)
                if t is not None
                for h, (key, _) in t.where.items()
                if h not in t.chunks[key].quiet
            ]

    def read_s_per_block(self) -> dict[str, float]:
        """Each tier's measured read cost: seconds of chunk reads (and their verification) per block
        returned, since the start; a tier that has returned nothing yet is left out."""
        with self._lock:
            return {
                t.name: t.stats.read_latency.sum / t.stats.hits
                for t in (self.ram, self.disk)
                if t is not None and t.stats.hits
            }

    # --- the writer thread --------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            offer = self._queue.get()
            try:
                if offer is None:
                    return
                if isinstance(offer, _Probe):
                    self._probe()
                else:
                    self._store(offer)
            except Exception:  # a bug here must not stop later writes: each offer is on its own
                log.exception("KV tier write failed")
            finally:
                self._queue.task_done()
            if self._closed and self._queue.empty():  # closed while the queue was too full for the None
                return

    def _store(self, offer: _Offer) -> None:
        with self._lock:
            ram = [i for i, h in enumerate(offer.hashes) if self.ram is not None and not self.ram.holds(h)]
            disk: list[int] = []
            if self.disk is not None:  # the reuse filter counted what it kept off in `wants`
                disk = [
                    i
                    for i, h in enumerate(offer.hashes)
                    if not self.disk.holds(h) and self._seen.get(h, 0) >= 2
                ]
        bb = self.block_bytes
        if self.ram is not None and ram:
            self._put_ram(
                [offer.hashes[i] for i in ram], [offer.tokens[i] for i in ram],
                [offer.payload[i * bb : (i + 1) * bb] for i in ram], offer.quiet,
            )  # fmt: skip
        if self.disk is not None and disk:
            self._write(self.disk, offer, disk)

    def _write(self, tier: _Tier, offer: _Offer, picked: list[int]) -> None:
        """Store the picked blocks of an offer on the disk as one chunk (one record, one file)."""
        t0 = time.perf_counter()
        bb = self.block_bytes
        if len(picked) == len(offer.hashes):
            payload = offer.payload
        else:
            payload = memoryview(b"".join(offer.payload[i * bb : (i + 1) * bb] for i in picked))
        hashes = [offer.hashes[i] for i in picked]
        rec = encode(self.digest, self.block_size, hashes, [offer.tokens[i] for i in picked], payload)
        with self._lock:
            if len(rec) > tier.stats.capacity_bytes:
                tier.stats.write_failures["too_large"] += len(hashes)
                too_large = True
            else:
                too_large = False
                self._keys += 1
                chunk = _Chunk(self._keys, tuple(hashes), len(rec), quiet=offer.quiet)
                evicted = tier.room_for(len(rec))
        if too_large:
            self._log_once(tier.name, "too_large", f"a KV chunk of {len(rec)} bytes is larger than the tier")
            return
        assert self.slot is not None
        for c in evicted:
            with contextlib.suppress(OSError):
                (self.slot / _name(c.key)).unlink()
        try:
            self._write_file(self.slot / _name(chunk.key), rec)
        except OSError as e:
            cause = "full" if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else "io"
            with self._lock:
                tier.stats.write_failures[cause] += len(hashes)
            self._log_once("disk", f"write_{cause}", f"a KV chunk could not be written ({e}): not stored")
            return
        with self._lock:
            tier.add(chunk)
            tier.stats.write_latency.observe(time.perf_counter() - t0)

    def _write_file(self, path: Path, rec: bytearray) -> None:
        """Write a record: to a temporary name, then renamed, so a reader never sees half of one."""
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(rec)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    # --- lifetime, figures ----------------------------------------------------------------------------
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every offer queued so far is written (or failed); False on timeout."""
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer (what is queued is written first, for up to `timeout` seconds: a hung disk
        does not hold up a shutdown; the writer is a daemon thread) and the prefetch worker (queued
        prefetches are skipped), and let go of the disk slot, unless the writer is still busy (call
        again to finish). The slot's files stay until the next store takes it."""
        deadline = time.monotonic() + timeout
        if not self._closed:
            self._closed = True  # queued prefetches are skipped from now on
            self._pf_queue.put(None)
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout)
        self._writer.join(timeout)
        if self._prefetcher is not None:  # a daemon too: one inside a hung read is left behind
            self._prefetcher.join(max(0.0, deadline - time.monotonic()))
        if self._writer.is_alive():  # the slot stays locked: no other store may empty it under a write
            log.warning("KV tier writer still busy after %.0f s: left behind", timeout)
            return
        if self._slot_fd is not None:
            os.close(self._slot_fd)  # releases the flock
            self._slot_fd = None

    def stats(self) -> StoreStats:
        """A copy of the figures, each tier's RAM first (safe from any thread)."""
        with self._lock:
            tiers = [t.stats.copy() for t in (self.ram, self.disk) if t is not None]
            return StoreStats(
                tiers, self.dropped_blocks, self.filtered_blocks, dataclasses.replace(self._pf),
                disk_skipped_blocks=self.disk_skipped_blocks,
            )  # fmt: skip

    def _log_once(self, tier: str, cause: str, msg: str) -> None:
        if (tier, cause) not in self._logged:
            self._logged.add((tier, cause))
            log.warning("KV %s tier: %s (logged once)", tier, msg)


def _name(key: int) -> str:
    return f"{key:016x}.kv"


def _read_file(path: Path) -> bytearray:
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        rec = bytearray(size)
        got = f.readinto(rec)
    return rec if got == size else rec[:got]


def _claim_slot(root: Path) -> tuple[Path, int]:
    """The first slot-N folder under root no other live store holds (an exclusive flock on its lock
    file, released when the process dies), emptied of an earlier owner's records."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for i in range(MAX_SLOTS):
        slot = root / f"slot-{i}"
        slot.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(slot / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        for p in slot.iterdir():
            if p.suffix in (".kv", ".tmp"):
                with contextlib.suppress(OSError):
                    p.unlink()
        return slot, fd
    raise ValueError(f"{root}: all {MAX_SLOTS} KV tier slots are held by other processes")
