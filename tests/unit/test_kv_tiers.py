"""The KV offload tier store (common/kv/tiers.py) on real files: LRU under hard limits, the reuse
filter, reads that verify (every fault a miss, counted, never data), a write queue that never blocks,
a real disk refusing a write; and the block manager's side (common/kv/block_manager.py): only hashed,
complete blocks go out, tier blocks come back hashed and counted as cached."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from common.kv import tiers
from common.kv.block_manager import BlockManager
from common.kv.tiers import MAGIC, TierStats, TierStore, VerifyError, decode, encode
from common.prefix_hash import ROOT, prefix_chain
from tests.support.block_owner import Owner

BS, BB = 4, 256  # tokens per block, payload bytes per block
DIGEST = bytes(range(16))
ROOT_DIR = Path(__file__).resolve().parents[2]


def blocks(first: int, n: int) -> tuple[list[int], list[tuple[int, ...]], memoryview]:
    """n consecutive blocks of a chain: hashes, tokens, and a payload whose every byte says which."""
    toks = [tuple(range(first + i * BS, first + (i + 1) * BS)) for i in range(n)]
    hashes = prefix_chain([t for b in toks for t in b], BS, root=first)
    payload = b"".join(bytes([(first + i) % 256]) * BB for i in range(n))
    return hashes, toks, memoryview(payload)


def store(tmp_path: Path | None = None, ram_blocks: int = 0, disk_blocks: int = 0, **kw: object) -> TierStore:
    """A store whose tiers hold this many blocks (RAM: slots; disk: about this many single-block
    records)."""
    rec = len(encode(DIGEST, BS, *blocks(0, 1)))
    return TierStore(
        DIGEST, BS, BB, ram_bytes=ram_blocks * BB, disk_dir=tmp_path,
        disk_bytes=disk_blocks * rec, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def put(s: TierStore, first: int, n: int = 1, times: int = 1) -> tuple[list[int], list[tuple[int, ...]]]:
    """Offer n blocks as one chunk (each hash sighted `times`, as that many evictions would) and wait
    for the writer."""
    hashes, toks, payload = blocks(first, n)
    for _ in range(times):
        for h in hashes:
            s.wants(h)
    assert s.offer(hashes, toks, payload)
    assert s.wait_idle(10)
    return hashes, toks


def tier(s: TierStore, name: str) -> TierStats:
    return next(t for t in s.stats().tiers if t.tier == name)


def test_ram_round_trip_and_lru_under_a_hard_limit() -> None:
    s = store(ram_blocks=3)
    try:
        chains = [put(s, first) for first in (100, 200, 300)]
        got = s.read(*chains[0])
        assert [bytes(b) for b in got] == [bytes([100]) * BB]
        put(s, 400)  # over the limit: the least recently used goes (200: 100 was just read)
        assert s.read(*chains[1]) == []
        assert len(s.read(*chains[0])) == 1 and len(s.read(*chains[2])) == 1
        st = tier(s, "ram")
        assert st.blocks == 3 and st.bytes <= st.capacity_bytes and st.evicted == 1
        assert st.hits == 3 and st.misses == 1 and st.verify_failures.total() == 0
        assert st.read_latency.counts and sum(st.write_latency.counts) == 4
    finally:
        s.close()


def test_a_chunk_larger_than_the_tier_is_not_stored() -> None:
    s = store(ram_blocks=2)
    try:
        hashes, toks = put(s, 0, n=3)
        assert s.read(hashes, toks) == []
        st = tier(s, "ram")
        assert st.write_failures["too_large"] == 3 and st.bytes == 0
    finally:
        s.close()


def test_read_returns_the_leading_run_and_stops_at_the_first_miss() -> None:
    s = store(ram_blocks=8)
    try:
        hashes, toks, payload = blocks(0, 4)
        s.offer(hashes[:2], toks[:2], payload[: 2 * BB])
        s.offer(hashes[3:], toks[3:], payload[3 * BB :])  # block 2 never stored
        assert s.wait_idle(10)
        got = s.read(hashes, toks)
        assert [bytes(b)[0] for b in got] == [0, 1]
        wrong_tokens = [toks[0][:-1] + (999,)] + toks[1:]  # same hash, other tokens: not this block
        assert s.read(hashes, wrong_tokens) == []
        assert tier(s, "ram").verify_failures["block"] == 1
    finally:
        s.close()


def test_reuse_filter_a_block_reaches_the_disk_only_once_seen_twice(tmp_path: Path) -> None:
    s = store(tmp_path, disk_blocks=8)
    try:
        once = put(s, 0, n=2, times=1)
        assert s.read(*once) == [] and s.stats().filtered_blocks == 2
        assert not list(s.slot.glob("*.kv"))  # type: ignore[union-attr]
        twice = put(s, 0, n=2, times=2)
        assert [bytes(b)[0] for b in s.read(*twice)] == [0, 1]
        assert tier(s, "disk").hits == 2 and len(list(s.slot.glob("*.kv"))) == 1  # type: ignore[union-attr]
        assert not s.wants(twice[0][0]), "a block the disk holds is not offered again"
    finally:
        s.close()


def test_disk_lru_keeps_files_and_bytes_under_the_limit(tmp_path: Path) -> None:
    s = store(tmp_path, disk_blocks=2)
    try:
        chains = [put(s, first, times=2) for first in (10, 20, 30)]
        assert s.read(*chains[0]) == [] and len(s.read(*chains[2])) == 1
        files = list(s.slot.glob("*.kv"))  # type: ignore[union-attr]
        st = tier(s, "disk")
        assert len(files) == 2 == st.blocks and sum(f.stat().st_size for f in files) == st.bytes
        assert st.bytes <= st.capacity_bytes
    finally:
        s.close()


def _only_file(s: TierStore) -> Path:
    (path,) = s.slot.glob("*.kv")  # type: ignore[union-attr]
    return path


@pytest.mark.parametrize(
    "fault, cause",
    [
        ("truncate", "truncated"),
        ("flip_payload", "checksum"),
        ("flip_header", "checksum"),
        ("flip_hash", "checksum"),
        ("delete", "missing"),
        ("empty", "truncated"),
        ("swap", "block"),
    ],
)
def test_a_damaged_disk_record_is_a_miss_never_data(tmp_path: Path, fault: str, cause: str) -> None:
    s = store(tmp_path, disk_blocks=8)
    try:
        hashes, toks = put(s, 0, n=2, times=2)
        path = _only_file(s)
        data = bytearray(path.read_bytes())
        if fault == "truncate":
            path.write_bytes(data[: len(data) - 7])
        elif fault.startswith("flip"):
            # the payload, the layout digest (header byte 8), the first block hash (the 44-byte header's end)
            at = {"flip_payload": len(data) - BB // 2, "flip_header": 8, "flip_hash": 47}[fault]
            data[at] ^= 0x10
            path.write_bytes(data)
        elif fault == "delete":
            path.unlink()
        elif fault == "empty":
            path.write_bytes(b"")
        elif fault == "swap":  # a valid record of other blocks where this one should be
            other_h, other_t, other_p = blocks(50, 2)
            path.write_bytes(encode(DIGEST, BS, other_h, other_t, other_p))
        assert s.read(hashes, toks) == []
        st = tier(s, "disk")
        assert st.verify_failures[cause] == 1 and st.hits == 0 and st.blocks == 0
        assert not path.exists(), "a record that failed is deleted"
        assert s.read(hashes, toks) == [], "and stays a miss"
        assert st.verify_failures.total() == 1
    finally:
        s.close()


def test_a_damaged_ram_record_falls_back_to_the_disk_copy(tmp_path: Path) -> None:
    s = store(tmp_path, ram_blocks=8, disk_blocks=8)
    try:
        hashes, toks = put(s, 0, n=2, times=2)
        assert s.ram is not None
        (chunk,) = s.ram.chunks.values()
        assert chunk.slots is not None and s.arena is not None
        s.arena.raw(chunk.slots[-1])[-1] ^= 0xFF  # the RAM copy's last payload byte
        got = s.read(hashes, toks)
        assert [bytes(b) for b in got] == [bytes([0]) * BB, bytes([1]) * BB]
        assert tier(s, "ram").verify_failures["checksum"] == 1 and tier(s, "disk").hits == 2
    finally:
        s.close()


def test_a_read_told_to_leave_the_disk_alone_stops_there_and_counts_what_it_left(tmp_path: Path) -> None:
    """`read(disk=False)`: RAM's blocks only; the blocks the disk holds where it stops are counted (left
    to be recomputed). Every disk chunk read, a prefetch's too, measures the disk's cost per block."""
    s = store(tmp_path, ram_blocks=2, disk_blocks=8)
    try:
        assert s.disk_read_s_per_block() is None
        hashes, toks = put(s, 0, n=2, times=2)  # in RAM and on the disk
        more, more_toks = put(s, 2, n=2, times=2)  # RAM keeps these two only
        chain, chain_toks = hashes + more, toks + more_toks
        assert s.read(hashes, toks, disk=False) == [] and s.disk_skipped_blocks == 2
        assert len(s.read(more, more_toks, disk=False)) == 2 and s.disk_skipped_blocks == 2
        assert s.disk_read_s_per_block() is None, "no disk read yet"
        assert len(s.read(chain, chain_toks)) == 4 and tier(s, "disk").hits == 2
        assert (s.disk_read_s_per_block() or 0) > 0
        assert s.stats().disk_skipped_blocks == 2
    finally:
        s.close()


def test_a_disk_probe_measures_the_disk_on_the_writer_thread(tmp_path: Path) -> None:
    """`probe_disk` reads one disk chunk on the writer thread (no caller waits for it): the disk's cost
    is measured, one probe at a time; a store without a disk has nothing to probe."""
    s = store(tmp_path, ram_blocks=2, disk_blocks=8)
    try:
        put(s, 0, n=2, times=2)
        assert s.disk_read_s_per_block() is None and s.disk_read_age() is None
        assert s.probe_disk()
        assert s.wait_idle(10) and s.disk_probes == 1
        assert (s.disk_read_s_per_block() or 0) > 0 and (s.disk_read_age() or 0) >= 0
        assert tier(s, "disk").hits == 0, "a probe is no hit"
        assert s.probe_disk() and s.wait_idle(10) and s.disk_probes == 2
    finally:
        s.close()
    ram_only = store(ram_blocks=2)
    try:
        assert not ram_only.probe_disk()
    finally:
        ram_only.close()


def test_records_verify_layout_and_length() -> None:
    hashes, toks, payload = blocks(0, 2)
    rec = encode(DIGEST, BS, hashes, toks, payload)
    assert rec[:4] == MAGIC
    dec = decode(rec, DIGEST, BS, BB)
    assert dec.hashes == tuple(hashes) and dec.tokens == tuple(toks)
    assert b"".join(dec.blocks) == bytes(payload)
    for args, cause in [
        ((rec, bytes(16), BS, BB), "layout"),  # another model or KV layout wrote it
        ((rec, DIGEST, BS * 2, BB), "layout"),  # another block size
        ((rec, DIGEST, BS, BB * 2), "layout"),
        ((rec[:10], DIGEST, BS, BB), "truncated"),
        ((rec + b"x", DIGEST, BS, BB), "truncated"),
    ]:
        with pytest.raises(VerifyError) as e:
            decode(*args)
        assert e.value.cause == cause


def test_the_ram_arena_takes_memory_as_needed_in_power_of_two_segments_never_past_its_size() -> None:
    """The RAM tier's memory (HostArena): nothing allocated before the first write, each segment a power
    of two bytes (what a pinned allocator rounds to) from the allocator it was given, all of them
    together within the tier's size; the tier's capacity is exactly its slots."""
    sizes: list[int] = []

    def allocate(n: int) -> bytearray:
        sizes.append(n)
        return bytearray(n)

    cap = 11 * BB + 100  # not a power of two, nor a whole number of slots
    s = TierStore(DIGEST, BS, BB, ram_bytes=cap, ram_allocate=allocate)
    try:
        arena = s.arena
        assert arena is not None and arena.allocated_bytes == 0 and not sizes
        assert tier(s, "ram").capacity_bytes == arena.slots * arena.stride <= cap
        assert arena.slots == 11  # 8 + 2 + 1 slots: segments of 2048, 512 and 256 bytes
        chains = [put(s, 100 * i) for i in range(1, 14)]  # more than it holds: the LRU recycles slots
        assert sizes == [2048, 512, 256] and sum(sizes) == arena.allocated_bytes <= cap
        assert all(n & (n - 1) == 0 for n in sizes)
        assert [len(s.read(*c)) for c in chains] == [0, 0] + [1] * 11
        assert arena.free_slots == 0 and tier(s, "ram").write_failures.total() == 0
    finally:
        s.close()


def test_a_segment_is_allocated_without_holding_up_readers() -> None:
    """Allocating a segment (pinning 256 MiB on a GPU takes a while) happens on the writer thread outside
    the store's lock: while an allocation is held up, a read of what RAM holds answers."""
    gate, asked = threading.Event(), threading.Event()

    def allocate(n: int) -> bytearray:
        if n == 1024:  # the second segment: held until the read below has answered
            asked.set()
            assert gate.wait(30)
        return bytearray(n)

    s = TierStore(DIGEST, BS, BB, ram_bytes=12 * BB, ram_allocate=allocate)  # segments: 8 and 4 slots
    try:
        chains = [put(s, 100 * i) for i in range(1, 9)]  # the first segment full
        hashes, toks, payload = blocks(900, 1)
        assert s.offer(hashes, toks, payload)  # its slot is in the second segment
        assert asked.wait(30), "the writer is allocating the second segment"
        answered: list[int] = []
        reader = threading.Thread(target=lambda: answered.append(len(s.read(*chains[0]))))
        reader.start()
        reader.join(30)
        held_up = reader.is_alive()
        gate.set()
        reader.join(30)
        assert not held_up and answered == [1], "the read answered while the segment was being allocated"
        assert s.wait_idle(30) and len(s.read(hashes, toks)) == 1
    finally:
        gate.set()
        s.close()


def test_a_ram_slot_is_never_reused_while_a_reader_still_refers_to_its_bytes() -> None:
    """A read hands back views of the tier's own memory. The LRU may let go of the chunk while a copy
    still reads them (a tensor made from a view, as a copy to a GPU is), but its slot is not handed to
    a new write until nothing refers to it: meanwhile a write that needs it is not stored (counted
    `busy`), and the reader's bytes stay the chunk's. Once they are let go of, the slot is reused."""
    s = store(ram_blocks=2)
    try:
        a = put(s, 100)
        put(s, 200)
        got = s.read(*a)
        held = torch.frombuffer(got[0], dtype=torch.uint8)  # a copy's source, made from the view
        del got
        put(s, 300)  # the LRU lets go of 200 (100 was just read): its slot is free, 300 takes it
        put(s, 400)  # the LRU lets go of 100, but its slot is still read: 400 finds no free slot
        ram = tier(s, "ram")
        assert s.read(*a) == [] and ram.evicted == 2 and ram.blocks == 1
        assert ram.write_failures["busy"] == 1, "the write that needed 100's slot was not stored"
        assert bytes(held.numpy()) == bytes([100]) * BB, "the reader's bytes are still 100's"
        del held
        gc.collect()
        put(s, 500)  # the slot is free again
        assert len(s.read(*blocks(500, 1)[:2])) == 1 and tier(s, "ram").write_failures["busy"] == 1
    finally:
        s.close()


def test_views_held_across_concurrent_writes_keep_their_bytes() -> None:
    """A reader holding its views while the store's writer thread keeps storing (the LRU letting go of,
    and the arena handing out again, every slot it can) always sees the bytes of the blocks it asked
    for: at the read, and still after the writes that came meanwhile. 4 slots; each turn offers one
    of 3 two-block chains and, while the writer stores it, reads another."""
    s = store(ram_blocks=4)
    firsts = [100, 150, 200]
    try:
        held: list[tuple[int, list[torch.Tensor]]] = []
        seen = 0
        for i in range(600):
            hashes, toks, payload = blocks(firsts[i % 3], 2)
            if not s.offer(hashes, toks, payload):
                s.wait_idle(10)  # the queue is full: let the writer catch up
            first = firsts[(i + 1) % 3]
            hashes, toks, _ = blocks(first, 2)
            got = [torch.frombuffer(b, dtype=torch.uint8) for b in s.read(hashes, toks)]
            seen += len(got)
            held.append((first, got))
            if len(held) > 3:  # hold each read's bytes across a few more writes
                old_first, old = held.pop(0)
                for j, b in enumerate(old):
                    assert bool((b == (old_first + j) % 256).all()), "a held block's bytes changed"
        assert seen > 0, "some reads found their blocks"
    finally:
        s.close()


class StuckDisk(TierStore):
    """A disk whose writes hang until `go` is set (a slow, or stalled, device)."""

    def __init__(self, *a: object, **kw: object) -> None:
        self.go, self.writing = threading.Event(), threading.Event()
        super().__init__(*a, **kw)  # type: ignore[arg-type]

    def _write_file(self, path: Path, rec: bytearray) -> None:
        self.writing.set()
        assert self.go.wait(60), "the test never released the disk"
        super()._write_file(path, rec)


def test_a_stuck_disk_never_blocks_an_offer_and_drops_are_counted(tmp_path: Path) -> None:
    rec = len(encode(DIGEST, BS, *blocks(0, 1)))
    s = StuckDisk(DIGEST, BS, BB, disk_dir=tmp_path, disk_bytes=64 * rec, queue_chunks=2)
    try:
        offered = []
        for first in range(0, 400, 100):  # the writer takes one and hangs, two wait, one is dropped
            hashes, toks, payload = blocks(first, 2)
            for h in hashes + hashes:
                s.wants(h)
            offered.append(s.offer(hashes, toks, payload))
            if first == 0:
                assert s.writing.wait(10)
        assert offered == [True, True, True, False]
        assert s.stats().dropped_blocks == 2 and not s.wait_idle(0)
        s.close(timeout=0.05)  # a shutdown is not held up by the hung write...
        assert s._writer.is_alive()
        other = store(tmp_path, disk_blocks=8)
        assert other.slot != s.slot, "...and the slot stays locked while a write may still land in it"
        other.close()
        s.go.set()
        assert s.wait_idle(10)
        assert tier(s, "disk").blocks == 6, "what was queued is written"
    finally:
        s.go.set()
        s.close()
    assert not s._writer.is_alive() and s._slot_fd is None


def test_stores_sharing_a_folder_take_their_own_slots_and_a_new_one_starts_empty(tmp_path: Path) -> None:
    a, b = store(tmp_path, disk_blocks=8), store(tmp_path, disk_blocks=8)
    try:
        assert a.slot != b.slot and {a.slot.name, b.slot.name} == {"slot-0", "slot-1"}  # type: ignore[union-attr]
        put(a, 0, times=2)
        assert len(list(a.slot.glob("*.kv"))) == 1  # type: ignore[union-attr]
    finally:
        a.close()
        b.close()
    c = store(tmp_path, disk_blocks=8)
    try:
        assert c.slot == a.slot and not list(c.slot.glob("*.kv")), "an earlier owner's records are gone"  # type: ignore[union-attr]
    finally:
        c.close()


_DISK_FULL = """
import resource, signal, sys
sys.path.insert(0, {root!r})
from tests.unit.test_kv_tiers import blocks, put, store, tier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel then answers EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
s = store({dir!r}, disk_blocks=16)
small = put(s, 0, n=1, times=2)      # fits under the file size limit
big = put(s, 100, n=8, times=2)      # does not: the write fails part way
assert s.read(*big) == [], "a failed write is a miss"
assert [bytes(b)[0] for b in s.read(*small)] == [0], "and the tier goes on"
st = tier(s, "disk")
assert st.write_failures["full"] == 8 and st.blocks == 1, st
import pathlib
assert not list(pathlib.Path(s.slot).glob("*.tmp")), "no half-written file is left"
s.close()
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and EFBIG as on Linux")
def test_a_disk_that_refuses_a_write_is_a_miss_not_an_error(tmp_path: Path) -> None:
    """A real refusal from the kernel, part way through a record: RLIMIT_FSIZE in a child process (so
    nothing else of the test run is limited)."""
    limit = len(encode(DIGEST, BS, *blocks(0, 2)))  # one-block records fit, an eight-block one does not
    code = _DISK_FULL.format(root=str(ROOT_DIR), limit=limit, dir=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# --- prefetch on arrival ----------------------------------------------------------------------------


def disk_only(tmp_path: Path, **kw: object) -> tuple[TierStore, list[int], list[tuple[int, ...]]]:
    """A store whose RAM holds one two-block chunk: A (blocks 0, 1) reached the disk (offered twice)
    and left RAM when B (blocks 100, 101, offered once: RAM only) came; returns A."""
    s = store(tmp_path, ram_blocks=3, disk_blocks=16, **kw)
    a_hashes, a_toks = put(s, 0, n=2, times=2)
    put(s, 100, n=2)
    assert s.ram is not None and s.disk is not None
    assert not any(s.ram.holds(h) for h in a_hashes) and all(s.disk.holds(h) for h in a_hashes)
    return s, a_hashes, a_toks


class DiskReads:
    """Counts the disk files read, by thread name; `gate[name]`, when set, holds that thread's next
    read until the event is set (a slow disk for that reader only)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.by: Counter[str] = Counter()
        self.gate: dict[str, threading.Event] = {}
        self.inside: dict[str, threading.Event] = {}
        real = tiers._read_file

        def read_file(path: Path) -> bytearray:
            name = threading.current_thread().name
            self.by[name] += 1
            if name in self.gate:
                self.inside.setdefault(name, threading.Event()).set()
                assert self.gate[name].wait(30), "the test never released the disk"
            return real(path)

        monkeypatch.setattr(tiers, "_read_file", read_file)

    def reached(self, name: str) -> bool:
        return self.inside.setdefault(name, threading.Event()).wait(10)


def test_prefetch_brings_a_disk_chunk_into_ram_and_the_read_finds_it_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, hashes, toks = disk_only(tmp_path)
    reads = DiskReads(monkeypatch)
    try:
        s.enable_events()
        s.drain_events()
        assert s.prefetch(hashes)
        assert s.wait_prefetched(10)
        assert s.ram is not None and all(s.ram.holds(h) for h in hashes)
        assert reads.by == {"kv-tier-prefetch": 1}, "one chunk, read once, off the caller's thread"
        b_hashes = blocks(100, 2)[0]  # RAM's LRU let go of B to make room, as any RAM write would
        assert s.drain_events() == [(False, h, "ram") for h in b_hashes] + [(True, h, "ram") for h in hashes]
        assert {(h, "ram") for h in hashes} | {(h, "disk") for h in hashes} <= set(s.held())
        pf = s.stats().prefetch
        assert (pf.started, pf.completed, pf.blocks, pf.dropped, pf.late, pf.in_time) == (1, 1, 2, 0, 0, 0)
        assert sum(tier(s, "disk").read_latency.counts) == 0, (
            "a prefetch read is not an admission's: it stays out of the router's read cost"
        )
        got = s.read(hashes, toks)  # the admission
        assert [bytes(b) for b in got] == [bytes([0]) * BB, bytes([1]) * BB]
        assert reads.by["MainThread"] == 0, "the admission read RAM, not the disk"
        assert tier(s, "ram").hits == 2 and tier(s, "disk").hits == 0
        assert s.stats().prefetch.in_time == 1
        s.read(hashes, toks)
        assert s.stats().prefetch.in_time == 1, "counted once per prefetch"
        assert not s.prefetch(hashes), "in RAM already: nothing to prefetch"
    finally:
        s.close()


def test_a_prefetch_of_several_runs_promotes_only_the_blocks_asked_for(tmp_path: Path) -> None:
    """Two runs (a grouped pool asks one per layer group): each is followed as far as the tiers hold
    it; of a chunk only the blocks asked for go into RAM (its others would take RAM from what the
    admission reads), and the blocks of both runs are read as one prefetch."""
    s = store(tmp_path, ram_blocks=4, disk_blocks=16)
    try:
        a_hashes, a_toks = put(s, 0, n=3, times=2)  # one chunk of 3 blocks, on the disk
        c_hashes, c_toks = put(s, 50, n=2, times=2)  # another, of 2
        put(s, 100, n=4)  # RAM's room taken by another chunk: A and C on the disk only
        assert s.ram is not None and not any(s.ram.holds(h) for h in a_hashes + c_hashes)
        unknown = blocks(200, 1)[0]
        assert s.prefetch(a_hashes[:2], unknown + c_hashes, c_hashes[1:])
        assert s.wait_prefetched(10)
        held = [h for h in a_hashes + c_hashes if s.ram.holds(h)]
        assert held == a_hashes[:2] + c_hashes[1:], "A's first two and C's second: the blocks asked for"
        pf = s.stats().prefetch
        assert (pf.started, pf.completed, pf.blocks) == (1, 1, 3)
        assert [bytes(b) for b in s.read(a_hashes[:2], a_toks[:2])] == [bytes([0]) * BB, bytes([1]) * BB]
        assert [bytes(b) for b in s.read(c_hashes[1:], c_toks[1:])] == [bytes([51]) * BB]
    finally:
        s.close()


def test_a_damaged_disk_chunk_is_not_promoted_and_stays_a_counted_miss(tmp_path: Path) -> None:
    s, hashes, toks = disk_only(tmp_path)
    try:
        assert s.slot is not None
        (path,) = [p for p in s.slot.glob("*.kv")]
        data = bytearray(path.read_bytes())
        data[len(data) - BB // 2] ^= 0x01  # one bit of the payload
        path.write_bytes(data)
        s.enable_events()
        assert s.prefetch(hashes)
        assert s.wait_prefetched(10)
        assert s.ram is not None and not any(s.ram.holds(h) for h in hashes)
        assert tier(s, "disk").verify_failures == {"checksum": 1} and not path.exists()
        assert s.drain_events() == [(False, h, "disk") for h in hashes], "let go of, never announced in RAM"
        pf = s.stats().prefetch
        assert (pf.started, pf.completed, pf.blocks) == (1, 1, 0)
        assert s.read(hashes, toks) == [] and s.stats().prefetch.in_time == 0
    finally:
        s.close()


def test_a_slow_prefetch_never_holds_up_the_admission(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefetch's disk read hangs: the admission's read goes to the disk itself and returns (the
    prefetch is late), while the prefetch is still inside its read; a late prefetch still queued is
    skipped, and arrivals past `prefetch_jobs` are dropped, counted."""
    s, a_hashes, a_toks = disk_only(tmp_path, prefetch_jobs=2)
    reads = DiskReads(monkeypatch)
    slow = reads.gate["kv-tier-prefetch"] = threading.Event()
    try:
        c_hashes, c_toks = put(s, 200, n=2, times=2)  # C and E: on the disk (and in RAM, until F comes)
        e_hashes, _ = put(s, 400, n=2, times=2)
        put(s, 500, n=2)
        assert s.ram is not None and not any(s.ram.holds(h) for h in a_hashes + c_hashes + e_hashes)
        assert s.prefetch(a_hashes)
        assert reads.reached("kv-tier-prefetch"), "the prefetch is inside its disk read"
        assert not s.prefetch(a_hashes), "a pending prefetch covers them: not asked twice"
        assert s.prefetch(c_hashes), "queued behind the slow one"
        assert not s.prefetch(e_hashes), "two in flight: the limit"
        got = s.read(a_hashes, a_toks)  # the admission, while the prefetch of A hangs
        assert [bytes(b) for b in got] == [bytes([0]) * BB, bytes([1]) * BB]
        assert reads.by["MainThread"] == 1, "it read the disk itself"
        assert [bytes(b) for b in s.read(c_hashes, c_toks)] == [bytes([200]) * BB, bytes([201]) * BB]
        assert reads.by["MainThread"] == 2
        pf = s.stats().prefetch
        assert (pf.started, pf.dropped, pf.late, pf.completed, pf.in_time) == (2, 1, 2, 0, 0)
        slow.set()
        assert s.wait_prefetched(10)
        pf = s.stats().prefetch
        assert pf.completed == 1, "A's ran to the end; C's was late before it started: skipped"
        assert reads.by["kv-tier-prefetch"] == 1, "C's chunk was not read a second time"
        assert all(s.ram.holds(h) for h in a_hashes)
        s.read(a_hashes, a_toks)
        assert s.stats().prefetch.in_time == 0, "a late prefetch is never counted in time"
    finally:
        slow.set()
        s.close()


def test_a_promotion_never_evicts_what_an_admission_is_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RAM holds one chunk (B), which an admission is reading (it then waits on a slow disk read of A):
    a prefetch of C finds no room but B's and gives up (counted); once the read is over, it evicts B."""
    s, a_hashes, a_toks = disk_only(tmp_path)
    reads = DiskReads(monkeypatch)
    try:
        c_hashes, _ = put(s, 200, n=2, times=2)
        b_hashes, b_toks = put(s, 100, n=2)  # B back into RAM (C out)
        assert s.ram is not None and all(s.ram.holds(h) for h in b_hashes)
        slow = reads.gate["admission"] = threading.Event()
        got: list[list[bytes]] = []
        admission = threading.Thread(
            target=lambda: got.append([bytes(b) for b in s.read(b_hashes + a_hashes, b_toks + a_toks)]),
            name="admission",
        )
        admission.start()
        assert reads.reached("admission"), "B read from RAM, A's disk read hangs"
        assert s.prefetch(c_hashes)
        assert s.wait_prefetched(10)
        pf = s.stats().prefetch
        assert (pf.completed, pf.blocks, pf.no_room) == (1, 0, 1)
        assert all(s.ram.holds(h) for h in b_hashes) and not any(s.ram.holds(h) for h in c_hashes)
        slow.set()
        admission.join(10)
        assert got == [[bytes([100]) * BB, bytes([101]) * BB, bytes([0]) * BB, bytes([1]) * BB]]
        assert s.prefetch(c_hashes) and s.wait_prefetched(10)
        assert all(s.ram.holds(h) for h in c_hashes) and not any(s.ram.holds(h) for h in b_hashes)
        assert tier(s, "ram").bytes <= tier(s, "ram").capacity_bytes
    finally:
        for ev in reads.gate.values():
            ev.set()
        s.close()


# --- the block manager's side ------------------------------------------------------------------------


@dataclass
class RecordingTier:
    """The block manager's OffloadTier as a dict of hash -> tokens (what it needs from a neighbour)."""

    held: dict[int, tuple[int, ...]] = field(default_factory=dict)
    evictions: list[tuple[int, int]] = field(default_factory=list)  # (block id, hash)
    loads: list[list[int]] = field(default_factory=list)

    def evicted(self, block_id: int, block_hash: int, tokens: tuple[int, ...], publish: bool = True) -> None:
        self.evictions.append((block_id, block_hash))
        self.held[block_hash] = tokens

    def load(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]], block_ids: Sequence[int]) -> int:
        self.loads.append(list(block_ids))
        n = 0
        while n < len(hashes) and self.held.get(hashes[n]) == tokens[n]:
            n += 1
        return n

    def prefetch(self, *runs: Sequence[int]) -> bool:
        return False

    def holds(self, keys: Sequence[int]) -> list[bool]:
        return [h in self.held for h in keys]

    def enable_events(self) -> None:
        pass

    def drain_events(self) -> list[tuple[bool, int, str]]:
        return []  # tests/unit/test_kv_tier_events.py covers a real store's

    def held_hashes(self) -> list[tuple[int, str]]:
        return [(h, "ram") for h in self.held]


def test_only_hashed_blocks_are_offloaded_never_a_reservation_still_being_filled() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS)
    bm.tier = t = RecordingTier()
    a = Owner(list(range(9)))  # 3 blocks, 2 full
    bm.allocate(a)
    bm.commit(a, 9)
    reserved = Owner(list(range(100, 104)) + [7])  # a decode reservation: KV still arriving, never hashed
    bm.allocate(reserved)
    a_hashes = [bm.blocks[b].hash or 0 for b in a.block_table[:2]]
    bm.free(a)
    bm.free(reserved)  # an aborted transfer: its blocks were never hashed
    assert t.evictions == []
    big = Owner(list(range(500, 520)))  # 5 blocks: everything is taken, the two cached ones evicted
    bm.allocate(big)
    assert sorted(h for _, h in t.evictions) == sorted(a_hashes)
    bm.check_integrity()


def test_tier_blocks_continue_the_pool_prefix_and_count_as_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.tier = t = RecordingTier()
    bm.enable_kv_events()
    prompt = list(range(17))  # 4 full blocks + 1 token
    chain = prefix_chain(prompt, BS, root=ROOT)
    t.held = {h: tuple(prompt[i * BS : (i + 1) * BS]) for i, h in enumerate(chain[:3])}
    seq = Owner(prompt)
    bm.allocate(seq)
    assert seq.num_cached_tokens == 3 * BS and seq.num_hashed_blocks == 3 and bm.tier_hits == 3
    assert t.loads == [seq.block_table[:4]], "asked for the 4 full blocks, read into fresh blocks"
    assert [bm.blocks[b].hash for b in seq.block_table[:3]] == chain[:3]
    assert bm.drain_kv_events() == [(True, h, "device") for h in chain[:3]]
    bm.commit(seq, len(prompt))  # the computed 4th block chains on the loaded ones
    assert bm.blocks[seq.block_table[3]].hash == chain[3]
    again = Owner(prompt)  # the loaded blocks are ordinary prefix-cache blocks now
    bm.allocate(again)
    assert again.block_table[:4] == seq.block_table[:4] and again.num_cached_tokens == 4 * BS
    bm.check_integrity()


def test_no_tier_lookup_without_the_prefix_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.tier = t = RecordingTier()
    seq = Owner(list(range(17)))
    bm.allocate(seq, use_prefix_cache=False)  # a swap-in, or prompt logprobs: every row computed
    assert t.loads == [] and seq.num_cached_tokens == 0
