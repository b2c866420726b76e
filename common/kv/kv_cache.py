"""Paged KV tensors: the memory the block manager's integer ids point into.

Layout (one tensor for K, one for V):  (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
so one block of one layer is a contiguous (block_size * num_kv_heads * head_dim) run of elements.
That is what the KV transports move: a layer's blocks can be written as soon as that layer is computed.

The cache dtype may be narrower than the model's (`--kv-cache-dtype`): bf16/fp16 are plain casts.
fp8 (e4m3, e5m2) stores each head's K and V rotated by a fixed orthogonal matrix (`kv_rotation`, a
Hadamard transform over head_dim), less a per-(layer, KV head, channel) offset, divided by a scale of
the same shape, a power of two (exact to divide and multiply by): `(x R - off) / scale`, both
calibrated from the model by `common/kv/quant.py` (`KVScales`). The rotation
spreads K's few huge channels over all of them: fp8 rounds each value to a few mantissa bits, and a
score q . k dominated by a few channels carried their rounding almost whole; spread, the roundings
average out (on SmolLM2 the KL divergence to fp32 KV falls by ~40 % with e4m3, 12-35 % with e5m2,
measured on held-out and chat text; per-channel scales alone changed it by 3 %). Attention needs no
un-rotation of the cache: q . k = (q R) . (k R) and sum_t p_t v_t = (sum_t p_t v_t R) R, so it rotates
the query and its output instead (common/model/attention.py, both paths). Reads (`gather`,
`read_blocks`) hand back the model's dtype, scaled back, the offset added back and, unless
`rotated=True` (attention's reads), rotated back. A value past the format's range saturates at its
largest, and is counted (`PagedKVCache.clamped`).

The offset moves fp8's finest steps (its error is relative to the stored value) to where the keys
attention weighs most lie: the calibration's attention-weighted mean of each channel
(common/model/calibration.py). On SmolLM2 the first token, which draws 12-26 % of the attention in
layers 5, 15 and 29 (of 30; 2 % in layer 0), has a small key (norm ~5-9 against ~15-17 for the
others) far from the keys' channel means: a plain per-channel mean cut K's overall rounding error by
a quarter yet raised the error of the scores attention weighs (0.115 -> 0.142 with e5m2) and with it
the held-out logprob drift against bf16 KV; the attention-weighted mean cut that drift (mean
|delta logprob| per token) by 14 % with e5m2 (0.120 -> 0.103) and 11 % with e4m3 (0.055 -> 0.049).
Attention reads it for free: for K, q . (k' s + m) = q . (k' s) + q . m, one constant per query row;
for V, sum_t p_t (v'_t s + m) = sum_t p_t v'_t s + m (the p_t sum to 1), added to the output
(common/kernels/paged_attention.py).

An MLA model (deepseek) caches its latent instead of K and V (`KVCacheSpec.mla`, common/model/mla.py):
one head per token whose first half is stored in K and second in V, so every consumer of this layout
moves it unchanged. An fp8 cache stores each half as it stores a K or V head: rotated (a block Hadamard
over half the latent: DeepSeek's 576 = 512 + 64 is two halves of 288 = 256 + 32) and scaled per
channel, calibrated like any model's (common/model/calibration.py: the latent's halves taken as K and
V; their offsets are 0). The MLA attention reads the latent dequantized and rotated back (`gather`,
`read_blocks`), so it needs nothing else (the MLA Triton decode kernel takes non-fp8 caches only).

Sliding windows (`layer_windows`): the transfer sends a sliding layer only the blocks still inside its
window (`first_needed_block`), and the block manager releases the blocks that fell out of the window
(common/kv/block_manager.py, HOLEs). A model that mixes full and sliding layers (gemma2, gemma3), with
`paged_groups`, is laid out by layer group (common/kv/layer_groups.py): the tensors are
(layers per page, pages, block_size, n_kv, hd), layer l lives in slot `slot_of[l]` (`layer_k`,
`layer_v`) and is read through the block table of group `group_of[l]`; `num_blocks` counts pages.
With one group (every other model) a page is a block of every layer and slot_of[l] == l: the layout
above.

What a prefill chunk reads (`exact_prefill`, on by default; `--kv-exact-prefill`): with an fp8 cache a
prefill chunk's queries see the chunk's own keys and values as the model computed them; only keys from
earlier steps are read back from the cache. A decode step reads everything from the cache, its own new
token included. So a prompt that fits one chunk is computed as with a bf16 cache (its first token, and
the K/V its later layers store, come from unrounded attention), as TensorRT-LLM's context phase and
SGLang's ragged prefill compute it. What it costs: a prefix-cache hit reads the cached part rounded,
where a miss computed it exact, so with fp8 a hit and a miss may differ by fp8's rounding (off: every
read goes through the cache, and a hit computes exactly what a miss does). On SmolLM2 the first answer
token of the README question is a near tie (0.08 nats with fp32 KV): through the cache e5m2 tips it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from common.kv.layer_groups import LayerGroups, one_group, plan_layer_groups

if TYPE_CHECKING:
    from common.kv.layer_loads import LayerLoads


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32  # what the cache stores (see the module doc)
    # Layer groups: each layer's sliding window (None: full attention); () when no layer slides
    layer_windows: tuple[int | None, ...] = ()
    # MLA (deepseek; common/model/mla.py): (kv_lora_rank, qk_rope_head_dim) of the latent every layer
    # caches instead of K and V: one "head" per token, its first half in K and its second in V
    # (num_kv_heads 1, head_dim = half the latent); None for K/V caches
    mla: tuple[int, int] | None = None
    # Full and sliding layers mixed: a pool of pages of a few layers and a block table per layer group
    # (common/kv/layer_groups.py); `num_blocks` then counts pages. False: one table for every layer.
    paged_groups: bool = False

    def __post_init__(self) -> None:
        if self.mla is not None:
            r, rope = self.mla
            if (self.num_kv_heads, 2 * self.head_dim) != (1, r + rope) or self.layer_windows:
                raise ValueError(
                    f"an MLA latent of {r} + {rope} is cached as 1 head of {(r + rope) // 2} in K and in V, "
                    f"every layer full: not {self.num_kv_heads} heads of {self.head_dim}, windows "
                    f"{self.layer_windows}"
                )

    @cached_property
    def groups(self) -> LayerGroups:
        """The layer groups the cache is laid out by: one group of every layer unless `paged_groups`
        and the model mixes full and sliding layers (common/kv/layer_groups.py)."""
        if self.paged_groups and self.mla is None:
            return plan_layer_groups(self.layer_windows, self.num_layers)
        return one_group(self.layer_windows, self.num_layers)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The K (and the V) tensor's shape: (layers per page, pages, block_size, KV heads, head_dim);
        with one group, (num_layers, num_blocks, ...): a page is a block of every layer."""
        k = self.groups.layers_per_page
        return (k, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def first_needed_block(self, layer: int, num_tokens: int) -> int:
        """The first block of a `num_tokens`-token prompt that decoding it still reads in `layer`: 0 for
        full attention; for a sliding window W, the block holding position num_tokens - W + 1 (a query
        at position p sees keys p - W + 1 .. p, and decoding starts at p = num_tokens)."""
        window = self.layer_windows[layer] if self.layer_windows else None
        if window is None:
            return 0
        return max(0, num_tokens - window + 1) // self.block_size

    def layer_groups(self) -> str:
        """The layer groups as the KV preflight compares them, e.g. "full:3,window512:15"; an MLA
        model's: "mla512+64:61" (the latent's kv_lora_rank + qk_rope_head_dim, every layer)."""
        if self.mla is not None:
            return f"mla{self.mla[0]}+{self.mla[1]}:{self.num_layers}"
        counts: dict[str, int] = {}
        for w in self.layer_windows or (None,) * self.num_layers:
            key = "full" if w is None else f"window{w}"
            counts[key] = counts.get(key, 0) + 1
        return ",".join(f"{k}:{n}" for k, n in counts.items())

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (of `num_blocks`) across its layers, K and V (MLA: the latent, once): every
        layer's, or with layer groups one page's."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        k = self.groups.layers_per_page
        return 2 * k * self.block_size * self.num_kv_heads * self.head_dim * elem


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ROTATION = "hadamard-v1"  # names kv_rotation in the scales' digest: a peer that rotates otherwise differs


def kv_rotation(head_dim: int) -> torch.Tensor:
    """What an fp8 cache rotates each head's K and V by before scaling: (head_dim, head_dim) fp32,
    orthogonal and symmetric (so it is its own inverse). Normalized Sylvester Hadamard matrices on the
    diagonal, one per power of two of head_dim's binary form, largest first (64: one block; 96: 64 and
    32). Entries are +-1/sqrt(n), the same on every machine: both services of a split store alike."""
    blocks, left = [], head_dim
    while left:
        n = 1 << (left.bit_length() - 1)
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        blocks.append(h / n**0.5)
        left -= n
    return torch.block_diag(*blocks)


@dataclass(frozen=True)
class KVScales:
    """fp8 KV: what each stored value was divided by, per (layer, KV head, channel of the rotated head:
    `kv_rotation`), for K and for V: each (num_layers, num_kv_heads, head_dim) fp32, powers of two, so
    that no channel's range is set by another's; and what was subtracted before (`k_off`, `v_off`, the
    same shape, fp32; None: zero). Dim 1 is the KV head, so a tensor-parallel rank's share is a slice of
    it (`heads`). (A (num_layers, num_kv_heads) pair, one scale per head, is accepted too: PagedKVCache
    repeats it over the channels.)"""

    k: torch.Tensor
    v: torch.Tensor
    k_off: torch.Tensor | None = None
    v_off: torch.Tensor | None = None

    def per_channel(self, head_dim: int) -> KVScales:
        """These scales as (num_layers, num_kv_heads, head_dim), contiguous fp32, and the offsets alike
        (zeros where absent)."""

        def full(s: torch.Tensor) -> torch.Tensor:
            s = s.float()
            if s.dim() == 2:
                s = s.unsqueeze(-1).expand(*s.shape, head_dim)
            if s.dim() != 3 or s.shape[-1] != head_dim:
                raise ValueError(f"fp8 KV scales {tuple(s.shape)}: want (layers, kv_heads, {head_dim})")
            return s.contiguous()

        k, v = full(self.k), full(self.v)

        def offset(o: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
            if o is None:
                return torch.zeros_like(like)
            if tuple(o.shape) != tuple(like.shape):
                raise ValueError(f"fp8 KV {name} {tuple(o.shape)}: want {tuple(like.shape)}, as the scales")
            return o.float().contiguous()

        return KVScales(k, v, offset(self.k_off, k, "k_off"), offset(self.v_off, v, "v_off"))

    def heads(self, start: int, stop: int) -> KVScales:
        """The scales and offsets of KV heads start .. stop - 1 (a tensor-parallel rank's), copies."""

        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, start:stop].clone()

        k, v = part(self.k), part(self.v)
        assert k is not None and v is not None
        return KVScales(k, v, part(self.k_off), part(self.v_off))

    @property
    def has_offsets(self) -> bool:
        """Whether any offset is not zero."""
        return any(o is not None and bool(o.any()) for o in (self.k_off, self.v_off))

    def digest(self) -> str:
        """A short hash of the rotation's name, the scales' shape and exponents and the offsets' exact
        values (fp32 bytes; not hashed when all zero, so absent and zero offsets agree): what two
        services compare before KV moves (the same weights calibrate the same exponents and offsets,
        bit for bit: common/kv/quant.py rounds the offsets onto a coarse power-of-two grid)."""
        h = hashlib.sha256(ROTATION.encode())
        for s in (self.k, self.v):
            h.update(repr(tuple(s.shape)).encode())
            h.update(s.detach().float().cpu().log2().round().to(torch.int8).numpy().tobytes())
        if self.has_offsets:
            for name, o in (("k_off", self.k_off), ("v_off", self.v_off)):
                h.update(name.encode())
                if o is not None:
                    h.update(repr(tuple(o.shape)).encode())
                    h.update(o.detach().float().cpu().contiguous().numpy().tobytes())
        return "sha256:" + h.hexdigest()[:16]


class PagedKVCache:
    def __init__(
        self,
        spec: KVCacheSpec,
        device: str | torch.device = "cpu",
        compute_dtype: torch.dtype | None = None,
        scales: KVScales | None = None,
        exact_prefill: bool = True,
    ) -> None:
        """compute_dtype: the model's (what reads return; default the cache dtype). scales: required
        for an fp8 cache. exact_prefill: an fp8 cache's prefill chunks attend to their own K/V as
        computed (see the module doc); meaningless for other caches, whose reads are exact casts."""
        self.spec = spec
        self.compute_dtype = compute_dtype or spec.dtype
        self.quantized = spec.dtype in FP8
        self.exact_prefill = exact_prefill and self.quantized
        if self.quantized and scales is None:
            raise ValueError(f"a {spec.dtype} KV cache needs scales (common/kv/quant.py calibrates them)")
        self.k = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        # layer l's K is self.k[slot_of[l]] (num_blocks, block_size, n_kv, hd), read through the block
        # table of group group_of[l]; with one group slot_of[l] == l and group_of[l] == 0
        self.slot_of, self.group_of = spec.groups.slot_of, spec.groups.group_of
        self.scales: KVScales | None = None
        if scales is not None:
            full = scales.per_channel(spec.head_dim)
            want = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
            for s in (full.k, full.v):
                if tuple(s.shape) != want:
                    raise ValueError(f"fp8 KV scales {tuple(s.shape)}: this cache needs {want}")
            assert full.k_off is not None and full.v_off is not None
            dev = self.k.device
            self.scales = KVScales(full.k.to(dev), full.v.to(dev), full.k_off.to(dev), full.v_off.to(dev))
        # whether any offset is not zero (the Triton kernel then applies them; read once, here)
        self.offsets = self.scales is not None and self.scales.has_offsets
        self._fp8_max = torch.finfo(spec.dtype).max if self.quantized else 0.0
        # fp8: what each head's K and V are rotated by before scaling (see the module doc)
        self.rotation = kv_rotation(spec.head_dim).to(self.k.device) if self.quantized else None
        # values written past the fp8 range (saturated), summed on the device: read by `clamped`
        self._clamped = torch.zeros((), dtype=torch.int64, device=self.k.device)
        # tier reads in flight, layer by layer (common/kv/layer_loads.py; set by KVOffload): layer l
        # waits for every slot a layer up to l lives in, so the last layer's callback sees every slot
        self.loads: LayerLoads | None = None
        self._wait_slot = [max(self.slot_of[: i + 1]) for i in range(len(self.slot_of))]

    @property
    def clamped(self) -> int:
        """How many K/V values written so far lay past the fp8 format's range and were saturated to its
        largest (0 for a cache that is not fp8). Reading it waits for the device."""
        return int(self._clamped.item())

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., head_dim) into the fp8 cache's rotated basis, or (the rotation is its own inverse) back
        out of it; in x's dtype, computed in fp32. x itself for a cache that does not rotate."""
        if self.rotation is None:
            return x
        return (x.float() @ self.rotation).to(x.dtype)

    def quantize(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        """x (T, n_kv, hd) of `layer`'s K (which="k") or V as stored: cast, or for fp8 rotated, less the
        channel's offset, divided by its scale, clamped to the format's range (the values clamped
        counted), cast."""
        if not self.quantized:
            return x.to(self.spec.dtype)
        return self.round_units(self.stored_units(x, layer, which))

    def stored_units(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        """fp8: x (T, n_kv, hd) as `quantize` stores it, before the clamp and the cast: rotated, less the
        offset, divided by the scale, fp32 (what the Triton kernel reads a prefill chunk's own K/V as)."""
        assert self.scales is not None and self.rotation is not None
        off = getattr(self.scales, which + "_off")[layer]  # (n_kv, hd), as the scales
        return (x.float() @ self.rotation - off) / getattr(self.scales, which)[layer]

    def round_units(self, y: torch.Tensor) -> torch.Tensor:
        """fp8: `stored_units` as stored: clamped to the format's range (the values clamped counted)
        and cast. y itself is left as it is (a caller may read it unrounded too)."""
        self._clamped += (y.abs() > self._fp8_max).sum()
        return y.clamp(-self._fp8_max, self._fp8_max).to(self.spec.dtype)

    def _load(self, x: torch.Tensor, layer: int, which: str, rotated: bool) -> torch.Tensor:
        """Stored values (..., n_kv, hd) back in the model's dtype (fp8: scaled, the offset added, in
        the rotated basis if `rotated`)."""
        if not self.quantized:
            return x.to(self.compute_dtype)
        assert self.scales is not None and self.rotation is not None
        y = x.float() * getattr(self.scales, which)[layer] + getattr(self.scales, which + "_off")[layer]
        return (y if rotated else y @ self.rotation).to(self.compute_dtype)

    def before_layer(self, layer: int) -> None:
        """Layer `layer` is about to be read or written (the model's forward, before its attention):
        the tier reads in flight have put in every slot a layer up to it lives in."""
        if self.loads is not None:
            self.loads.wait(self._wait_slot[layer])

    def settle_loads(self) -> None:
        """Every tier read in flight is in the pool (a reader or writer outside the forward's layers)."""
        if self.loads is not None:
            self.loads.settle()

    def layer_k(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K blocks: (num_blocks, block_size, n_kv, hd), contiguous, indexed by the block
        ids of its group's table."""
        return self.k[self.slot_of[layer]]

    def layer_v(self, layer: int) -> torch.Tensor:
        return self.v[self.slot_of[layer]]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. slot = block_id * block_size + offset.  k, v: (T, n_kv, hd)."""
        n_kv, hd = self.spec.num_kv_heads, self.spec.head_dim
        self.layer_k(layer).view(-1, n_kv, hd)[slot_mapping] = self.quantize(k, layer, "k")
        self.layer_v(layer).view(-1, n_kv, hd)[slot_mapping] = self.quantize(v, layer, "v")

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int, rotated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens of one sequence's K and V, each (length, n_kv, hd), model dtype.
        rotated: an fp8 cache's values left in its rotated basis (what attention reads)."""
        n_kv, hd = self.spec.num_kv_heads, self.spec.head_dim
        used = block_table[: -(-length // self.spec.block_size)]  # not the table's padding
        k, v = self.read_blocks(layer, used, rotated)
        return k.view(-1, n_kv, hd)[:length], v.view(-1, n_kv, hd)[:length]

    def read_blocks(
        self, layer: int, blocks: torch.Tensor, rotated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks `blocks` (any shape of block ids, int32 or int64) in the model's dtype,
        each (*blocks.shape, block_size, n_kv, hd); `rotated` as in `gather`. index_select copies whole
        blocks: on the CPU about 2x faster than advanced indexing (`k[layer][blocks]`) for a decode
        batch's blocks."""
        flat, shape = blocks.reshape(-1), (*blocks.shape, *self.k.shape[2:])
        k = self.layer_k(layer).index_select(0, flat).view(shape)
        v = self.layer_v(layer).index_select(0, flat).view(shape)
        return self._load(k, layer, "k", rotated), self._load(v, layer, "v", rotated)

    # --- swap (preemption by copying blocks to host memory) ---------------------------------------
    def copy_out(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy blocks (all layers; with layer groups, pages: all their layers) to host memory; returns
        (k, v) each (L, n, bs, n_kv, hd)."""
        self.settle_loads()
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        return self.k[:, idx].to("cpu", copy=True), self.v[:, idx].to("cpu", copy=True)

    def copy_in(self, block_ids: list[int], saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Restore blocks saved by copy_out into (possibly different) block ids."""
        self.settle_loads()
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        k, v = saved
        self.k[:, idx] = k.to(self.k.device)
        self.v[:, idx] = v.to(self.v.device)
