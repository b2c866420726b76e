"""Paged KV tensors: the memory the block manager's integer ids point into.

Layout (one tensor for K, one for V):  (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
so one block of one layer is a contiguous (block_size * num_kv_heads * head_dim) run of elements.
That is what the KV transports move: a layer's blocks can be written as soon as that layer is computed.

The cache dtype may be narrower than the model's (`--kv-cache-dtype`): bf16/fp16 are plain casts;
fp8 (e4m3, e5m2) stores each value divided by a per-(layer, KV head) scale, a power of two (exact to
divide and multiply by) that `common/kv/quant.py` calibrates from the model. Reads (`gather`,
`read_blocks`) hand back the model's dtype, scaled back.

Every layer keeps every block of a sequence, sliding-window layers included (their attention masks the
keys out of the window: correct, but the memory and the split's transfer are a full prompt's).
TODO(issue 28): one spec per layer group (full, sliding window N), the block manager freeing the
blocks that fall out of a window, and the transfer sending only the blocks still inside it.
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
    dtype: torch.dtype = torch.float32  # what the cache stores (see the module doc)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class KVScales:
    """fp8 KV: what each stored value was divided by, per (layer, KV head), for K and for V."""

    k: torch.Tensor  # (num_layers, num_kv_heads) fp32, powers of two
    v: torch.Tensor

    def digest(self) -> str:
        """The scales' exponents, compact and exact: what two services compare before KV moves."""
        exps = torch.cat([self.k.flatten(), self.v.flatten()]).log2().round().to(torch.int64)
        return ",".join(str(int(e)) for e in exps)


class PagedKVCache:
    def __init__(
        self,
        spec: KVCacheSpec,
        device: str | torch.device = "cpu",
        compute_dtype: torch.dtype | None = None,
        scales: KVScales | None = None,
    ) -> None:
        """compute_dtype: the model's (what reads return; default the cache dtype). scales: required
        for an fp8 cache."""
        self.spec = spec
        self.compute_dtype = compute_dtype or spec.dtype
        self.quantized = spec.dtype in FP8
        if self.quantized and scales is None:
            raise ValueError(f"a {spec.dtype} KV cache needs scales (common/kv/quant.py calibrates them)")
        shape = (spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.scales = (
            KVScales(scales.k.to(self.k.device, torch.float32), scales.v.to(self.k.device, torch.float32))
            if scales is not None
            else None
        )
        self._fp8_max = torch.finfo(spec.dtype).max if self.quantized else 0.0

    def quantize(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        """x (T, n_kv, hd) of `layer`'s K (which="k") or V as stored: cast, or for fp8 divided by the
        head's scale, clamped to the format's range, cast."""
        if not self.quantized:
            return x.to(self.spec.dtype)
        assert self.scales is not None
        scale = getattr(self.scales, which)[layer][None, :, None]  # (1, n_kv, 1)
        return (x.float() / scale).clamp_(-self._fp8_max, self._fp8_max).to(self.spec.dtype)

    def _load(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        """Stored values (..., n_kv, hd) back in the model's dtype."""
        if not self.quantized:
            return x.to(self.compute_dtype)
        assert self.scales is not None
        scale = getattr(self.scales, which)[layer][:, None]  # (n_kv, 1)
        return (x.float() * scale).to(self.compute_dtype)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. slot = block_id * block_size + offset.  k, v: (T, n_kv, hd)."""
        n_kv, hd = self.spec.num_kv_heads, self.spec.head_dim
        self.k[layer].view(-1, n_kv, hd)[slot_mapping] = self.quantize(k, layer, "k")
        self.v[layer].view(-1, n_kv, hd)[slot_mapping] = self.quantize(v, layer, "v")

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens of one sequence's K and V, each (length, n_kv, hd), model dtype."""
        n_kv, hd = self.spec.num_kv_heads, self.spec.head_dim
        used = block_table[: -(-length // self.spec.block_size)]  # not the table's padding
        k, v = self.read_blocks(layer, used)
        return k.view(-1, n_kv, hd)[:length], v.view(-1, n_kv, hd)[:length]

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks `blocks` (any shape of block ids, int32 or int64) in the model's dtype,
        each (*blocks.shape, block_size, n_kv, hd). index_select copies whole blocks: on the CPU about
        2x faster than advanced indexing (`k[layer][blocks]`) for a decode batch's blocks."""
        flat, shape = blocks.reshape(-1), (*blocks.shape, *self.k.shape[2:])
        k = self.k[layer].index_select(0, flat).view(shape)
        v = self.v[layer].index_select(0, flat).view(shape)
        return self._load(k, layer, "k"), self._load(v, layer, "v")

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
