"""Load a llama.cpp GGUF file: dequantize every tensor to float, undo llama.cpp's layout choices, and
hand the model HF-named tensors, so one weight-loading path serves both GGUF and safetensors.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from common.model.config import ModelConfig, weights_hash
from common.model.llama import LlamaForCausalLM
from common.runtime.logs import progress
from common.text.tokenizer import Tokenizer

log = logging.getLogger("splitserve.model")

# Architectures whose converter permutes Q/K rows for llama.cpp's interleaved RoPE (which we undo).
# Qwen2 is converted without the permutation (llama.cpp runs it in NEOX/half-split mode).
_PERMUTED_QK = {"llama": True, "mistral": True, "qwen2": False}

# GGUF per-layer tensor name -> HF name suffix
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_GLOBAL_NAMES["output.weight"] = "lm_head.weight"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's permute, which regroups each head's rows from HF's half-split
    rotary layout [x0..x(d/2-1), x(d/2)..] into llama.cpp's interleaved pairs. w: (n_head*hd, ...)."""
    rows = w.shape[0]
    # permute did reshape(n_head, 2, hd/2, rest).swapaxes(1, 2); reading it back as (n_head, hd/2, 2)
    # and swapping again restores the original order.
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields decoded to Python values (strings, numbers, lists)."""
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        meta[name] = field.contents()
    return meta


def _config_from_metadata(meta: dict[str, Any], extra: dict[str, Any]) -> ModelConfig:
    arch = meta["general.architecture"]

    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    n_head = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // n_head)))
    scaling: dict[str, Any] | None = None
    kind = key("rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (only linear)")
    if "rope_freqs" in extra:  # Llama 3.1 style: explicit per-frequency divisors
        scaling = {"rope_type": "freq_factors", "factors": tuple(extra["rope_freqs"].tolist())}
    return ModelConfig(
        vocab_size=int(key("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=n_head,
        num_kv_heads=int(key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        # GGUF stores eps as float32; round-trip through float32 text so 1e-5 stays 1e-5.
        rms_norm_eps=float(f"{float(key('attention.layer_norm_rms_epsilon')):.7g}"),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings=bool(extra["tied"]),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(extra["eos_token_ids"]),
        model_id=extra["model_id"],
        weights_hash=extra["weights_hash"],
        attention_bias=bool(extra["attention_bias"]),
    )


def load_gguf(path: str, dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, Tokenizer]:
    t0 = time.monotonic()
    reader = gguf.GGUFReader(path)  # parses every metadata field: seconds for a 49k-token vocabulary
    meta = read_metadata(reader)
    log.info("%s: header read, %d tensors, %.1f s", os.path.basename(path), len(reader.tensors),
             time.monotonic() - t0)  # fmt: skip
    arch = meta.get("general.architecture")
    if arch not in _PERMUTED_QK:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not a supported Llama-family model")
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))

    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, Any] = {}
    # dequantizing is most of the load time (seconds for SmolLM2-135M on a CPU): a bar, tensor by tensor
    for t in progress(reader.tensors, f"dequantizing {os.path.basename(path)}", logger=log):
        # dequantize returns numpy in row-major (out_features, in_features): torch's Linear layout.
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = torch.from_numpy(arr.copy())
        if t.name == "rope_freqs.weight":
            extra["rope_freqs"] = w
            continue
        if t.name in _GLOBAL_NAMES:
            tensors[_GLOBAL_NAMES[t.name]] = w
            continue
        blk, idx, suffix = t.name.split(".", 2)
        if blk != "blk" or suffix not in _LAYER_NAMES:
            raise ValueError(f"{path}: unexpected tensor {t.name!r}")
        if _PERMUTED_QK[arch] and suffix.startswith(("attn_q.", "attn_k.")):
            w = unpermute_qk(w, n_head if suffix.startswith("attn_q.") else n_kv)
        tensors[f"model.layers.{idx}.{_LAYER_NAMES[suffix]}"] = w

    extra["tied"] = "lm_head.weight" not in tensors
    extra["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
    extra["model_id"] = os.path.basename(path)
    extra["weights_hash"] = weights_hash([path])
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    extra["eos_token_ids"] = tokenizer.eos_token_ids  # eos + eot + eom, one source of truth
    config = _config_from_metadata(meta, extra)
    model = LlamaForCausalLM.from_hf_weights(config, tensors, dtype)
    return model, tokenizer
