"""Multi-head latent attention (DeepSeek-V2/V3, `ModelConfig.is_mla`), with the latent cached.

Per token, MLA compresses the hidden state into a latent: c (kv_lora_rank values, RMS-normed) and one
rotated key k_pe (qk_rope_head_dim) that every head shares. Head h's key is [W_UK[h] c, k_pe] and its
value W_UV[h] c (W_UK, W_UV: the two parts of kv_b_proj). Transformers decompresses K and V for every
head; here the weights are absorbed instead, so attention runs on the latent itself, as one shared KV
"head" (multi-query attention):

    q[h] . k[h] = (W_UK[h]^T q_nope[h]) . c + q_pe[h] . k_pe        (the query absorbs W_UK)
    sum_t p_t v_t[h] = W_UV[h] (sum_t p_t c_t)                        (W_UV applied after)

so the query is [W_UK^T q_nope, q_pe] (kv_lora_rank + qk_rope_head_dim per head), the one key the latent
[c, k_pe], the one value c, and the attention output per head (kv_lora_rank) goes through W_UV, then
o_proj. What the paged KV cache holds (and a split transfers) is that latent: kv_lora_rank +
qk_rope_head_dim values per token and layer, not 2 * heads * head_dim (DeepSeek-V3: 576 values where
decompressed K and V would be 128 * (192 + 128) = 40960). The cache's layout stays K and V of one head
each (common/kv/kv_cache.py), the latent's first half in K and its second in V, so the block manager,
swapping, offload tiers and every KV transport move it as they move any model's blocks.

RoPE: DeepSeek's checkpoints rotate adjacent pairs (x0, x1), (x2, x3), ... (`rope_interleave`); the
rotary dims are de-interleaved first (evens, then odds) and rotated as two halves, as transformers'
DeepseekV3 does: q_pe . k_pe is the same either way, and the cache holds k_pe in that order.

Tensor parallelism: a rank holds its query heads (their rows of q_b_proj / q_proj and kv_b_proj, their
columns of o_proj) and the whole latent projection, so every rank computes and caches the same latent
(partition.py's one KV head, replicated): the transfer sends one copy, from the prefill's first rank,
to every decode rank (common/parallel/plan.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from common.kv.kv_cache import PagedKVCache
from common.model.attention import AttentionMetadata, attend
from common.model.config import ModelConfig
from common.parallel.collective import TPRank

if TYPE_CHECKING:
    from common.model.llama import AttnFn

# transformers' DeepseekV2/V3 RMSNorm default: q_a_layernorm and kv_a_layernorm are built without the
# config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., d) pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...), the halves layout."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAttention(nn.Module):
    """One layer's latent attention (with TP: this rank's query heads). Weights in HF's layout:
    q_proj, or q_a_proj / q_a_norm / q_b_proj; kv_a_proj (HF kv_a_proj_with_mqa), kv_a_norm, kv_b_proj
    (heads * (nope + v), kv_lora_rank), o_proj (hidden, heads * v)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TPRank | None = None) -> None:
        super().__init__()
        from common.model.llama import RMSNorm

        self.cfg = cfg
        self.num_heads = len(tp.layout.q_heads) if tp else cfg.num_heads
        h, n = cfg.hidden_size, self.num_heads
        self.nope, self.rope, self.rank, self.v_dim = (
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        )  # fmt: skip
        qk = self.nope + self.rope

        def weight(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.q_proj: nn.Parameter | None = None
        self.q_a_proj: nn.Parameter | None = None
        self.q_a_norm: RMSNorm | None = None
        self.q_b_proj: nn.Parameter | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = weight(n * qk, h)
        else:
            self.q_a_proj = weight(cfg.q_lora_rank, h)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = weight(n * qk, cfg.q_lora_rank)
        self.kv_a_proj = weight(self.rank + self.rope, h)
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = weight(n * (self.nope + self.v_dim), self.rank)
        self.o_proj = weight(h, n * self.v_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attn_fn: AttnFn
    ) -> torch.Tensor:  # x (T, hidden), normed -> (T, hidden): this rank's heads' share of o_proj
        from common.model.llama import apply_rope, linear

        T, n = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = linear(x, self.q_proj)
        else:
            assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None
            q = linear(self.q_a_norm(linear(x, self.q_a_proj)), self.q_b_proj)
        q_nope, q_pe = q.view(T, n, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_pe = linear(x, self.kv_a_proj).split([self.rank, self.rope], dim=-1)
        c = self.kv_a_norm(c)  # (T, rank)
        if self.cfg.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe = apply_rope(q_pe, cos, sin)  # (T, n, rope)
        k_pe = apply_rope(k_pe.unsqueeze(1), cos, sin).squeeze(1)  # (T, rope)
        latent = torch.cat((c, k_pe), dim=-1)  # (T, rank + rope): what the cache holds
        w = self.kv_b_proj.view(n, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # (n, nope, rank), (n, v, rank)
        q_abs = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (T, n, rank)
        query = torch.cat((q_abs, q_pe), dim=-1)  # (T, n, rank + rope)
        key = latent.unsqueeze(1)  # (T, 1, rank + rope): the one shared head
        out = attn_fn(query, key, key[..., : self.rank], layer)  # (T, n, rank)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # (T, n, v)
        return linear(out.reshape(T, n * self.v_dim), self.o_proj)


def mla_paged_attention(
    q: torch.Tensor,  # (T, n_heads, rank + rope): the absorbed queries
    latent: torch.Tensor,  # (T, rank + rope): the new tokens' latents
    rank: int,  # kv_lora_rank: the value is the latent's first `rank` values
    layer: int,
    kv_cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (T, n_heads, rank)
    """Latent attention over the paged cache: the torch path, and on a GPU (a cache that is not fp8)
    the decode rows through the Triton kernel (common/kernels/mla_attention.py; prefill chunks stay
    on the torch path). The new latents are written (first half into K, second into V), then each
    sequence's query rows attend over its cached latents: the decode sequences in one padded call,
    each prefill chunk on its own (over an fp8 cache seeing its own latents as computed: the cache's
    `exact_prefill`), as `paged_attention` does. With one shared key head every (token,
    head) query is a row against the same keys: the heads are folded into the rows (one matrix
    product, no per-head copy of the keys, which SDPA's grouped-query path would make)."""
    T, n_heads, width = q.shape
    half = width // 2
    kv_cache.write(layer, meta.slot_mapping, latent[:, None, :half], latent[:, None, half:])
    out = q.new_empty(T, n_heads, rank)
    qsl = meta.query_start_loc
    batch = meta.decode_batch(kv_cache.spec.block_size)
    if batch is not None and kv_cache.k.is_cuda and not kv_cache.quantized:
        # on a GPU the decode rows go through the Triton kernel over the latent (common/kernels/
        # mla_attention.py), which reads the two halves where they lie: no gathered copy of the blocks
        from common.kernels.mla_attention import mla_decode_launch

        mla_decode_launch(
            q, kv_cache.k[layer], kv_cache.v[layer], out, batch.rows, batch.blocks, batch.lens, scale
        )
    elif batch is not None:
        kb, vb = kv_cache.read_blocks(layer, batch.blocks)  # (D, max_blocks, bs, 1, half) each
        d = batch.blocks.shape[0]
        lat = torch.cat((kb, vb), dim=-1).view(d, 1, -1, width)  # (D, 1, L, width)
        # (D, 1, n_heads, width) queries: the mask (D, 1, 1, L) is every head's
        od = attend(q[batch.rows].unsqueeze(1), lat, lat[..., :rank], batch.mask, scale)
        out[batch.rows] = od.squeeze(1)  # (D, n_heads, rank)
    for i in range(meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        if batch is not None and end - start == 1:
            continue  # computed above
        n_new, ctx = end - start, meta.context_lens[i]
        kc, vc = kv_cache.gather(layer, meta.block_tables[i], ctx)  # (ctx, 1, half) each
        if kv_cache.exact_prefill and n_new > 1:  # fp8: the chunk's own latents as computed
            kc[ctx - n_new :] = latent[start:end, None, :half]
            vc[ctx - n_new :] = latent[start:end, None, half:]
        lat = torch.cat((kc, vc), dim=-1).transpose(0, 1)  # (1, ctx, width)
        # rows (token, head): query j (absolute position ctx - n_new + j) sees keys 0 .. ctx - n_new + j
        qpos = torch.arange(ctx - n_new, ctx, device=q.device).repeat_interleave(n_heads).unsqueeze(1)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # (n_new * n_heads, ctx)
        qi = q[start:end].reshape(1, n_new * n_heads, width)
        oi = attend(qi, lat, lat[..., :rank], mask, scale)  # (1, n_new * n_heads, rank)
        out[start:end] = oi.view(n_new, n_heads, rank)
    return out
