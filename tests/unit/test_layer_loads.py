"""Tier reads put into the pool layer by layer (common/kv/layer_loads.py), on a small real pool.

In some tests the copier copies a slot only once a reader asked for it (`slow_copier`, a condition):
a wait that returned before its slot was copied would find the slot still holding what the page held
before, which the tests fill with a marker no load writes."""

from __future__ import annotations

import threading

import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.kv.layer_loads import LayerLoads, runs
from common.kv.offload import gather_blocks
from tests.support.tiers import slow_copier

LAYERS, BLOCKS, BS, HEADS, HD = 4, 12, 4, 2, 8
MARK = -7.0  # what every page holds before a load: no load's bytes


def cache() -> PagedKVCache:
    c = PagedKVCache(KVCacheSpec(LAYERS, BLOCKS, BS, HEADS, HD, torch.float32))
    c.k.fill_(MARK)
    c.v.fill_(MARK)
    return c


def source(n: int, seed: int) -> tuple[PagedKVCache, bytearray]:
    """n blocks' bytes as a tier record holds them (one buffer, block-major), with random values."""
    src = PagedKVCache(KVCacheSpec(LAYERS, n, BS, HEADS, HD, torch.float32))
    g = torch.Generator().manual_seed(seed)
    src.k.copy_(torch.randn(src.k.shape, generator=g))
    src.v.copy_(torch.randn(src.v.shape, generator=g))
    return src, bytearray(gather_blocks(src, range(n)).numpy().tobytes())


def blocks_of(record: bytearray, n: int) -> list[memoryview]:
    size = len(record) // n
    mv = memoryview(record)
    return [mv[i * size : (i + 1) * size] for i in range(n)]


def assert_slot(c: PagedKVCache, src: PagedKVCache, ids: list[int], slot: int) -> None:
    for i, bid in enumerate(ids):
        assert torch.equal(c.k[slot, bid], src.k[slot, i]) and torch.equal(c.v[slot, bid], src.v[slot, i])


def test_runs_are_views_of_adjacent_buffers() -> None:
    rec, other = bytearray(range(48)), bytearray(range(100, 116))
    mv = memoryview(rec)
    bufs = [mv[0:16], mv[16:32], mv[32:48], memoryview(other), mv[16:32]]
    got = runs(bufs, (4, 4))
    assert [(i, tuple(t.shape)) for i, t in got] == [(0, (3, 4, 4)), (3, (1, 4, 4)), (4, (1, 4, 4))]
    assert bytes(got[0][1].flatten().numpy()) == bytes(rec)
    got[0][1][1, 0, 0] = 255  # a view: no copy was made
    assert rec[16] == 255


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_each_wait_finds_its_slot_copied_and_settle_all(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    slow_copier(monkeypatch)
    c, (src, record) = cache(), source(5, 0)
    loads = LayerLoads(c, mode)
    c.loads = loads
    ids = [7, 2, 9, 3, 11]
    try:
        loads.add(ids, blocks_of(record, 5))
        assert loads.pending
        for layer in range(LAYERS):
            assert bool((c.k[layer, ids] == MARK).all()), "copied before a reader asked"
            c.before_layer(layer)
            assert_slot(c, src, ids, layer)
        c.settle_loads()
        assert not loads.pending
        for slot in range(LAYERS):
            assert_slot(c, src, ids, slot)
        others = [b for b in range(BLOCKS) if b not in ids]
        assert bool((c.k[:, others] == MARK).all()) and bool((c.v[:, others] == MARK).all())
        assert loads.loaded_blocks == 5
    finally:
        loads.close()


def test_the_copier_runs_while_the_caller_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread copier does not wait to be asked: slot 0 is copied while the caller does other work."""
    c, (src, record) = cache(), source(3, 1)
    loads = LayerLoads(c, "thread")
    done = threading.Event()
    copy = LayerLoads._copy_slot

    def noted(self: LayerLoads, load: object, slot: int) -> None:
        copy(self, load, slot)  # type: ignore[arg-type]
        if slot == LAYERS - 1:
            done.set()

    monkeypatch.setattr(LayerLoads, "_copy_slot", noted)
    try:
        loads.add([0, 1, 2], blocks_of(record, 3))
        assert done.wait(10), "the copier never copied without a wait"
        for slot in range(LAYERS):
            assert_slot(c, src, [0, 1, 2], slot)
        loads.settle()
    finally:
        loads.close()


def test_a_load_into_a_page_still_being_written_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page given back and taken again in one schedule: the second load's bytes win, whole."""
    slow_copier(monkeypatch)
    c, (a, rec_a), (b, rec_b) = cache(), source(3, 2), source(2, 3)
    loads = LayerLoads(c, "thread")
    try:
        loads.add([4, 5, 6], blocks_of(rec_a, 3))
        loads.add([6, 8], blocks_of(rec_b, 2))  # page 6 again
        loads.settle()
        for slot in range(LAYERS):
            assert_slot(c, a, [4, 5], slot)
            assert_slot(c, b, [6, 8], slot)
    finally:
        loads.close()


def test_a_failed_copy_fails_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: LayerLoads, load: object, slot: int) -> None:
        raise OSError("injected")

    monkeypatch.setattr(LayerLoads, "_copy_slot", broken)
    c, (_, record) = cache(), source(2, 4)
    loads = LayerLoads(c, "thread")
    loads.add([0, 1], blocks_of(record, 2))
    with pytest.raises(RuntimeError, match="layer-wise KV load failed"):
        loads.wait(0)
    with pytest.raises(RuntimeError):
        loads.close()


def test_swaps_and_copies_out_settle_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's bulk readers and writers outside the forward (swap out/in) see the loads done."""
    slow_copier(monkeypatch)
    c, (src, record) = cache(), source(2, 5)
    loads = LayerLoads(c, "thread")
    c.loads = loads
    try:
        loads.add([3, 10], blocks_of(record, 2))
        k, v = c.copy_out([3, 10])
        assert torch.equal(k, src.k) and torch.equal(v, src.v)
        assert not loads.pending
    finally:
        loads.close()


def test_bad_modes_are_refused() -> None:
    c = cache()
    with pytest.raises(ValueError, match="mode 'cuda'"):
        LayerLoads(c, "cuda")
    with pytest.raises(ValueError, match="one of"):
        LayerLoads(c, "sometimes")
