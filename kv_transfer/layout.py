"""Where a layer's block bytes live in the KV tensors, and in what order they cross the wire.

Wire order of one layer's payload for blocks [b0, b1, ..., bn-1] (the *destination* list's order):

    K[layer, b0] K[layer, b1] ... K[layer, bn-1]  V[layer, b0] ... V[layer, bn-1]

each entry being one block's (block_size, num_kv_heads, head_dim) elements in the cache dtype, i.e.
`block_bytes` raw bytes. The sender reads the same positions from its own *source* list, so payload slot i
carries src[i] → dst[i]. Runs of consecutive ascending ids are one contiguous span of the tensor (the
layout is (layer, block, slot, kv_head, head_dim)), so both sides move a run as one buffer, without a copy.

A *head slice* (heterogeneous tensor parallelism: the two shards hold different KV heads;
common/parallel/plan.py) has the same order, each entry being only `count` heads of the block,
packed (block_size, count, head_dim): `slice_bytes` raw bytes. Those heads are strided in the cache,
so the sender gathers them into one buffer (`pack_heads`) and the receiver scatters that buffer into
its own heads (`unpack_heads`): one copy each. A slice that is a side's whole shard is that side's
plain block layout (the packed bytes are the blocks).
"""

from __future__ import annotations

import torch

from common.kv.kv_cache import PagedKVCache
from kv_transfer.control.messages import KVLayerHeader


def block_bytes(kv: PagedKVCache) -> int:
    """Bytes of one block of one layer of K (V is the same size)."""
    s = kv.spec
    return s.block_size * s.num_kv_heads * s.head_dim * kv.k.element_size()


def slice_bytes(kv: PagedKVCache, count: int) -> int:
    """Bytes of `count` KV heads of one block of one layer of K (V is the same size)."""
    s = kv.spec
    return s.block_size * count * s.head_dim * kv.k.element_size()


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
    slot = kv.slot_of[layer]  # its slot in the pages (common/kv/layer_groups.py); `layer` with one group
    return [byte_view(t[slot, b : b + n]) for t in (kv.k, kv.v) for b, n in spans]


def pack_heads(
    kv: PagedKVCache, layer: int, ids: list[int], start: int, count: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Heads start..start+count of layer `layer` of blocks `ids`, gathered in wire order into `out` (a
    contiguous (2, n, block_size, count, head_dim) tensor of the cache dtype, on any device; a new one on
    the cache's device when None). Returns `out`."""
    k = kv.k
    if out is None:
        out = torch.empty((2, len(ids), k.shape[2], count, k.shape[4]), dtype=k.dtype, device=k.device)
    idx = torch.tensor(ids, dtype=torch.long, device=k.device)
    for i, t in enumerate((kv.k, kv.v)):
        heads = t[kv.slot_of[layer], :, :, start : start + count]  # (num_blocks, bs, count, hd), strided
        if out.device == t.device:
            torch.index_select(heads, 0, idx, out=out[i])
        else:  # a device cache packed on the host: gather there, then one copy over
            out[i].copy_(heads.index_select(0, idx))
    return out


def unpack_heads(kv: PagedKVCache, layer: int, ids: list[int], start: int, staged: torch.Tensor) -> None:
    """Scatter `staged`, (2, n, block_size, count, head_dim) in wire order (any device), into heads
    start..start+count of layer `layer` of blocks `ids`; every other head stays as it is."""
    count = staged.shape[3]
    idx = torch.tensor(ids, dtype=torch.long, device=kv.k.device)
    for i, t in enumerate((kv.k, kv.v)):
        t[kv.slot_of[layer], :, :, start : start + count].index_copy_(0, idx, staged[i].to(t.device))


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
    if (h.head_start or h.head_count) and not (
        h.head_count > 0 and h.head_start >= 0 and h.head_start + h.head_count <= s.num_kv_heads
    ):
        stop = h.head_start + h.head_count
        return f"heads [{h.head_start}, {stop}) are not a range within this shard's {s.num_kv_heads} heads"
    per_block = slice_bytes(kv, h.head_count) if h.head_count else block_bytes(kv)
    want = len(h.block_ids) * 2 * per_block
    if h.nbytes != want:
        return f"nbytes {h.nbytes} != {len(h.block_ids)} blocks * 2 * {per_block} = {want}"
    return None
