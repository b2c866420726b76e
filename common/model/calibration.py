"""What fp8 KV scales are calibrated from (common/kv/quant.py turns it into the scales): the largest |K|
and |V| each (layer, KV head, channel) of the model produces over one causal pass of the calibration
sequences, no cache, measured as an fp8 cache stores them: rotated (common/kv/kv_cache.py `kv_rotation`)."""

from __future__ import annotations

import contextlib

import jinja2
import torch

from common.kv.kv_cache import kv_rotation
from common.kv.quant import CALIBRATION_TEXT
from common.model.llama import LlamaForCausalLM
from common.text.tokenizer import Tokenizer


def calibration_ids(tokenizer: Tokenizer) -> list[list[int]]:
    """The sequences the scales are calibrated over: `CALIBRATION_TEXT` as a plain prompt, and the same
    text as a chat (a user turn and the assistant's reply) rendered through the model's chat template,
    so that the template's special tokens and default system prompt, which begin every chat prompt and
    can carry K/V larger than any text does, are covered. Plain text only for a model with no template
    (or one that refuses this chat)."""
    ids = [tokenizer.encode(CALIBRATION_TEXT)]
    question, answer = CALIBRATION_TEXT.split(" A: ", 1)
    chat = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    # no chat template, or one that raises on these turns: the plain text only
    with contextlib.suppress(ValueError, jinja2.TemplateError):
        ids.append(tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=False)))
    return ids


@torch.no_grad()
def kv_amax(model: LlamaForCausalLM, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """max |K| and max |V| per (layer, KV head, channel) over `sequences` (run back to back in one pass,
    each attending only to itself), each head's K and V rotated as an fp8 cache stores them: each
    (layers, kv_heads, head_dim), fp32 on the CPU. `model` is the whole model, not a tensor-parallel
    shard."""
    cfg = model.config
    if cfg.is_mla:
        raise ValueError(
            f"fp8 KV for {cfg.architecture} (MLA: the cache holds a latent, not per-head K and V) is not "
            "implemented; use --kv-cache-dtype auto, bfloat16 or float16"
        )
    k_amax = torch.zeros(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    v_amax = torch.zeros(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    device = model.embed_tokens.weight.device
    lens = [len(s) for s in sequences]
    # the model's own attention (windows, soft-caps), without a cache
    dense = model.dense_attention(lens, device)
    rotation = kv_rotation(cfg.head_dim).to(device)

    def attn_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        k_amax[layer] = (k.float() @ rotation).abs().amax(dim=0).cpu()  # (n_kv, hd)
        v_amax[layer] = (v.float() @ rotation).abs().amax(dim=0).cpu()
        return dense(q, k, v, layer)

    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    model.run_layers(ids, positions, attn_fn)
    return k_amax, v_amax
