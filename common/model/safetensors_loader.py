"""Load a Hugging Face model folder: config.json, *.safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from safetensors.torch import load_file

from common.model.config import ModelConfig, normalize_rope_scaling, weights_hash
from common.model.llama import LlamaForCausalLM
from common.text.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# config.json is read as transformers 5 reads it (parity with transformers is the referee), and a field
# that changes the math but is not implemented here is refused, never ignored: silently wrong output is
# the worst bug a serving system can have. Every field of LlamaConfig, MistralConfig and Qwen2Config:
#
#   field                                 changes the math?          here
#   ------------------------------------  -------------------------  --------------------------------------
#   vocab_size, hidden_size, head_dim,    shapes                     read (the weights' shapes must agree)
#   intermediate_size, num_hidden_layers,
#   num_attention_heads, num_key_value_heads
#   rms_norm_eps                          yes                        read
#   hidden_act                            yes                        silu (= swish) read; others refused
#   rope_parameters (transformers >= 5),  yes                        both layouts read; refused if they
#   rope_theta + rope_scaling (older)                                disagree, per layer type, of a type or
#                                                                    key we lack, partial_rotary_factor != 1
#   max_position_embeddings               serving length, llama3     read (the default max_model_len)
#   tie_word_embeddings                   yes                        read
#   attention_bias (llama)                yes: q, k, v and o biases  q/k/v read; an o_proj bias refused
#                                                                    (qwen2: always q/k/v; mistral: never)
#   mlp_bias (llama)                      yes                        true refused
#   sliding_window (mistral: all layers;  yes, past the window       refused when below max_position_
#   qwen2: use_sliding_window and layers                             embeddings: no sliding-window attention
#   from max_window_layers, or by                                    here (capping the context instead would
#   layer_types; llama: ignored by                                   disagree with what the router reads)
#   transformers, refused here too)
#   layer_types                           which layers slide         full_/sliding_attention; others refused
#   bos_token_id, eos_token_id            when to stop, not logits   read (eos merged with generation_config)
#   pad_token_id, use_cache, dtype,       no                         ignored
#   initializer_range, attention_dropout,
#   pretraining_tp (5.x ignores it)
#   _FOREIGN_FIELDS (softcapping, ...)    yes, in other families     refused when set: not a plain Llama,
#                                                                    and transformers' Llama would drop them
#   quantization_config                   the weights' format        refused (plain float weights only)

# What transformers assumes for a field config.json leaves out: a missing field must mean here what it
# means there (a Mistral config without sliding_window has a 4096-token window).
_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "hidden_act": "silu"}
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "attention_bias": False},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
}
_FOREIGN_FIELDS = (
    "attn_logit_softcapping",  # gemma2
    "final_logit_softcapping",  # gemma2
    "query_pre_attn_scalar",  # gemma2
    "logit_scale",  # cohere
    "logits_scaling",  # granite
    "embedding_multiplier",  # granite
    "residual_multiplier",  # granite
    "attention_multiplier",  # granite
)
# Keys a rope dict may hold for the types we implement (transformers' RopeParameters, and "factors" of
# our own freq_factors type); yarn's, longrope's and mrope's keys are not understood, so refused.
_ROPE_KEYS = frozenset(
    ("rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "low_freq_factor",
     "high_freq_factor", "original_max_position_embeddings", "factors")
)  # fmt: skip
_ROPE_THETA_DEFAULT = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, list) else [v])]


def _weight_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files (only safetensors weights are supported)")
    return files


def _rope_from_hf(cfg: dict[str, Any], folder: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either layout: transformers >= 5 writes one `rope_parameters`
    dict holding rope_theta too; older files have a top-level `rope_theta` and a `rope_scaling` dict."""
    thetas: dict[str, float] = {}
    if cfg.get("rope_theta") is not None:
        thetas["rope_theta"] = float(cfg["rope_theta"])
    partial: dict[str, Any] = {"partial_rotary_factor": cfg.get("partial_rotary_factor")}
    scalings: dict[str, dict[str, Any] | None] = {}
    for name in ("rope_parameters", "rope_scaling"):
        d = cfg.get(name)
        if d is None:
            continue
        if not isinstance(d, dict):
            raise ValueError(f"{folder}: config.json {name} is not a dict: {d!r}")
        nested = [k for k, v in d.items() if isinstance(v, dict)]
        if nested:  # gemma3's {"full_attention": {...}, "sliding_attention": {...}}
            raise ValueError(
                f"{folder}: config.json {name} is given per layer type ({', '.join(nested)}); "
                "every layer here uses one RoPE"
            )
        unknown = sorted(set(d) - _ROPE_KEYS)
        if unknown:
            raise ValueError(
                f"{folder}: config.json {name} has keys we do not implement: {', '.join(unknown)}"
            )
        if d.get("rope_theta") is not None:
            thetas[f"{name}.rope_theta"] = float(d["rope_theta"])
        partial[f"{name}.partial_rotary_factor"] = d.get("partial_rotary_factor")
        scalings[name] = _rope_scaling(name, d, cfg, folder)
    if len(set(thetas.values())) > 1:
        raise ValueError(
            f"{folder}: config.json gives rope_theta twice, differently: "
            + ", ".join(f"{k}={v}" for k, v in thetas.items())
        )
    if len(scalings) == 2 and scalings["rope_parameters"] != scalings["rope_scaling"]:
        raise ValueError(
            f"{folder}: config.json rope_parameters {cfg['rope_parameters']} and rope_scaling "
            f"{cfg['rope_scaling']} disagree (transformers 4 reads one, 5 the other)"
        )
    for key, factor in partial.items():
        if factor is not None and float(factor) != 1.0:
            raise ValueError(f"{folder}: config.json {key}={factor}: partial RoPE is not implemented")
    theta = next(iter(thetas.values()), _ROPE_THETA_DEFAULT)
    return theta, next(iter(scalings.values()), None)


def _rope_scaling(name: str, d: dict[str, Any], cfg: dict[str, Any], folder: str) -> dict[str, Any] | None:
    """The scaling part of one rope dict, validated (`normalize_rope_scaling`), as transformers 5 fills it."""
    s = {k: v for k, v in d.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if s.get("rope_type", s.get("type")) == "llama3":
        # transformers 5 takes a top-level original_max_position_embeddings over the dict's (4.x the
        # dict's), and max_position_embeddings when neither is given.
        top, inner = cfg.get("original_max_position_embeddings"), s.get("original_max_position_embeddings")
        if top is not None and inner is not None and top != inner:
            raise ValueError(
                f"{folder}: config.json original_max_position_embeddings={top} and "
                f"{name}.original_max_position_embeddings={inner} disagree"
            )
        s["original_max_position_embeddings"] = next(
            v for v in (inner, top, cfg["max_position_embeddings"]) if v is not None
        )
    try:
        return normalize_rope_scaling(s)
    except ValueError as e:
        raise ValueError(f"{folder}: config.json {name}: {e}") from None


def _sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The attention window of the layers that slide; None when every layer sees the whole context."""
    window = cfg.get("sliding_window")
    if model_type != "qwen2":  # Mistral slides every layer (and a Llama with a window is refused too)
        return None if window is None else int(window)
    if not cfg["use_sliding_window"] or window is None:
        return None
    n = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if i >= int(cfg["max_window_layers"]) else "full_attention" for i in range(n)
    ]
    return int(window) if "sliding_attention" in kinds else None


def _refuse_unimplemented(cfg: dict[str, Any], model_type: str, folder: str) -> None:
    """Raise ValueError, naming the field, for a config.json field that changes the math we lack."""

    def refuse(field: str, why: str) -> None:
        raise ValueError(f"{folder}: config.json {field}: {why}")

    if cfg["hidden_act"] not in ("silu", "swish"):
        refuse(f"hidden_act={cfg['hidden_act']!r}", "only silu is implemented")
    if cfg.get("mlp_bias"):
        refuse("mlp_bias=true", "MLP biases are not implemented")
    for field in _FOREIGN_FIELDS:
        if cfg.get(field) is not None:
            refuse(f"{field}={cfg[field]!r}", f"not implemented ({model_type} models have no such field)")
    if cfg.get("quantization_config"):
        refuse("quantization_config", "quantized checkpoints are not supported (plain float weights only)")
    kinds = set(cfg.get("layer_types") or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        refuse(f"layer_types {sorted(kinds)}", "only full_attention and sliding_attention layers are known")
    window, context = _sliding_window(cfg, model_type), int(cfg["max_position_embeddings"])
    if window is not None and window < context:
        refuse(
            f"sliding_window={window}",
            f"smaller than max_position_embeddings={context}, and sliding-window attention is not "
            "implemented: every token past the window would be computed wrong",
        )


def config_from_hf(folder: str, files: list[str]) -> ModelConfig:
    raw = _read_json(os.path.join(folder, "config.json"))
    if not raw:
        raise ValueError(f"{folder}: config.json missing")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{folder}: model_type {model_type!r} not supported ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    cfg = {**_DEFAULTS, **_TYPE_DEFAULTS[model_type], **raw}
    _refuse_unimplemented(cfg, model_type, folder)
    rope_theta, rope_scaling = _rope_from_hf(cfg, folder)
    gen = _read_json(os.path.join(folder, "generation_config.json"))
    # generation_config's eos list is what generation should stop on (Llama 3 adds <|eot_id|> there).
    eos = list(dict.fromkeys(_as_ids(gen.get("eos_token_id")) + _as_ids(cfg.get("eos_token_id"))))
    n_head = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    # transformers: Qwen2 always has q/k/v biases, Mistral never, Llama when attention_bias says so
    bias = {"llama": bool(cfg.get("attention_bias")), "mistral": False, "qwen2": True}[model_type]
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=n_head,
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=int(cfg.get("head_dim") or hidden // n_head),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
        eos_token_ids=tuple(eos),
        model_id=os.path.basename(os.path.normpath(folder)),
        weights_hash=weights_hash(files),
        attention_bias=bias,
    )


def load_safetensors_folder(
    folder: str, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, Tokenizer]:
    files = _weight_files(folder)
    config = config_from_hf(folder, files)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    if any(name.endswith("self_attn.o_proj.bias") for name in tensors):
        # Llama's attention_bias puts a bias on o_proj too; ours covers q/k/v only.
        raise ValueError(f"{folder}: the checkpoint has o_proj biases (attention_bias), not implemented")
    model = LlamaForCausalLM.from_hf_weights(config, tensors, dtype)

    tok_json = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(tok_json):
        raise ValueError(f"{folder}: tokenizer.json missing (slow/sentencepiece-only tokenizers unsupported)")
    tok_cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    if "chat_template" not in tok_cfg and os.path.exists(os.path.join(folder, "chat_template.jinja")):
        with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as fh:
            tok_cfg["chat_template"] = fh.read()
    tokenizer = Tokenizer.from_hf_files(tok_json, tok_cfg, config.bos_token_id, config.eos_token_ids)
    return model, tokenizer
