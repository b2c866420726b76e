"""KV events: which prefix-cache blocks each service holds, published to Redis and read back by the
router into an approximate index.

    kvev:{worker}     stream, one entry per flush: inc (incarnation), seq (1, 2, ... per incarnation),
                      v (format, FORMAT), s / r (hashes stored in / removed from the device pool),
                      s.ram / r.ram, s.disk / r.disk (the same for the offload tiers, when any);
                      trimmed to about maxlen entries
    kvsnap:{worker}   string (JSON): incarnation, block_size, seq and stream id of the last entry
                      before the copy, hashes (the device pool's), version, tiers ({tier: hashes});
                      TTL = a few snapshot periods (the stream's too)

Tiers (format 2). Every hash is named with the tier that holds it: `device` (the KV pool's prefix
cache), `ram` or `disk` (common/kv/tiers.py: a tier publishes a hash once it has stored it, so a read
can return it, and removes it when its LRU or a failed verification lets go of it). A block leaving the
pool for a tier is "removed" from device and "stored" in that tier. Format 1 (no v, no tiers) was
device only; a format-1 reader reads a format-2 stream's device fields correctly and never sees the
tiers (it predicts less, never more). This reader refuses an entry or snapshot of a later format, or a
field it does not know, and holds no hashes for that worker meanwhile (logged once): a misread index
would route to blocks nobody holds.

Hashes are the block manager's chained block hashes (common/prefix_hash.py), never tokens; a list of
them travels as base64 of little-endian int64s. A flush carries each hash's net change since the last
flush (its last event wins), so an entry's s and r are disjoint and apply in any order.

`KVEventPublisher` runs in a prefill or decode service: every interval_s it drains the block manager's
events into one stream entry, and every snapshot_s (or sooner when needed) writes the whole hash set.
`KVIndex` runs in the router: per worker, the snapshot's hashes plus every stream entry after it, read
with one blocking XREAD across all workers (XREAD BLOCK, 1 s by default): it returns as soon as an
entry arrives, so an idle router sends about one XREAD a second instead of polling; reads are at least
poll_s apart, so workers that publish often are read in batches. An entry whose seq is not the next
one (the stream was trimmed past the reader, an entry was lost, the worker restarted) makes the reader
sync again from the snapshot. The index is approximate by design: it lags by up to poll_s behind a
busy worker, and keeps its last state while Redis is away. No torch and no engine imports: the router
imports this module.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from common.prefix_hash import DEVICE, DISK, RAM, KVEvent, KVHeld
from common.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)
SNAPSHOT_TTL_PERIODS = 3  # a snapshot (and the stream) outlives this many missed snapshot periods
EMPTY_STREAM_ID = "0-0"  # XREAD from here returns a stream's every entry

FORMAT = 2  # the stream's and snapshot's format (module doc); readers refuse later ones
TIERS = (DEVICE, RAM, DISK)  # best first: a hash's best tier is the first that holds it
_BIT = {t: 1 << i for i, t in enumerate(TIERS)}
_FIELDS = {DEVICE: ("s", "r"), RAM: ("s.ram", "r.ram"), DISK: ("s.disk", "r.disk")}  # (stored, removed)
_KNOWN_FIELDS = frozenset({"inc", "seq", "v", *(f for pair in _FIELDS.values() for f in pair)})

StreamEntry = tuple[str, dict[str, str]]  # (stream id, fields), as XREAD returns them


class KVSnapshot(msgspec.Struct):
    """A worker's whole hash set; entries with seq > `seq` (after stream id `last_id`) follow it."""

    incarnation: str
    block_size: int
    seq: int
    last_id: str
    hashes: str  # pack_hashes: the device pool's
    version: int = 1  # FORMAT (absent: 1, device only)
    tiers: dict[str, str] = {}  # offload tier -> pack_hashes


def stream_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}kvev:{worker_id}"


def snapshot_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}kvsnap:{worker_id}"


def pack_hashes(hashes: Iterable[int]) -> str:
    """Hashes as base64 of little-endian int64s (11 characters a hash, against ~20 in decimal)."""
    a = array("q", hashes)
    if sys.byteorder == "big":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode()


def unpack_hashes(text: str) -> list[int]:
    a = array("q", base64.b64decode(text))
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def net_changes(events: Iterable[KVEvent]) -> dict[str, tuple[list[int], list[int]]]:
    """{tier: (stored, removed)} for the tiers with changes: each (hash, tier)'s last event wins, so a
    tier's two lists are disjoint."""
    last: dict[tuple[str, int], bool] = {}
    for stored, h, tier in events:
        assert tier in _BIT, f"unknown KV tier {tier!r}"
        last[(tier, h)] = stored
    out: dict[str, tuple[list[int], list[int]]] = {}
    for (tier, h), stored in last.items():
        out.setdefault(tier, ([], []))[0 if stored else 1].append(h)
    return out


@dataclass(frozen=True)
class TierMatch:
    """A prompt's leading blocks a worker holds, by the tier it would read them from, as the engine
    reuses them (common/kv/block_manager.py): first the run the device pool holds, then the run the
    offload tiers return (RAM before disk for each block), up to a block held by neither or by the
    pool again (the engine's tier load stops there)."""

    device: int = 0
    ram: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.ram + self.disk


class KVEventPublisher:
    """One service's KV events and snapshots (see the module docstring).

    `source` drains the events recorded since its last call; `snapshot` returns every hash held now.
    Both are called on the event loop while the engine thread keeps changing the cache, so a snapshot
    is copied after the drain that precedes it: it reflects at least every event in the entries up to
    its seq; events it also reflects that come in later entries are applied again, harmlessly (adding
    or removing a hash is idempotent, and each hash's last event wins).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        worker_id: str,
        incarnation: str,
        block_size: int,
        source: Callable[[], Sequence[KVEvent]],
        snapshot: Callable[[], Sequence[KVHeld]],
        interval_s: float = 0.1,
        snapshot_s: float = 5.0,
        maxlen: int = 10_000,
    ) -> None:
        self.redis, self.worker_id, self.incarnation = redis, worker_id, incarnation
        self.block_size, self.source, self.snapshot = block_size, source, snapshot
        self.interval_s, self.snapshot_s, self.maxlen = interval_s, snapshot_s, maxlen
        self.stream_key, self.snapshot_key = stream_key(prefix, worker_id), snapshot_key(prefix, worker_id)
        self.seq = 0  # the last entry's seq, whether it landed or was lost
        self.last_id = EMPTY_STREAM_ID  # the stream id of the last entry that landed
        self._snapshot_seq = 0  # seq of the last snapshot written
        self._next_snapshot = 0.0  # monotonic time the next snapshot is due
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start afresh: drop the stream of an earlier start of this worker and write a snapshot of
        what is held now (nothing, for a worker that just started). Errors propagate: a worker that
        cannot reach Redis should not start, as with its registration."""
        self.source()  # what happened so far is in the snapshot below
        body = self._snapshot_body()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.stream_key)
            pipe.set(self.snapshot_key, body, px=self._ttl_ms())
            await pipe.execute()
        self._next_snapshot = time.monotonic() + self.snapshot_s
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.worker_id}")

    async def stop(self, delete: bool = True) -> None:
        """Stop publishing; by default also delete the stream and snapshot (the worker is leaving)."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if delete:
            try:
                await self.redis.delete(self.stream_key, self.snapshot_key)
            except Exception:
                log.exception(
                    "could not delete the KV events of %s; they expire by themselves", self.worker_id
                )

    async def _run(self) -> None:
        failing = False  # log an outage once, not every tick
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except Exception:
                if not failing:
                    log.exception("publishing KV events of %s failed; retrying every tick", self.worker_id)
                failing = True
            else:
                if failing:
                    log.info("publishing KV events of %s again", self.worker_id)
                failing = False

    async def flush(self) -> None:
        """One tick: the events drained since the last tick as one stream entry, then the snapshot if
        it is due. Raises on a Redis error; the next tick goes on (an entry that did not land is lost:
        readers see the gap in seq, and the next snapshot, written as soon as Redis answers, covers it)."""
        changes = net_changes(self.source())
        if changes:
            self.seq += 1
            device = changes.get(DEVICE, ([], []))
            entry: dict[FieldT, EncodableT] = {
                "inc": self.incarnation,
                "seq": self.seq,
                "v": FORMAT,
                "s": pack_hashes(device[0]),  # always there: what a format-1 reader reads
                "r": pack_hashes(device[1]),
            }
            for tier in (RAM, DISK):
                for name, hashes in zip(_FIELDS[tier], changes.get(tier, ([], [])), strict=True):
                    if hashes:
                        entry[name] = pack_hashes(hashes)
            try:
                entry_id = await self.redis.xadd(self.stream_key, entry, maxlen=self.maxlen, approximate=True)
            except Exception:
                self._next_snapshot = 0.0
                raise
            self.last_id = cast(str, entry_id)
            if self.seq - self._snapshot_seq >= self.maxlen // 2:
                self._next_snapshot = 0.0  # a new snapshot before the stream is trimmed past the last one
        if time.monotonic() >= self._next_snapshot:
            await self.write_snapshot()

    async def write_snapshot(self) -> None:
        """The whole hash set, with the seq and stream id of the last entry before the copy. The
        stream's TTL is renewed with it, so a dead worker's keys go away by themselves."""
        seq, body = self.seq, self._snapshot_body()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.snapshot_key, body, px=self._ttl_ms())
            pipe.pexpire(self.stream_key, self._ttl_ms())
            await pipe.execute()
        self._snapshot_seq = seq
        self._next_snapshot = time.monotonic() + self.snapshot_s

    def _snapshot_body(self) -> bytes:
        seq, last_id = self.seq, self.last_id  # taken before the copy (see the class docstring)
        by_tier: dict[str, list[int]] = {t: [] for t in TIERS}
        for h, tier in self.snapshot():
            by_tier[tier].append(h)
        device = pack_hashes(by_tier.pop(DEVICE))
        tiers = {t: pack_hashes(hs) for t, hs in by_tier.items() if hs}
        snap = KVSnapshot(self.incarnation, self.block_size, seq, last_id, device, FORMAT, tiers)
        return msgspec.json.encode(snap)

    def _ttl_ms(self) -> int:
        return int(SNAPSHOT_TTL_PERIODS * self.snapshot_s * 1000)


@dataclass(eq=False)
class _Tracked:
    """What the index knows of one worker."""

    incarnation: str
    block_size: int
    hashes: dict[int, int] = field(default_factory=dict)  # hash -> bit set of the tiers holding it (_BIT)
    seq: int = 0  # the last entry applied (or the snapshot's)
    last_id: str = EMPTY_STREAM_ID  # where the next XREAD starts
    synced: bool = False  # False: (re)sync from the snapshot before reading the stream again
    synced_at: float = float("-inf")  # monotonic time of the last sync
    retry_at: float = 0.0  # monotonic time the next sync may be tried
    refused: bool = False  # its events are of a format this reader does not know (logged once)


def socket_timeout_s(redis: aioredis.Redis) -> float | None:
    """The socket timeout `redis`'s connections get: the pool's setting, else the connection class's
    default (redis-py 8: 5 s; redis-py 5: none), read from a connection made and never opened."""
    pool = redis.connection_pool
    try:
        timeout = pool.connection_class(**pool.connection_kwargs).socket_timeout
    except Exception:  # a connection class that wants more than the pool's settings (Sentinel's)
        timeout = pool.connection_kwargs.get("socket_timeout")
    return float(timeout) if timeout else None


class KVIndex:
    """The router's approximate view of every worker's prefix cache (see the module docstring).

    `set_workers` says which workers to track (the registry's view); `poll` (or the task `start` runs)
    reads their events; `matched_blocks` answers from memory, on the request path.
    A worker that needs a sync is synced at most every resync_s (a snapshot older than the stream's
    tail cannot help until the next one is written).

    The task reads with XREAD BLOCK block_s: it wakes when an entry arrives, or after block_s, or
    sooner when a worker's sync comes due; reads are at least poll_s apart (entries that come often
    are read in batches), and a failed one is retried after poll_s. block_s = 0 reads without
    blocking, every poll_s. A worker that set_workers adds while a read is blocked is synced and read
    after that read, so within block_s (at once when there was nothing to read: that wait ends when
    set_workers adds one).

    The blocking read goes through `redis`'s own pool, the one the request path uses (records, API
    keys, leases). That cannot starve it: this index is one task that sends one command at a time, so
    it holds at most one connection of that pool, now for up to block_s rather than ~1 ms a poll; the
    pool (redis-py's BlockingConnectionPool, as `common.cluster.state.connect` builds it) opens another
    for anyone else, up to max_connections (100 unless the URL sets it). A client of its own
    would have to rebuild the pool's settings (TLS, unix socket, Sentinel) to save that one
    connection. The connections' socket timeout bounds every reply, a blocked XREAD's included:
    block_s is kept to half of it. redis-py sets 5 s unless told otherwise (since its version 8;
    none before), so the 1 s default stands and a longer block needs a longer timeout in the URL.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        poll_s: float = 0.05,
        resync_s: float = 0.5,
        count: int = 256,
        block_s: float = 1.0,
    ) -> None:
        assert block_s >= 0, block_s
        socket_timeout = socket_timeout_s(redis)
        if socket_timeout:  # past it the client gives up on the read and drops the connection
            block_s = min(block_s, socket_timeout / 2)
        self.redis, self.prefix = redis, prefix
        self.poll_s, self.resync_s, self.count, self.block_s = poll_s, resync_s, count, block_s
        self.workers: dict[str, _Tracked] = {}
        self.events_applied = 0  # hashes added or removed from stream entries
        self.resyncs = 0  # snapshots loaded
        self.lag_s = 0.0  # age of the newest entry in the last poll that read any (Redis' clock vs ours)
        self.errors = 0  # polls that failed on Redis
        self.refused = 0  # entries and snapshots of a format this reader does not know
        self._added = asyncio.Event()  # set_workers added a worker: ends poll's wait when none is synced
        self._task: asyncio.Task[None] | None = None

    # --- the request path: memory only -----------------------------------------------------------
    def matched(self, worker_id: str, chain: Sequence[int], disk: bool = True) -> TierMatch:
        """The leading hashes of a prompt's chain the worker would reuse, by tier (`TierMatch`; all 0
        for an unknown worker). `disk=False`: the worker reads no disk hit now (its load's
        `kv_tier_disk_reads`: the disk costs more than recomputing), so a block on the disk only ends
        the run, as it ends the engine's read."""
        tracked = self.workers.get(worker_id)
        if tracked is None:
            return TierMatch()
        held, dev, ram = tracked.hashes, _BIT[DEVICE], _BIT[RAM]
        n, i = [0, 0, 0], 0
        while i < len(chain) and held.get(chain[i], 0) & dev:
            i += 1
        n[0] = i
        for h in chain[i:]:
            bits = held.get(h, 0)
            if not bits or bits & dev:  # not held, or the pool's again: the engine's tier load stops
                break
            if not disk and not bits & ram:
                break
            n[1 if bits & ram else 2] += 1
        return TierMatch(*n)

    def matched_blocks(self, worker_id: str, chain: Sequence[int]) -> int:
        """How many leading hashes of a prompt's chain the worker would reuse, from any tier."""
        return self.matched(worker_id, chain).total

    def block_size(self, worker_id: str) -> int | None:
        """The block size the worker's hashes are computed with; None for an unknown worker."""
        tracked = self.workers.get(worker_id)
        return None if tracked is None else tracked.block_size

    # --- what to track -----------------------------------------------------------------------------
    def set_workers(self, workers: Iterable[tuple[str, str, int]]) -> None:
        """Track exactly these (worker_id, incarnation, block_size): a new worker, or one with another
        incarnation (a restart), starts empty and is synced on the next poll; one not listed is dropped."""
        current = {}
        for worker_id, incarnation, block_size in workers:
            tracked = self.workers.get(worker_id)
            if tracked is None or tracked.incarnation != incarnation:
                tracked = _Tracked(incarnation, block_size)
                self._added.set()
            current[worker_id] = tracked
        self.workers = current

    # --- reading Redis -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-index")

    async def stop(self) -> None:
        """Cancel the task, a blocked read included (redis-py drops that connection rather than
        returning it to the pool with the reply still due)."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        failing = False  # log an outage once, not every poll
        block_ms = round(self.block_s * 1000) or None  # None: no BLOCK (XREAD BLOCK 0 waits forever)
        while True:
            started = time.monotonic()
            try:
                await self.poll(block_ms)
            except Exception:
                self.errors += 1
                if not failing:
                    log.exception("reading KV events failed; keeping the last index, retrying every poll")
                failing = True
                await asyncio.sleep(self.poll_s)  # Redis away fails at once: no hot loop
                continue
            if failing:
                log.info("reading KV events again")
            failing = False
            await asyncio.sleep(max(0.0, started + self.poll_s - time.monotonic()))

    async def poll(self, block_ms: int | None = None) -> None:
        """One round: sync the workers that need it, then read every synced worker's stream once.

        block_ms: how long the read may wait for an entry (XREAD BLOCK), cut short to when an unsynced
        worker's sync comes due; with no synced worker, how long to wait for set_workers to add one.
        None (the default) reads what is there and returns. set_workers may run during the awaits:
        results go to the objects they were asked for, and a worker it adds is synced and read from
        the next round on."""
        self._added.clear()
        now = time.monotonic()
        for worker_id, tracked in list(self.workers.items()):
            if not tracked.synced and now >= tracked.retry_at:
                await self._sync(worker_id, tracked)
        streams = {stream_key(self.prefix, w): t for w, t in self.workers.items() if t.synced}
        block = None
        if block_ms is not None:
            due = min((t.retry_at for t in self.workers.values() if not t.synced), default=math.inf)
            block = int(min(block_ms / 1000, due - time.monotonic()) * 1000)
            block = block if block > 0 else None  # a sync is due: read without waiting
        if not streams:
            if block is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(block / 1000):  # not wait_for: common/runtime/tasks.py
                        await self._added.wait()
            return
        reply = await self.redis.xread(
            {key: t.last_id for key, t in streams.items()}, count=self.count, block=block
        )
        newest = 0
        for key, entries in cast(list[tuple[str, list[StreamEntry]]], reply or []):
            self._apply(key, streams[key], entries)
            newest = max(newest, int(entries[-1][0].split("-")[0]))
        if newest:
            self.lag_s = max(0.0, time.time() - newest / 1000)

    async def _sync(self, worker_id: str, tracked: _Tracked) -> None:
        """Load the worker's snapshot. None yet, or one of another incarnation (the worker restarted and
        the registry has not said so, or the other way round): try again after resync_s; another
        incarnation's hashes are not this worker's, so the index holds none meanwhile."""
        raw = await self.redis.get(snapshot_key(self.prefix, worker_id))
        tracked.retry_at = time.monotonic() + self.resync_s
        snap = _decode_snapshot(worker_id, raw)
        if snap is None:
            return
        if snap.incarnation != tracked.incarnation:
            tracked.hashes = {}
            return
        if snap.version > FORMAT or not set(snap.tiers) <= {RAM, DISK}:
            self._refuse(worker_id, tracked, f"snapshot format {snap.version}, tiers {sorted(snap.tiers)}")
            return
        hashes: dict[int, int] = {}
        for tier, packed in ((DEVICE, snap.hashes), *snap.tiers.items()):
            for h in unpack_hashes(packed):
                hashes[h] = hashes.get(h, 0) | _BIT[tier]
        tracked.hashes = hashes
        tracked.block_size, tracked.seq, tracked.last_id = snap.block_size, snap.seq, snap.last_id
        tracked.synced, tracked.synced_at, tracked.refused = True, time.monotonic(), False
        self.resyncs += 1

    def _apply(self, key: str, tracked: _Tracked, entries: list[StreamEntry]) -> None:
        """Apply entries in order; one that does not follow the last applied means a sync."""
        for entry_id, fields in entries:
            seq = int(fields["seq"])
            if fields["inc"] != tracked.incarnation or seq > tracked.seq + 1:
                tracked.synced = False
                tracked.retry_at = tracked.synced_at + self.resync_s
                return
            if int(fields.get("v", 1)) > FORMAT or not fields.keys() <= _KNOWN_FIELDS:
                self._refuse(key, tracked, f"entry format {fields.get('v')}, {sorted(fields)}")
                return
            if seq == tracked.seq + 1:  # an older one is in the snapshot already
                held = tracked.hashes
                for tier, (s_field, r_field) in _FIELDS.items():
                    bit = _BIT[tier]
                    stored, removed = (
                        unpack_hashes(fields.get(s_field, "")),
                        unpack_hashes(fields.get(r_field, "")),
                    )
                    for h in stored:
                        held[h] = held.get(h, 0) | bit
                    for h in removed:
                        bits = held.get(h, 0) & ~bit
                        if bits:
                            held[h] = bits
                        else:
                            held.pop(h, None)
                    self.events_applied += len(stored) + len(removed)
                tracked.seq = seq
            tracked.last_id = entry_id

    def _refuse(self, who: str, tracked: _Tracked, what: str) -> None:
        """A format this reader does not know: hold none of the worker's hashes (rather than misread
        them) and look again from its snapshot after resync_s (a downgrade brings it back)."""
        self.refused += 1
        if not tracked.refused:
            log.warning(
                "KV events of %s are in a format this router does not read (%s; it reads up to %d): "
                "ignoring them until they are",
                who,
                what,
                FORMAT,
            )
        tracked.refused, tracked.hashes, tracked.synced = True, {}, False
        tracked.retry_at = time.monotonic() + self.resync_s


def _decode_snapshot(worker_id: str, raw: Any) -> KVSnapshot | None:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=KVSnapshot)
    except msgspec.DecodeError:
        log.warning("ignoring an unreadable KV snapshot of %s", worker_id)
        return None
