"""The tcp wire layout: block runs, byte views in wire order, head slices packed and scattered, header
validation, the nixl backend's per-write slot descriptors of head slices (no network)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.protocol import PROTOCOL_VERSION, ProtocolError, decode
from kv_transfer.backends.nixl.agent import local_slice_rows, regions, slice_rows  # imports no NIXL
from kv_transfer.base import TransferError
from kv_transfer.control.messages import KVLayerHeader
from kv_transfer.layout import (
    block_bytes,
    byte_view,
    check_layer_header,
    layer_views,
    pack_heads,
    runs,
    slice_bytes,
    unpack_heads,
)

SPEC = KVCacheSpec(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=4)


def _header(
    block_ids: list[int], nbytes: int | None = None, layer: int = 1, heads: tuple[int, int] = (0, 0)
) -> KVLayerHeader:
    kv = PagedKVCache(SPEC)
    per_block = slice_bytes(kv, heads[1]) if heads[1] > 0 else block_bytes(kv)
    n = len(block_ids) * 2 * per_block if nbytes is None else nbytes
    return KVLayerHeader("r", 1, layer, block_ids, n, head_start=heads[0], head_count=heads[1])


def _numbered(spec: KVCacheSpec) -> PagedKVCache:
    kv = PagedKVCache(spec)
    kv.k.copy_(torch.arange(kv.k.numel(), dtype=torch.float32).view_as(kv.k))
    kv.v.copy_(-kv.k - 1)
    return kv


def test_runs_group_consecutive_ascending_ids_in_order() -> None:
    assert runs([4, 5, 6, 2, 9, 10]) == [(4, 3), (2, 1), (9, 2)]
    assert runs([3, 2, 1]) == [(3, 1), (2, 1), (1, 1)]
    assert runs([]) == []


def test_layer_views_are_k_runs_then_v_runs_sharing_memory() -> None:
    kv = PagedKVCache(SPEC)
    kv.k.copy_(torch.arange(kv.k.numel(), dtype=torch.float32).view_as(kv.k))
    kv.v.copy_(-kv.k)
    ids = [5, 6, 1]
    views = layer_views(kv, 1, ids)
    assert [len(v) for v in views] == [2 * block_bytes(kv), block_bytes(kv)] * 2
    got = torch.frombuffer(bytearray(b"".join(bytes(v) for v in views)), dtype=torch.float32)
    want = torch.cat([kv.k[1, ids].flatten(), kv.v[1, ids].flatten()])
    assert torch.equal(got, want)
    views[2][:4] = bytes(4)  # writes through to the tensor: no copy in between
    assert kv.v[1, 5].flatten()[0] == 0


def test_byte_view_handles_bfloat16() -> None:
    t = torch.ones(3, dtype=torch.bfloat16)
    assert bytes(byte_view(t)) == t.view(torch.uint8).numpy().tobytes()


def test_check_layer_header() -> None:
    kv = PagedKVCache(SPEC)
    assert check_layer_header(_header([0, 7]), kv) is None
    assert "nbytes" in (check_layer_header(_header([0, 7], nbytes=10), kv) or "")
    assert "out of range" in (check_layer_header(_header([8]), kv) or "")
    assert "out of range" in (check_layer_header(_header([-1]), kv) or "")
    assert "layer" in (check_layer_header(_header([0], layer=2), kv) or "")
    assert "duplicate" in (check_layer_header(_header([3, 3]), kv) or "")
    # a mistyped header never reaches the check: it does not decode
    bad = msgspec.msgpack.encode({"kind": "kv_layer", "request_id": "r", "fence": 1, "layer": 0,
                                  "block_ids": "xx", "nbytes": 0,
                                  "protocol_version": PROTOCOL_VERSION})  # fmt: skip
    with pytest.raises(ProtocolError, match="block_ids"):
        decode(bad, KVLayerHeader)


def test_check_layer_header_of_a_head_slice() -> None:
    kv = PagedKVCache(SPEC)  # a shard of 2 heads
    assert check_layer_header(_header([0, 7], heads=(1, 1)), kv) is None
    assert check_layer_header(_header([0, 7], heads=(0, 2)), kv) is None  # the whole shard, as a slice
    assert slice_bytes(kv, 1) * 2 == block_bytes(kv)
    for heads in [(1, 2), (2, 1), (-1, 1), (0, -1), (1, 0)]:  # past the shard, negative, start without count
        assert "heads" in (check_layer_header(_header([0], heads=heads), kv) or ""), heads
    whole = 2 * block_bytes(kv)  # the size of whole blocks is wrong for a 1-head slice
    assert "nbytes" in (check_layer_header(_header([0], nbytes=whole, heads=(1, 1)), kv) or "")


def test_pack_then_unpack_moves_exactly_the_slice() -> None:
    src = _numbered(dataclasses.replace(SPEC, num_kv_heads=3))
    dst = PagedKVCache(dataclasses.replace(SPEC, num_kv_heads=4))
    packed = pack_heads(src, 1, [5, 2, 3], 1, 2)  # src heads 1-2 ...
    assert packed.shape == (2, 3, SPEC.block_size, 2, SPEC.head_dim) and packed.is_contiguous()
    assert packed.numel() * packed.element_size() == 3 * 2 * slice_bytes(src, 2)
    unpack_heads(dst, 1, [0, 7, 4], 2, packed)  # ... to dst heads 2-3
    want_k, want_v = torch.zeros_like(dst.k), torch.zeros_like(dst.v)
    want_k[1, [0, 7, 4], :, 2:4] = src.k[1, [5, 2, 3], :, 1:3]
    want_v[1, [0, 7, 4], :, 2:4] = src.v[1, [5, 2, 3], :, 1:3]
    assert torch.equal(dst.k, want_k) and torch.equal(dst.v, want_v)


def test_pack_heads_into_a_staging_buffer_of_bytes() -> None:
    kv = _numbered(SPEC)
    buf = torch.zeros(2 * 2 * slice_bytes(kv, 1) + 8, dtype=torch.uint8)  # larger than needed
    out = buf[: 2 * 2 * slice_bytes(kv, 1)].view(torch.float32).view(2, 2, SPEC.block_size, 1, SPEC.head_dim)
    pack_heads(kv, 0, [6, 1], 1, 1, out=out)
    assert torch.equal(out, torch.stack([kv.k[0, [6, 1], :, 1:2], kv.v[0, [6, 1], :, 1:2]]))
    assert not buf[-8:].any()


def test_nixl_slice_rows_address_each_slots_slice_of_one_write_in_wire_order() -> None:
    spec = dataclasses.replace(SPEC, num_kv_heads=3)
    kv = _numbered(spec)
    rows = local_slice_rows(kv, 1, [6, 2], 1, 2)  # heads 1-2 of layer 1's blocks 6 and 2
    assert rows.shape == (2 * 2 * spec.block_size, 3) and rows.dtype == "uint64"  # this write's slots only
    want = [
        (t[1, b, slot, 1].data_ptr(), 2 * spec.head_dim * 4)
        for t in (kv.k, kv.v)
        for b in (6, 2)
        for slot in range(spec.block_size)
    ]
    assert [(int(a), int(n)) for a, n, _ in rows] == want
    assert not rows[:, 2].any()  # device 0: host memory


def test_nixl_slice_rows_of_the_receiver_follow_its_shape() -> None:
    """The receiver's side: its regions and block count, its heads per slot, the slice at dst_start."""
    theirs = PagedKVCache(dataclasses.replace(SPEC, num_blocks=5, num_kv_heads=4))
    s = theirs.spec
    shape = (s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads)
    rows = slice_rows(regions(theirs), shape, s.head_dim * 4, 0, [4, 0, 3], 3, 1)
    want = [
        (t[0, b, slot, 3].data_ptr(), s.head_dim * 4)
        for t in (theirs.k, theirs.v)
        for b in (4, 0, 3)
        for slot in range(s.block_size)
    ]
    assert [(int(a), int(n)) for a, n, _ in rows] == want
    assert slice_rows(regions(theirs), shape, s.head_dim * 4, 1, [], 0, 1).shape == (0, 3)
    with pytest.raises(TransferError, match="region 0"):  # regions that are not that shape
        slice_rows(regions(theirs), (s.num_layers, 6, s.block_size, 4), s.head_dim * 4, 0, [0], 0, 1)
