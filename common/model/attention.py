"""Attention over the paged KV cache, one sequence at a time (selective batching).

Every other op of the step runs on the flattened (total_tokens, hidden) matrix; only attention needs
to know where one sequence ends and the next begins. It reads each sequence's own blocks, never a
padded rectangle. This torch version is the CPU reference; GPU kernels must match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.kv.kv_cache import PagedKVCache


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens sit in the flattened step, and where its KV lives.

    query_start_loc: len S+1; the new tokens of sequence i are rows [qsl[i], qsl[i+1]) of the step.
    context_lens:    len S; tokens of sequence i held in KV after this step (cached + new).
    block_tables:    per sequence, a (num_blocks_i,) long tensor of block ids.
    slot_mapping:    (T,) long; flat slot (block_id * block_size + offset) each new token's K/V goes to.
    """

    query_start_loc: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]
    slot_mapping: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def paged_attention(
    q: torch.Tensor,  # (T, n_heads, hd)
    k: torch.Tensor,  # (T, n_kv, hd) new tokens
    v: torch.Tensor,  # (T, n_kv, hd)
    layer: int,
    kv_cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (T, n_heads, hd)
    kv_cache.write(layer, meta.slot_mapping, k, v)
    n_heads, n_kv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    qsl = meta.query_start_loc
    for i in range(meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        n_new, ctx = end - start, meta.context_lens[i]
        kc, vc = kv_cache.gather(layer, meta.block_tables[i], ctx)  # (ctx, n_kv, hd)
        qi = q[start:end].transpose(0, 1)  # (n_heads, n_new, hd)
        ki, vi = kc.transpose(0, 1), vc.transpose(0, 1)  # (n_kv, ctx, hd)
        mask = None
        if n_new > 1:
            # query j (absolute position ctx - n_new + j) sees keys 0 .. ctx - n_new + j
            qpos = torch.arange(ctx - n_new, ctx, device=q.device).unsqueeze(1)
            kpos = torch.arange(ctx, device=q.device).unsqueeze(0)
            mask = kpos <= qpos  # (n_new, ctx)
        # enable_gqa: each group of n_heads // n_kv query heads shares one KV head, without copying KV
        oi = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=n_heads != n_kv
        )
        out[start:end] = oi.transpose(0, 1)
    return out
