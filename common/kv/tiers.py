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

What comes out. `read(hashes, tokens)` returns the verified bytes of the longest run of leading
blocks some tier holds, RAM first. Every chunk is stored as one record, the same bytes in RAM and on
disk: a header (magic, format version, the model/KV-layout digest, block count, block size, payload
length, checksum), the block hashes, the tokens of each block, then the payload. A read verifies all
of it: the length (a truncated file), the checksum of every byte, the digest (another model, KV dtype,
block size, fp8 scales or tensor-parallel shard wrote it), and that the block at that place has the
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
was dropped (queue full), filtered or failed stores nothing, so it is never published.

Reads run on the caller's thread (the engine's, at admission; TODO(issue 32): reads overlapped with
compute, prefetch when the router places a request). The index is guarded by one lock, held for index
changes only, never across I/O.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import struct
import threading
import time
import zlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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


class VerifyError(Exception):
    """A record that does not verify; `cause` is one of VERIFY_CAUSES."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode(
    digest: bytes,
    block_size: int,
    hashes: Sequence[int],
    tokens: Sequence[Sequence[int]],
    payload: memoryview,
) -> bytearray:
    """One chunk's record (see the module doc): header, hashes, tokens, padding, payload."""
    n = len(hashes)
    assert len(tokens) == n and all(len(t) == block_size for t in tokens), "whole blocks only"
    meta = array("q", hashes).tobytes() + array("q", [t for blk in tokens for t in blk]).tobytes()
    head = _pad(_HEADER.size + len(meta))
    rec = bytearray(head + payload.nbytes)
    _HEADER.pack_into(rec, 0, MAGIC, VERSION, 0, digest, n, block_size, payload.nbytes, 0)
    rec[_HEADER.size : _HEADER.size + len(meta)] = meta
    rec[head:] = payload
    struct.pack_into("<I", rec, _CRC_AT, zlib.crc32(rec))
    return rec


@dataclass(frozen=True)
class Decoded:
    hashes: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    payload: memoryview  # the record's payload: block i is payload[i * block_bytes : (i + 1) * block_bytes]


def decode(rec: bytearray, digest: bytes, block_size: int, block_bytes: int) -> Decoded:
    """The record's contents, verified (module doc); VerifyError naming the cause otherwise."""
    if len(rec) < _HEADER.size:
        raise VerifyError("truncated", f"{len(rec)} bytes, shorter than a header")
    magic, version, _, got_digest, n, bs, payload_len, crc = _HEADER.unpack_from(rec, 0)
    if magic != MAGIC:
        raise VerifyError("checksum", f"bad magic {magic!r}")
    meta_len = 8 * n + 8 * n * bs
    head = _pad(_HEADER.size + meta_len)
    if len(rec) != head + payload_len:
        raise VerifyError("truncated", f"{len(rec)} bytes, the header says {head + payload_len}")
    mv = memoryview(rec)
    actual = zlib.crc32(mv[_CRC_AT + 4 :], zlib.crc32(b"\0\0\0\0", zlib.crc32(mv[:_CRC_AT])))  # field as 0
    if actual != crc:
        raise VerifyError("checksum", f"crc32 {actual:08x}, stored {crc:08x}")
    if version != VERSION or got_digest != digest or bs != block_size or payload_len != n * block_bytes:
        raise VerifyError(
            "layout", f"version {version}, digest {got_digest.hex()}, block size {bs}, payload {payload_len}"
        )
    words = array("q")
    words.frombytes(mv[_HEADER.size : _HEADER.size + meta_len])
    hashes = tuple(words[:n])
    toks = tuple(tuple(words[n + i * bs : n + (i + 1) * bs]) for i in range(n))
    return Decoded(hashes, toks, mv[head:])


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
    write_failures: Counter[str] = field(default_factory=Counter)  # by cause: full, too_large, io
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
class StoreStats:
    """A copy of the store's figures (`TierStore.stats`)."""

    tiers: list[TierStats]  # RAM first
    dropped_blocks: int  # offered while the write queue was full: stored nowhere
    filtered_blocks: int  # kept off the disk by the reuse filter


@dataclass
class _Chunk:
    key: int
    hashes: tuple[int, ...]
    nbytes: int
    record: bytearray | None = None  # RAM: the record itself; disk: in the chunk's file


TierEvent = KVEvent  # (held, block hash, tier name): a tier's KV events are the block manager's kind


class _Tier:
    """One tier's index: chunks in LRU order (oldest first), and which chunk holds each block hash.
    Guarded by the store's lock; `events` (the store's, None while off) records what it comes to hold
    and lets go of."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.chunks: OrderedDict[int, _Chunk] = OrderedDict()
        self.where: dict[int, tuple[int, int]] = {}  # block hash -> (chunk key, index in the chunk)
        self.stats = TierStats(name, capacity)
        self.events: deque[TierEvent] | None = None

    def holds(self, h: int) -> bool:
        return h in self.where

    def room_for(self, nbytes: int) -> list[_Chunk]:
        """Evict LRU chunks until nbytes fit; returns them (their files are the caller's to delete)."""
        out, st = [], self.stats
        while self.chunks and st.bytes + nbytes > st.capacity_bytes:
            _, c = self.chunks.popitem(last=False)
            self._forget(c)
            st.evicted += len(c.hashes)
            out.append(c)
        return out

    def add(self, c: _Chunk) -> None:
        self.chunks[c.key] = c
        for i, h in enumerate(c.hashes):
            self.where[h] = (c.key, i)
            if self.events is not None:
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
                if self.events is not None:
                    self.events.append((False, h, self.name))
        self.stats.bytes -= c.nbytes
        self.stats.blocks -= len(c.hashes)


@dataclass
class _Offer:
    hashes: list[int]
    tokens: list[tuple[int, ...]]
    payload: memoryview


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
    ) -> None:
        assert len(digest) == 16, "the layout digest is 16 bytes"
        assert ram_bytes > 0 or disk_dir is not None, "a store needs a tier"
        self.digest, self.block_size, self.block_bytes = digest, block_size, block_bytes
        self._lock = threading.Lock()
        self.ram = _Tier(RAM, ram_bytes) if ram_bytes > 0 else None
        self.disk = _Tier(DISK, disk_bytes) if disk_dir is not None else None
        self.slot: Path | None = None
        self._slot_fd: int | None = None
        if disk_dir is not None:
            self.slot, self._slot_fd = _claim_slot(Path(disk_dir))
        self._seen: OrderedDict[int, int] = OrderedDict()  # the reuse filter: hash -> times offered
        self.dropped_blocks = 0  # offered while the write queue was full
        self.filtered_blocks = 0  # kept off the disk by the reuse filter
        self._keys = 0
        self._events: deque[TierEvent] = deque()  # shared by the tiers once enable_events is called
        self._logged: set[tuple[str, str]] = set()
        self._queue: queue.Queue[_Offer | None] = queue.Queue(maxsize=queue_chunks)
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

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

    def offer(self, hashes: list[int], tokens: list[tuple[int, ...]], payload: memoryview) -> bool:
        """Queue whole blocks for the tiers (never waits). False, and counted, when the queue is full.
        The payload must not change afterwards."""
        assert payload.nbytes == len(hashes) * self.block_bytes, "whole blocks only"
        if self._closed or not hashes:
            return False
        try:
            self._queue.put_nowait(_Offer(hashes, tokens, payload))
            return True
        except queue.Full:
            self.dropped_blocks += len(hashes)
            self._log_once("queue", "full", "the tier write queue is full: evicted KV blocks are dropped")
            return False

    def read(self, hashes: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[memoryview]:
        """The verified bytes of the longest run of leading blocks some tier holds (RAM first), one
        memoryview of `block_bytes` per block; it stops at the first block no tier returns."""
        out: list[memoryview] = []
        cache: dict[tuple[str, int], Decoded | None] = {}  # chunks read in this call
        for h, toks in zip(hashes, tokens, strict=True):
            got = None
            for tier in (self.ram, self.disk):
                if tier is None:
                    continue
                got = self._read_block(tier, h, tuple(toks), cache)
                if got is not None:
                    break
            if got is None:
                break
            out.append(got)
        return out

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
        return dec.payload[index * self.block_bytes : (index + 1) * self.block_bytes]

    def _read_chunk(self, tier: _Tier, chunk: _Chunk) -> Decoded | None:
        t0 = time.perf_counter()
        try:
            if chunk.record is not None:
                rec = chunk.record
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
        with self._lock:
            tier.stats.read_latency.observe(time.perf_counter() - t0)
        return dec

    def _failed(self, tier: _Tier, chunk: _Chunk, e: VerifyError) -> None:
        """A chunk that did not read back: counted, logged once per cause, forgotten. One the LRU let go
        of while it was being read (its file deleted under the reader) is a plain miss."""
        with self._lock:
            if chunk.key not in tier.chunks:
                return
            tier.stats.verify_failures[e.cause] += 1
            gone = tier.drop(chunk.key)
        if gone is not None and gone.record is None and self.slot is not None:
            with contextlib.suppress(OSError):
                (self.slot / _name(chunk.key)).unlink()
        self._log_once(tier.name, e.cause, f"a KV chunk did not read back ({e}): a miss, recomputed")

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
        """Every (block hash, tier name) the tiers hold now, RAM's first: what a read can return."""
        with self._lock:
            return [(h, t.name) for t in (self.ram, self.disk) if t is not None for h in t.where]

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
        if self.ram is not None and ram:
            self._write(self.ram, offer, ram)
        if self.disk is not None and disk:
            self._write(self.disk, offer, disk)

    def _write(self, tier: _Tier, offer: _Offer, picked: list[int]) -> None:
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
                chunk = _Chunk(self._keys, tuple(hashes), len(rec), rec if tier is self.ram else None)
                evicted = tier.room_for(len(rec))
        if too_large:
            self._log_once(tier.name, "too_large", f"a KV chunk of {len(rec)} bytes is larger than the tier")
            return
        if tier is self.disk:
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
        does not hold up a shutdown; the writer is a daemon thread) and let go of the disk slot, unless the
        writer is still busy (call again to finish). The slot's files stay until the next store takes it."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout)
        self._writer.join(timeout)
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
            return StoreStats(tiers, self.dropped_blocks, self.filtered_blocks)

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
