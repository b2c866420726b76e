"""Paged KV tensors: the memory the block manager's integer ids point into.

Layout (one tensor for K, one for V):  (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
so one block of one layer is a contiguous (block_size * num_kv_heads * head_dim) run of elements.
That is what the KV transports move: a layer's blocks can be written as soon as that layer is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, device: str | torch.device = "cpu") -> None:
        self.spec = spec
        shape = (spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. slot = block_id * block_size + offset.  k, v: (T, n_kv, hd)."""
        n_kv, hd = self.spec.num_kv_heads, self.spec.head_dim
        self.k[layer].view(-1, n_kv, hd)[slot_mapping] = k
        self.v[layer].view(-1, n_kv, hd)[slot_mapping] = v

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens of one sequence's K and V, each (length, n_kv, hd)."""
        n_kv, hd = self.spec.num_kv_heads, self.spec.head_dim
        k = self.k[layer, block_table].view(-1, n_kv, hd)[:length]
        v = self.v[layer, block_table].view(-1, n_kv, hd)[:length]
        return k, v

    # --- swap (preemption by copying blocks to host memory) ---------------------------------------
    def copy_out(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy blocks (all layers) to host memory; returns (k, v) each (L, n, bs, n_kv, hd)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        return self.k[:, idx].to("cpu", copy=True), self.v[:, idx].to("cpu", copy=True)

    def copy_in(self, block_ids: list[int], saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Restore blocks saved by copy_out into (possibly different) block ids."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        k, v = saved
        self.k[:, idx] = k.to(self.k.device)
        self.v[:, idx] = v.to(self.v.device)
