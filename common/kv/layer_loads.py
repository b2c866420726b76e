"""Tier reads put into the pool layer by layer, while the step that needs them computes.

A prompt's blocks read back from an offload tier (common/kv/offload.py: read and verified in host
memory by then) must be in the pool before attention reads them, but only layer by layer: layer 0's
KV before layer 0's attention, layer 1's before layer 1's. `LayerLoads` takes the verified bytes at
admission (`add`), copies them into the pool slot by slot (a slot is a layer; with layer groups a
page's slot holds one layer of a group, common/kv/layer_groups.py) on a copier of its own, and the
model's forward waits for a slot (`wait`, from `PagedKVCache.before_layer`) only just before the layer
that reads it. The copies of layer l + 1 run while layer l computes.

The copier, the same code on either device:
- a CUDA pool: a copy stream. `add` stages the blocks in pinned host memory (unless they are pinned
  already: the RAM tier's own memory, common/kv/tiers.py) and queues, per slot, the
  host-to-device copy and the `index_copy_` into the pool on that stream, each slot closed by an
  event; `wait` makes the compute stream wait for the slot's event (the host does not wait). The
  copy stream first waits for the compute stream: the pages it writes were read by earlier kernels.
- a CPU pool: a thread (torch's copies let go of the GIL), slot by slot, each slot's end signalled.
  On two shared cores its copies compete with the forward's own threads; `bench tiers` measures it.
- `inline`: the slot's copies run in `wait` itself, on the forward's thread (no overlap; a debugging
  and reference mode).

Every other reader or writer of the pool outside the forward's layers must see the copies done, so it
calls `settle` first (a no-op with nothing in flight): the engine after each step (a prefill's KV
sender then reads whole blocks; the next schedule frees, swaps and evicts), before a step's swaps,
`KVOffload` before it copies evicted blocks out. Loads are copied in the order they came, so a page
given back and taken again by another load in one schedule ends with the later one's bytes. The
forward itself writes
only after its slot's wait, so a page a short read left to be computed into gets the copy first and
the computed KV over it, as when the copies were synchronous. A failed copy (a CUDA error, a bug)
fails the wait or settle that finds it: the step fails, never runs on a half-written page.

Tensor parallelism keeps the synchronous path (each rank's heads go over its pipe before the step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from common.kv.kv_cache import PagedKVCache

log = logging.getLogger("splitserve.kv_tiers")

MODES = ("auto", "thread", "inline", "cuda", "off")


@dataclass
class _Load:
    """One `add`: the pool's pages `ids` and their bytes, block-major (n, 2, slots, block_size,
    kv_heads, row bytes) uint8 views (one per run of adjacent buffers), and how many slots are in."""

    ids: list[torch.Tensor]  # per run: the pages (long), on the pool's device
    data: list[torch.Tensor]  # per run: (n, 2, slots, bs, heads, row / width), host (or pinned)
    done: int = 0  # slots copied (thread/inline); on a GPU, slots queued
    events: list[Any] = field(default_factory=list)  # CUDA: one per slot
    waited: int = 0  # CUDA: slots the compute stream already waits for


def runs(bufs: Sequence[memoryview], shape: tuple[int, ...]) -> list[tuple[int, torch.Tensor]]:
    """The buffers (each one block's bytes, `shape`) as few tensors as they allow without a copy:
    (first index, (n, *shape) uint8 view) per run of buffers adjacent in one object's memory (a tier's
    read hands back slices of a chunk's record, in order). The views keep those objects alive."""
    out: list[tuple[int, torch.Tensor]] = []
    i = 0
    while i < len(bufs):
        obj = bufs[i].obj
        whole = torch.frombuffer(obj, dtype=torch.uint8)
        base = whole.data_ptr()
        start = end = torch.frombuffer(bufs[i], dtype=torch.uint8).data_ptr() - base
        j = i
        while j < len(bufs) and bufs[j].obj is obj:
            at = torch.frombuffer(bufs[j], dtype=torch.uint8).data_ptr() - base
            if at != end:
                break
            end += bufs[j].nbytes
            j += 1
        out.append((i, whole[start:end].view(-1, *shape)))
        i = j
    return out


class LayerLoads:
    """Loads in flight into one PagedKVCache (module doc). One engine thread adds, waits and settles;
    the copier thread (CPU) only copies and signals."""

    def __init__(self, cache: PagedKVCache, mode: str = "auto") -> None:
        if mode not in MODES or mode == "off":
            raise ValueError(f"layer-wise KV loads: mode {mode!r}, one of {MODES[:-1]}")
        is_cuda = cache.k.is_cuda
        if mode == "auto":
            mode = "cuda" if is_cuda else "thread"
        if (mode == "cuda") != is_cuda:
            raise ValueError(f"layer-wise KV loads: mode {mode!r} for a pool on {cache.k.device}")
        self.cache, self.mode = cache, mode
        self.slots = cache.spec.shape[0]
        # the pool and the loads' bytes seen as the widest integer a row of values divides into: a copy
        # of uint8 elements runs ~5x slower on the CPU than one of int64 (the same bytes)
        row = cache.spec.head_dim * cache.k.element_size()
        self._wide = next(
            t for t in (torch.int64, torch.int32, torch.int16, torch.uint8) if row % t.itemsize == 0
        )
        self._k = cache.k.view(torch.uint8).view(self._wide)  # (slots, pages, bs, heads, row / width)
        self._v = cache.v.view(torch.uint8).view(self._wide)
        self._loads: list[_Load] = []
        self._cv = threading.Condition()
        self._queue: list[_Load] = []
        self._error: BaseException | None = None
        self._closed = False
        self.copy_s = 0.0  # seconds the copier spent copying (thread, inline); read for the tiers' cost
        self.wait_s = 0.0  # seconds the pool's readers waited for copies: what the overlap left exposed
        self.loaded_blocks = 0
        self.staged_bytes = 0  # CUDA: bytes copied into pinned memory first (0 from the RAM tier)
        self._stream: Any = None
        self._thread: threading.Thread | None = None
        if mode == "cuda":
            self._stream = torch.cuda.Stream(cache.k.device)
        elif mode == "thread":
            self._thread = threading.Thread(target=self._copier, name="kv-layer-loads", daemon=True)
            self._thread.start()

    @property
    def pending(self) -> bool:
        return bool(self._loads)

    # --- the engine thread's -------------------------------------------------------------------------
    def add(self, block_ids: Sequence[int], bufs: Sequence[memoryview]) -> None:
        """Copy the blocks' bytes (verified; one buffer a block, `gather_blocks`' layout for this cache)
        into pages `block_ids`, slot by slot from now on, after the loads already in flight (a page
        given back and taken again in one schedule gets the later load's bytes)."""
        if not bufs:
            return
        c, s = self.cache, self.cache.spec
        shape = (2, self.slots, s.block_size, s.num_kv_heads, s.head_dim * c.k.element_size())
        parts = runs(bufs, shape)
        dev = c.k.device
        ids = [torch.tensor(list(block_ids[i : i + len(d)]), dtype=torch.long) for i, d in parts]
        load = _Load(ids, [d.view(self._wide) for _, d in parts])
        self.loaded_blocks += len(bufs)
        if self.mode == "cuda":
            self._queue_cuda(load, dev)
        self._loads.append(load)
        if self.mode == "thread":
            with self._cv:
                self._queue.append(load)
                self._cv.notify_all()

    def wait(self, slot: int) -> None:
        """Slot `slot` of every load in flight is in the pool (CUDA: the compute stream waits for it)."""
        if not self._loads:
            return
        t0 = time.perf_counter()
        if self.mode == "inline":
            for load in self._loads:
                while load.done <= slot:
                    self._copy_slot(load, load.done)
                    load.done += 1
            self.copy_s += time.perf_counter() - t0
        elif self.mode == "thread":
            self._wait_thread(slot + 1)
        else:
            cur = torch.cuda.current_stream(self.cache.k.device)
            for load in self._loads:
                while load.waited <= slot:
                    cur.wait_event(load.events[load.waited])
                    load.waited += 1
        self.wait_s += time.perf_counter() - t0

    def settle(self) -> None:
        """Every load in flight is in the pool (the host waits); they are forgotten."""
        if not self._loads:
            return
        try:
            if self.mode == "cuda":
                t0 = time.perf_counter()
                cur = torch.cuda.current_stream(self.cache.k.device)
                for load in self._loads:
                    load.events[-1].synchronize()
                    cur.wait_event(load.events[-1])  # later kernels after the copies, too
                self.wait_s += time.perf_counter() - t0
            else:
                self.wait(self.slots - 1)
        finally:
            self._loads = []

    def close(self) -> None:
        """Stop the copier (what is in flight is settled first)."""
        try:
            self.settle()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            if self._thread is not None:
                self._thread.join(timeout=5)

    # --- copies -------------------------------------------------------------------------------------
    def _copy_slot(self, load: _Load, slot: int) -> None:
        """Slot `slot` of the load's pages, K and V, from its host bytes (CPU pool)."""
        k, v = self._k[slot], self._v[slot]  # (pages, bs, heads, row / width)
        for ids, data in zip(load.ids, load.data, strict=True):
            k.index_copy_(0, ids, data[:, 0, slot])
            v.index_copy_(0, ids, data[:, 1, slot])

    @torch.inference_mode()  # the pool may be an inference tensor (made under inference mode)
    def _copier(self) -> None:
        """The CPU copier thread: each load slot by slot, in the order they came."""
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                load = self._queue[0]
            try:
                for slot in range(self.slots):
                    t0 = time.perf_counter()
                    self._copy_slot(load, slot)
                    self.copy_s += time.perf_counter() - t0
                    with self._cv:
                        load.done = slot + 1
                        self._cv.notify_all()
            except BaseException as e:  # failed: every wait and settle from now on raises it
                log.exception("layer-wise KV load failed")
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                return
            with self._cv:
                self._queue.pop(0)

    def _wait_thread(self, slots: int) -> None:
        with self._cv:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"a layer-wise KV load failed: {self._error!r}") from self._error
                if all(ld.done >= slots for ld in self._loads):
                    break
                self._cv.wait(1.0)

    def _queue_cuda(self, load: _Load, dev: torch.device) -> None:
        """Queue the load's copies, slot by slot, on the copy stream: from where its bytes are when
        they are pinned (the RAM tier's slots), else staged in pinned memory first (a disk read)."""
        for i, d in enumerate(load.data):
            if not d.is_pinned():
                load.data[i] = d.pin_memory()
                self.staged_bytes += d.numel() * d.element_size()
        load.ids = [i.to(dev) for i in load.ids]
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        k8, v8 = self._k, self._v
        with torch.cuda.stream(stream):
            on_dev = [d.to(dev, non_blocking=True) for d in load.data]
            for slot in range(self.slots):
                for ids, data in zip(load.ids, on_dev, strict=True):
                    k8[slot].index_copy_(0, ids, data[:, 0, slot])
                    v8[slot].index_copy_(0, ids, data[:, 1, slot])
                ev = torch.cuda.Event()
                ev.record(stream)
                load.events.append(ev)
            load.done = self.slots
        load.data = load.data + on_dev  # kept alive until settled: the copies read them
