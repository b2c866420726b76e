"""What both sides of the nixl backend share: endpoints, agents, the block descriptor table, control frames.

NIXL itself (`nixl_cu12`) is imported here, lazily, so that `kv_transfer` imports without it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
import torch

from common.kv.kv_cache import PagedKVCache
from common.protocol import Message, ProtocolError, decode, frame

from .base import TransferError
from .layout import block_bytes

MAX_FRAME = 1 << 20  # control messages are small (agent metadata is a few KiB); anything larger is garbage
SCHEME = "nixl://"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """ "nixl://host:port" (the receiver's control listener; host may be "[v6addr]") -> (host, port)."""
    host, sep, port = endpoint.removeprefix(SCHEME).rpartition(":")
    if not endpoint.startswith(SCHEME) or not sep or not host or not port.isdigit():
        raise ValueError(f"not a nixl endpoint: {endpoint!r} (expected nixl://host:port)")
    return host.strip("[]"), int(port)


def make_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend, no progress thread (we poll), no metadata listener (we exchange
    metadata on our own control connection). Names are unique per process and start."""
    try:
        from nixl_cu12 import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise TransferError(f"the nixl backend needs the nixl-cu12 package: {e}") from e
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
    return block_rows(regions(kv), s.num_layers, s.num_blocks, block_bytes(kv))


async def read_msg(reader: asyncio.StreamReader) -> Any | None:
    """One framed control message; None at a clean end of stream. ValueError on garbage."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ProtocolError("connection closed inside a frame header") from e
        return None
    n = int.from_bytes(head, "big")
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    try:
        return decode(await reader.readexactly(n))
    except asyncio.IncompleteReadError as e:
        raise ProtocolError("connection closed inside a frame") from e


def write_msg(writer: asyncio.StreamWriter, msg: Message) -> None:
    """Queue one framed control message (whole frames never interleave: write() only appends)."""
    writer.write(frame(msg))
