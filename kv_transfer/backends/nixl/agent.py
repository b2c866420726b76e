"""What both sides of the nixl backend share: agents, the block descriptor tables and the per-write
slot descriptors of head slices.

NIXL itself (`nixl_cu12`) is imported here, lazily, so that `kv_transfer` imports without it.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import torch

from common.kv.kv_cache import PagedKVCache
from kv_transfer.base import TransferError
from kv_transfer.layout import block_bytes


class NixlMissing(TransferError, ValueError):
    """NIXL does not import here. Also a ValueError: a service started with kv_backend=nixl then stops with
    this one line (`splitserve decode|prefill|up` print the ValueErrors of building a service), not a
    traceback."""


def make_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend, no progress thread (we poll), no metadata listener (we exchange
    metadata on our own control connection). Names are unique per process and start."""
    try:
        from nixl_cu12 import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise NixlMissing(
            f"kv_backend=nixl but NIXL does not import here ({e}): install the nixl extra "
            "(pip install 'splitserve[nixl]', Linux x86_64 only), or use kv_backend=auto or tcp"
        ) from e
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
    agent = nixl_agent(f"splitserve-{role}-{uuid.uuid4().hex[:12]}", config)
    if "UCX" not in agent.backends:
        raise TransferError(f"NIXL has no UCX backend here (plugins: {agent.get_plugin_list()})")
    return agent


def mem_type(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def device_id(t: torch.Tensor) -> int:
    return 0 if t.device.type == "cpu" else int(t.device.index or 0)


def regions(kv: PagedKVCache) -> list[list[int]]:
    """[[address, nbytes, device_id]] of the K tensor, then the V tensor (what the receiver registers)."""
    return [[t.data_ptr(), t.numel() * t.element_size(), device_id(t)] for t in (kv.k, kv.v)]


def block_rows(kv_regions: list[list[int]], num_layers: int, num_blocks: int, nbytes: int) -> np.ndarray:
    """The (address, len, device_id) descriptor of every (K|V, layer, block), an (2*L*B, 3) uint64 array.

    Row (t * L + layer) * B + block is block `block` of layer `layer` of tensor t (0 = K, 1 = V): with the
    (layer, block, slot, head, dim) layout a block of one layer is one contiguous run of `nbytes` bytes.
    """
    per_tensor = np.arange(num_layers * num_blocks, dtype=np.uint64) * np.uint64(nbytes)
    rows = np.empty((2, num_layers * num_blocks, 3), dtype=np.uint64)
    for t, (addr, size, dev) in enumerate(kv_regions):
        if size != num_layers * num_blocks * nbytes:
            raise TransferError(f"region {t} is {size} bytes, not {num_layers} x {num_blocks} x {nbytes}")
        rows[t, :, 0] = np.uint64(addr) + per_tensor
        rows[t, :, 1] = nbytes
        rows[t, :, 2] = dev
    return rows.reshape(-1, 3)


def row_indices(num_layers: int, num_blocks: int, layer: int, block_ids: list[int]) -> np.ndarray:
    """Rows of block_rows() for one layer's K blocks, then its V blocks, in block_ids order."""
    ids = np.asarray(block_ids, dtype=np.int64)
    k = layer * num_blocks + ids
    return np.concatenate([k, k + num_layers * num_blocks]).astype(np.int32)


def local_rows(kv: PagedKVCache) -> np.ndarray:
    s = kv.spec
    return block_rows(regions(kv), s.shape[0], s.num_blocks, block_bytes(kv))  # s.shape[0]: layers a page


def slice_rows(
    kv_regions: list[list[int]],
    shape: tuple[int, int, int, int],
    head_bytes: int,
    layer: int,
    block_ids: list[int],
    start: int,
    count: int,
) -> np.ndarray:
    """The (address, len, device_id) descriptors of one head-sliced layer write on one side: heads
    start..start+count of every slot of `block_ids` of `layer`, K's blocks then V's, in block_ids order,
    each block's slots in order, an (2*n*bs, 3) uint64 array (n = len(block_ids)); `shape` is the
    tensors' (L, B, bs, heads), `head_bytes` one head's bytes (head_dim * element size).

    Row i of the sender's array and row i of the receiver's are the same heads of the same token: in the
    (layer, block, slot, head, dim) layout a slot's heads are one contiguous run, so a head slice of it is
    one run too (the slots of a block are not). Made per write, never for the whole cache.
    """
    num_layers, num_blocks, block_size, heads = shape
    slot = heads * head_bytes
    ids = np.asarray(block_ids, dtype=np.uint64)
    slots = (np.uint64(layer * num_blocks) + ids)[:, None] * np.uint64(block_size) + np.arange(
        block_size, dtype=np.uint64
    )
    offsets = slots.reshape(-1) * np.uint64(slot) + np.uint64(start * head_bytes)
    rows = np.empty((2, offsets.size, 3), dtype=np.uint64)
    for t, (addr, size, dev) in enumerate(kv_regions):
        if size != num_layers * num_blocks * block_size * slot:
            raise TransferError(f"region {t} is {size} bytes, not {shape} x {head_bytes}")
        rows[t, :, 0] = np.uint64(addr) + offsets
        rows[t, :, 1] = count * head_bytes
        rows[t, :, 2] = dev
    return rows.reshape(-1, 3)


def local_slice_rows(
    kv: PagedKVCache, layer: int, block_ids: list[int], start: int, count: int
) -> np.ndarray:
    s = kv.spec
    shape = (s.shape[0], s.num_blocks, s.block_size, s.num_kv_heads)  # s.shape[0]: layers a page
    head_bytes = s.head_dim * kv.k.element_size()
    return slice_rows(regions(kv), shape, head_bytes, kv.slot_of[layer], block_ids, start, count)
