"""The tcp wire layout: block runs, byte views in wire order, header validation (no network)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.protocol import PROTOCOL_VERSION, ProtocolError, decode
from kv_transfer.control.messages import KVLayerHeader
from kv_transfer.layout import block_bytes, byte_view, check_layer_header, layer_views, runs

SPEC = KVCacheSpec(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=4)


def _header(block_ids: list[int], nbytes: int | None = None, layer: int = 1) -> KVLayerHeader:
    kv = PagedKVCache(SPEC)
    n = len(block_ids) * 2 * block_bytes(kv) if nbytes is None else nbytes
    return KVLayerHeader("r", 1, layer, block_ids, n)


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
