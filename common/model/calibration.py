"""What fp8 KV scales and offsets are calibrated from (common/kv/quant.py turns it into them): over one
pass of the calibration sequences through the model's own attention, no cache, each (layer, KV head,
channel)'s least and largest K and V and their mean weighted by the attention each token's key drew
(`kv_stats`), measured as an fp8 cache stores them: rotated (common/kv/kv_cache.py `kv_rotation`).

The weight of a key is the attention probability it received, summed over every query that saw it and
every query head of its KV head's group (the model's mask, window, scale and soft-cap): the offset is
meant to sit where the keys (and values) that the attention reads most lie, the first token's above all
(common/kv/kv_cache.py has the measurement). An MLA model's cache holds its latent, the first half as K
and the second as V (common/model/mla.py): those halves are measured, weighted by the attention their
latent (the one key every head shares) drew; their center is left at 0 (no offsets: on the random-weight
deepseek model of tests/unit/test_mla.py offsets raised the mean logit drift against fp32 KV, e4m3
0.035 -> 0.051, e5m2 0.080 -> 0.087; its RMS-normed latent has no per-channel bias to remove, and no
real DeepSeek checkpoint has been measured)."""

from __future__ import annotations

import contextlib

import jinja2
import torch

from common.kv.kv_cache import kv_rotation
from common.kv.quant import CALIBRATION_TEXT, KVStats
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
    """max |K| and max |V| per (layer, KV head, channel) over `sequences`, rotated as an fp8 cache
    stores them (`kv_stats`' range): each (layers, kv_heads, head_dim), fp32 on the CPU."""
    st = kv_stats(model, sequences)
    return torch.maximum(st.k_lo.abs(), st.k_hi.abs()), torch.maximum(st.v_lo.abs(), st.v_hi.abs())


@torch.no_grad()
def kv_stats(model: LlamaForCausalLM, sequences: list[list[int]]) -> KVStats:
    """Per (layer, KV head, channel) of K and of V over `sequences` (run back to back in one pass, each
    attending only to itself), each head's K and V rotated as an fp8 cache stores them: the least and
    largest value and the attention-weighted mean (see the module doc); each (layers, kv_heads,
    head_dim), fp32 on the CPU. `model` is the whole model, not a tensor-parallel shard."""
    cfg = model.config
    # MLA (common/model/mla.py): the cache holds the latent, its first half as K and its second as V,
    # one head of head_dim (half the latent) each; attention's key is the whole latent
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    out = {f"{w}_{n}": torch.zeros(shape) for w in "kv" for n in ("lo", "hi", "center")}
    device = model.embed_tokens.weight.device
    lens = [len(s) for s in sequences]
    # the model's own attention (windows, soft-caps), without a cache
    dense = model.dense_attention(lens, device)
    rotation = kv_rotation(cfg.head_dim).to(device)
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    idx = torch.arange(len(pos), device=device)
    causal = (seq_of[:, None] == seq_of[None, :]) & (idx[None, :] <= idx[:, None])  # (T, T)
    cap = cfg.attn_logit_softcapping

    def weights(q: torch.Tensor, k: torch.Tensor, layer: int) -> torch.Tensor:
        """(n_kv, T): the attention each key drew, summed over queries and its group's query heads."""
        n_heads, n_kv = q.shape[1], k.shape[1]
        kk = k.float().repeat_interleave(n_heads // n_kv, dim=1)  # (T, n_heads, hd)
        scores = torch.einsum("thd,shd->hts", q.float(), kk) * model.scale
        if cap:
            scores = torch.tanh(scores / cap) * cap
        mask, window = causal, model.windows[layer]
        if window is not None:
            mask = mask & (pos[None, :] > pos[:, None] - window)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)  # (n_heads, T, T)
        return probs.sum(1).view(n_kv, n_heads // n_kv, -1).sum(1)

    def attn_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        w = weights(q, k, layer)
        w = w / w.sum(-1, keepdim=True)
        cached = (k, v) if not cfg.is_mla else (k[..., : cfg.head_dim], k[..., cfg.head_dim :])
        for name, x in zip("kv", cached, strict=True):
            xr = x.float() @ rotation  # (T, n_kv, hd)
            out[f"{name}_lo"][layer] = xr.amin(dim=0).cpu()
            out[f"{name}_hi"][layer] = xr.amax(dim=0).cpu()
            if not cfg.is_mla:  # an MLA latent keeps offsets 0 (the module doc)
                out[f"{name}_center"][layer] = torch.einsum("ht,thd->hd", w, xr).cpu()
        return dense(q, k, v, layer)

    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
    model.run_layers(ids, pos, attn_fn)
    return KVStats(**out)
