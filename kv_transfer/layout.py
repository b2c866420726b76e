"""Where a layer's block bytes live in the KV tensors, and in what order they cross the wire.

Wire order of one layer's payload for blocks [b0, b1, ..., bn-1] (the *destination* list's order):

    K[layer, b0] K[layer, b1] ... K[layer, bn-1]  V[layer, b0] ... V[layer, bn-1]

each entry being one block's (block_size, num_kv_heads, head_dim) elements in the cache dtype, i.e.
`block_bytes` raw bytes. The sender reads the same positions from its own *source* list, so payload slot i
carries src[i] → dst[i]. Runs of consecutive ascending ids are one contiguous span of the tensor (the
layout is (layer, block, slot, kv_head, head_dim)), so both sides move a run as one buffer, without a copy.
"""

from __future__ import annotations

import torch

from common.kv.kv_cache import PagedKVCache
from kv_transfer.control.messages import KVLayerHeader


def block_bytes(kv: PagedKVCache) -> int:
    """Bytes of one block of one layer of K (V is the same size)."""
    s = kv.spec
    return s.block_size * s.num_kv_heads * s.head_dim * kv.k.element_size()


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """Split ids, in order, into (first_id, count) runs of consecutive ascending ids.

    runs([4, 5, 6, 2, 9, 10]) == [(4, 3), (2, 1), (9, 2)]
    """
    out: list[tuple[int, int]] = []
    for b in ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor, sharing its memory (any dtype, bf16 too)."""
    assert t.is_contiguous() and t.device.type == "cpu", "byte views need contiguous host memory"
    # .view(uint8) instead of .numpy() directly: numpy has no bfloat16.
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def layer_views(kv: PagedKVCache, layer: int, ids: list[int]) -> list[memoryview]:
    """Byte views of layer `layer` of blocks `ids` in wire order: K runs, then V runs (host caches only)."""
    spans = runs(ids)
    return [byte_view(t[layer, b : b + n]) for t in (kv.k, kv.v) for b, n in spans]


def check_layer_header(h: KVLayerHeader, kv: PagedKVCache) -> str | None:
    """Why this header must not be acted on (None when it is fine). Checked before any byte is written."""
    s = kv.spec  # the header's types were checked when it was decoded; its values are checked here
    if not 0 <= h.layer < s.num_layers:
        return f"layer {h.layer} out of range [0, {s.num_layers})"
    bad = [b for b in h.block_ids if not 0 <= b < s.num_blocks]
    if bad:
        return f"block ids {bad[:8]} out of range [0, {s.num_blocks})"
    if len(set(h.block_ids)) != len(h.block_ids):
        return "duplicate block ids"
    want = len(h.block_ids) * 2 * block_bytes(kv)
    if h.nbytes != want:
        return f"nbytes {h.nbytes} != {len(h.block_ids)} blocks * 2 * {block_bytes(kv)} = {want}"
    return None
