"""What fp8 KV scales are calibrated from (common/kv/quant.py turns it into the scales): the largest |K|
and |V| each (layer, KV head) of the model produces over one causal pass of a text, no cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model.llama import LlamaForCausalLM


@torch.no_grad()
def kv_amax(model: LlamaForCausalLM, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """max |K| and max |V| per (layer, KV head) over `token_ids` (one sequence): each (layers, kv_heads),
    fp32 on the CPU. `model` is the whole model, not a tensor-parallel shard."""
    cfg = model.config
    k_amax = torch.zeros(cfg.num_layers, cfg.num_kv_heads)
    v_amax = torch.zeros(cfg.num_layers, cfg.num_kv_heads)
    rep = cfg.num_heads // cfg.num_kv_heads

    def attn_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        k_amax[layer] = k.abs().amax(dim=(0, 2)).float().cpu()  # (n_kv,)
        v_amax[layer] = v.abs().amax(dim=(0, 2)).float().cpu()
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=model.scale)
        return out.transpose(0, 1)

    device = model.embed_tokens.weight.device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    cos, sin = model.rope_cos_sin(torch.arange(len(token_ids), device=device))
    x = model.embed(ids)
    for i, layer in enumerate(model.layers):
        x = layer(x, cos, sin, i, attn_fn)
    return k_amax, v_amax
