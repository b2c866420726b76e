"""What fp8 KV scales are calibrated from (common/kv/quant.py turns it into the scales): the largest |K|
and |V| each (layer, KV head) of the model produces over one causal pass of a text, no cache."""

from __future__ import annotations

import torch

from common.model.llama import LlamaForCausalLM


@torch.no_grad()
def kv_amax(model: LlamaForCausalLM, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """max |K| and max |V| per (layer, KV head) over `token_ids` (one sequence): each (layers, kv_heads),
    fp32 on the CPU. `model` is the whole model, not a tensor-parallel shard."""
    cfg = model.config
    k_amax = torch.zeros(cfg.num_layers, cfg.num_kv_heads)
    v_amax = torch.zeros(cfg.num_layers, cfg.num_kv_heads)
    device = model.embed_tokens.weight.device
    # the model's own attention (windows, soft-caps), without a cache
    dense = model.dense_attention([len(token_ids)], device)

    def attn_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        k_amax[layer] = k.abs().amax(dim=(0, 2)).float().cpu()  # (n_kv,)
        v_amax[layer] = v.abs().amax(dim=(0, 2)).float().cpu()
        return dense(q, k, v, layer)

    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    model.run_layers(ids, torch.arange(len(token_ids), device=device), attn_fn)
    return k_amax, v_amax
