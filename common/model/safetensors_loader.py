"""Load a Hugging Face model folder: config.json, *.safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from common.model.config import ROPE_SCALING_TYPES, ModelConfig, normalize_rope_scaling, weights_hash
from common.model.llama import LlamaForCausalLM
from common.runtime.logs import progress
from common.text.tokenizer import Tokenizer

# config.json's model_type -> the families of common/model/llama.py (docs/models.md)
log = logging.getLogger("splitserve.model")
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe",
    "deepseek_v2", "deepseek_v3",
)  # fmt: skip

# config.json is read as transformers 5 reads it (parity with transformers is the referee), and a field
# that changes the math but is not implemented here is refused, never ignored: silently wrong output is
# the worst bug a serving system can have. The fields of every supported family's config class:
#
#   field                                 changes the math?          here
#   ------------------------------------  -------------------------  --------------------------------------
#   vocab_size, hidden_size, head_dim,    shapes                     read (the weights' shapes must agree;
#   intermediate_size, num_hidden_layers,                            head_dim defaults as transformers':
#   num_attention_heads, num_key_value_heads                         qwen3 128, gemma 256)
#   rms_norm_eps                          yes                        read
#   hidden_act / hidden_activation        yes                        silu (= swish), gelu_pytorch_tanh;
#                                                                    others refused
#   rope_parameters (transformers >= 5),  yes                        both layouts read; refused if they
#   rope_theta + rope_scaling (older)                                disagree, of a type or key we lack
#                                                                    (yarn, longrope, dynamic, ...),
#                                                                    partial_rotary_factor != 1; per layer
#                                                                    type only for gemma3 (+ its legacy
#                                                                    rope_local_base_freq)
#   max_position_embeddings               serving length, llama3     read (the default max_model_len)
#   tie_word_embeddings                   yes                        read (gemma: tied by default)
#   attention_bias                        yes: q, k, v and o biases  q/k/v read (qwen2: always; mistral,
#                                                                    mixtral, phi3: never); o_proj biases
#                                                                    refused at load
#   mlp_bias (llama)                      yes                        true refused
#   sliding_window, use_sliding_window,   yes, past the window       read: every layer slides (mistral,
#   max_window_layers, layer_types,                                  mixtral, phi3, qwen3_moe), or those
#   sliding_window_pattern (gemma3)                                  layer_types / max_window_layers /
#                                                                    the pattern say (qwen2/3, gemma2/3);
#                                                                    llama: refused (transformers drops it)
#   layer_types                           which layers slide         full_/sliding_attention; others refused
#   query_pre_attn_scalar (gemma)         the attention scale        read
#   attn_logit_softcapping (gemma2)       yes                        read (gemma3: refused when set, as
#                                                                    transformers' Gemma3 would drop it)
#   final_logit_softcapping (gemma)       yes                        read
#   use_bidirectional_attention (gemma)   yes                        true refused
#   num_local_experts / num_experts,      the MoE                    read; qwen3_moe's decoder_sparse_step
#   num_experts_per_tok, norm_topk_prob,                             and mlp_only_layers give its dense
#   moe_intermediate_size, decoder_sparse_step, mlp_only_layers     layers
#   router_jitter_noise, router_aux_loss_ no (training only)         ignored
#   coef, output_router_logits, *_pdrop
#   bos_token_id, eos_token_id            when to stop, not logits   read (eos merged with generation_config)
#   pad_token_id, use_cache, dtype,       no                         ignored
#   initializer_range, attention_dropout,
#   pretraining_tp (5.x ignores it), original_max_position_embeddings (phi3: longrope's, refused there)
#   _FOREIGN_FIELDS (logit_scale, ...)    yes, in other families     refused when set
#   quantization_config                   the weights' format        refused (plain float weights only)
#
# deepseek_v2 / deepseek_v3 (`_deepseek`): MLA and DeepSeek's MoE
#   kv_lora_rank, q_lora_rank (None: V2-    the attention            read (common/model/mla.py)
#   Lite), qk_nope/rope_head_dim, v_head_dim
#   head_dim (transformers: = qk_rope_head_dim)  derived           ignored (ours: the cache layout)
#   num_key_value_heads                     no (MLA has none)        ignored
#   rope_interleave (V3; V2 always)         the RoPE pair layout     read
#   rope yarn mscale / mscale_all_dim       cos/sin, softmax scale   read (as transformers' DeepSeek)
#   n_routed_experts, num_experts_per_tok,  the MoE                  read
#   moe_intermediate_size, n_shared_experts,
#   first_k_dense_replace, routed_scaling_factor
#   moe_layer_freq                          which layers are MoE     != 1 refused (transformers ignores it)
#   topk_method, scoring_func, n_group,     the router               V2: greedy / group_limited_greedy
#   topk_group, norm_topk_prob                                       with softmax, norm_topk_prob=true
#                                                                    refused (transformers' V2 ignores
#                                                                    it); V3: noaux_tc with sigmoid;
#                                                                    other methods refused
#   attention_bias                          yes                      true refused
#   num_nextn_predict_layers / num_mtp_     no (drafting only)       their weights dropped at load
#   layers, ep_size, aux_loss_alpha, seq_aux

# What transformers assumes for a field config.json leaves out: a missing field must mean here what it
# means there (a Mistral config without sliding_window has a 4096-token window).
_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "hidden_act": "silu"}
_GEMMA: dict[str, Any] = {
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
}  # fmt: skip
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
    "qwen3": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3_moe": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
    "mixtral": {
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
    },
    "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": None},
    "gemma2": {
        **_GEMMA, "max_position_embeddings": 8192, "num_key_value_heads": 4,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    },
    "gemma3_text": {**_GEMMA, "max_position_embeddings": 131072, "num_key_value_heads": 4},
    # transformers 5's DeepseekV2Config / DeepseekV3Config defaults
    "deepseek_v2": {
        "max_position_embeddings": 2048, "first_k_dense_replace": 0, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "n_routed_experts": 64, "n_shared_experts": 2, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_method": "greedy",
        "norm_topk_prob": False, "v_head_dim": 128, "moe_intermediate_size": 1407,
        "intermediate_size": 11008,
    },
    "deepseek_v3": {
        "max_position_embeddings": 4096, "first_k_dense_replace": 3, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "n_routed_experts": 256, "n_shared_experts": 1, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "v_head_dim": 128,
        "moe_intermediate_size": 2048, "intermediate_size": 18432, "rope_interleave": True,
    },
}  # fmt: skip
# transformers' default rope_theta where a family's differs from 10000 (gemma3: the full layers')
_THETA_DEFAULTS = {"mixtral": 1e6, "gemma3_text": 1e6}
_GEMMA3_LOCAL_THETA = 10000.0  # gemma3's sliding layers (rope_local_base_freq)
# Which families have the field (elsewhere it is refused when set)
_FAMILY_FIELDS: dict[str, tuple[str, ...]] = {
    "query_pre_attn_scalar": ("gemma2", "gemma3_text"),
    "final_logit_softcapping": ("gemma2", "gemma3_text"),
    "attn_logit_softcapping": ("gemma2",),  # transformers' Gemma3 has the field but never applies it
}
_FOREIGN_FIELDS = (
    "logit_scale",  # cohere
    "logits_scaling",  # granite
    "embedding_multiplier",  # granite
    "residual_multiplier",  # granite
    "attention_multiplier",  # granite
)
# Families whose every layer slides when the config has a window (no layer_types)
_ALL_LAYERS_SLIDE = ("mistral", "mixtral", "phi3", "qwen3_moe")
# Families with a use_sliding_window switch (off: no window, whatever sliding_window says)
_WINDOW_SWITCH = ("qwen2", "qwen3", "qwen3_moe")
# Keys a rope dict may hold for the types we implement (transformers' RopeParameters, and "factors" of
# our own freq_factors type); longrope's and mrope's keys are not understood, so refused.
_ROPE_KEYS = frozenset(
    ("rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "low_freq_factor",
     "high_freq_factor", "original_max_position_embeddings", "factors")
)  # fmt: skip
_YARN_KEYS = frozenset(("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"))
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


def _rope_from_hf(
    cfg: dict[str, Any], folder: str, default_theta: float = _ROPE_THETA_DEFAULT, what: str = ""
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either layout: transformers >= 5 writes one `rope_parameters`
    dict holding rope_theta too; older files have a top-level `rope_theta` and a `rope_scaling` dict.
    `what` prefixes the field names in messages (gemma3's per-layer-type dicts)."""
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
                "every layer of this model type uses one RoPE"
            )
        name = what + name
        kind = d.get("rope_type", d.get("type"))
        if kind not in (None, "default", *ROPE_SCALING_TYPES):
            raise ValueError(
                f"{folder}: config.json {name}: unsupported rope_scaling type {kind!r}; supported: "
                f"{', '.join(ROPE_SCALING_TYPES)} (or none/'default')"
            )
        unknown = sorted(set(d) - _ROPE_KEYS - (_YARN_KEYS if kind == "yarn" else frozenset()))
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
    theta = next(iter(thetas.values()), default_theta)
    return theta, next(iter(scalings.values()), None)


def _gemma3_rope(cfg: dict[str, Any], folder: str) -> tuple[float, dict[str, Any] | None, float]:
    """Gemma3's (full layers' rope_theta, their scaling, sliding layers' rope_theta), as transformers 5's
    Gemma3TextConfig reads them: rope_parameters per layer type, or the legacy top-level rope_theta,
    rope_scaling (the full layers') and rope_local_base_freq (the sliding layers')."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict) or any(not isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"{folder}: config.json rope_parameters of a gemma3 model must be given per layer type "
            f"(full_attention, sliding_attention), got {params!r}"
        )
    extra = sorted(set(params) - {"full_attention", "sliding_attention"})
    if extra:
        raise ValueError(f"{folder}: config.json rope_parameters has unknown layer types {extra}")
    full = {"rope_parameters": params.get("full_attention")}
    full.update({k: cfg[k] for k in ("rope_theta", "rope_scaling", "max_position_embeddings") if k in cfg})
    theta, scaling = _rope_from_hf(full, folder, _THETA_DEFAULTS["gemma3_text"], "full_attention.")
    sliding = {
        "rope_parameters": params.get("sliding_attention"),
        "rope_theta": cfg.get("rope_local_base_freq"),
    }
    sliding["max_position_embeddings"] = cfg["max_position_embeddings"]
    local_theta, local_scaling = _rope_from_hf(sliding, folder, _GEMMA3_LOCAL_THETA, "sliding_attention.")
    if local_scaling is not None:
        raise ValueError(
            f"{folder}: config.json rope_parameters.sliding_attention: RoPE scaling on the sliding layers "
            "is not implemented"
        )
    return theta, scaling, local_theta


def _rope_scaling(name: str, d: dict[str, Any], cfg: dict[str, Any], folder: str) -> dict[str, Any] | None:
    """The scaling part of one rope dict, validated (`normalize_rope_scaling`), as transformers 5 fills it."""
    s = {k: v for k, v in d.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if s.get("rope_type", s.get("type")) in ("llama3", "yarn"):
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


def _layer_types(
    cfg: dict[str, Any], model_type: str, folder: str
) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers applies them; (None, None) when no layer slides,
    layer_types None when every layer does."""
    window = cfg.get("sliding_window")
    if model_type in _WINDOW_SWITCH and not cfg.get("use_sliding_window"):
        window = None  # transformers: sliding_window = None unless use_sliding_window
    given = cfg.get("layer_types")
    n = int(cfg["num_hidden_layers"])
    if given is not None:
        unknown = set(given) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(
                f"{folder}: config.json layer_types {sorted(unknown)}: only full_attention and "
                "sliding_attention layers are known"
            )
        if len(given) != n:
            raise ValueError(f"{folder}: config.json layer_types has {len(given)} entries for {n} layers")
    if window is None:
        return None, None
    if model_type in _ALL_LAYERS_SLIDE:
        if given is not None and "full_attention" in given:
            # transformers' Mistral (and these) slide every layer whatever layer_types says
            raise ValueError(
                f"{folder}: config.json layer_types names full_attention layers, but {model_type} "
                "applies sliding_window to every layer: ambiguous, refused"
            )
        return int(window), None
    if given is not None:
        kinds = tuple(given)
    elif model_type in ("qwen2", "qwen3"):
        first = int(cfg["max_window_layers"])
        kinds = tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    elif model_type == "gemma2":
        kinds = tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n))
    elif model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        kinds = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))
    else:  # llama: transformers' Llama has no sliding window and would drop it
        raise ValueError(
            f"{folder}: config.json sliding_window={window}: {model_type} models have no sliding window "
            "(transformers ignores it); refused rather than guessing"
        )
    if "sliding_attention" not in kinds:
        return None, None
    return int(window), None if all(k == "sliding_attention" for k in kinds) else kinds


def _refuse_unimplemented(cfg: dict[str, Any], model_type: str, folder: str) -> None:
    """Raise ValueError, naming the field, for a config.json field that changes the math we lack."""

    def refuse(field: str, why: str) -> None:
        raise ValueError(f"{folder}: config.json {field}: {why}")

    act = cfg.get("hidden_activation") or cfg["hidden_act"]
    if act not in ("silu", "swish", "gelu_pytorch_tanh"):
        refuse(f"hidden_act={act!r}", "only silu and gelu_pytorch_tanh are implemented")
    if cfg.get("mlp_bias"):
        refuse("mlp_bias=true", "MLP biases are not implemented")
    for field in _FOREIGN_FIELDS:
        if cfg.get(field) is not None:
            refuse(f"{field}={cfg[field]!r}", f"not implemented ({model_type} models have no such field)")
    for field, families in _FAMILY_FIELDS.items():
        if cfg.get(field) is not None and model_type not in families:
            refuse(
                f"{field}={cfg[field]!r}",
                f"not implemented for {model_type} (transformers' {model_type} would not apply it)",
            )
    if cfg.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention=true", "only causal attention is implemented")
    if cfg.get("quantization_config"):
        refuse("quantization_config", "quantized checkpoints are not supported (plain float weights only)")
    if model_type == "phi3" and (cfg.get("rope_scaling") or {}).get("type") in ("su", "yarn"):
        refuse("rope_scaling", "phi3's su/yarn scaling is longrope, not implemented")
    if model_type == "qwen3_moe" and int(cfg["decoder_sparse_step"]) < 1:
        refuse(f"decoder_sparse_step={cfg['decoder_sparse_step']}", "must be at least 1")


def config_from_hf(folder: str, files: list[str]) -> ModelConfig:
    raw = _read_json(os.path.join(folder, "config.json"))
    if not raw:
        raise ValueError(f"{folder}: config.json missing")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = " (the multimodal gemma3: only its text model, gemma3_text, is supported)" * (
            model_type == "gemma3"
        )
        raise ValueError(
            f"{folder}: model_type {model_type!r} not supported ({', '.join(SUPPORTED_MODEL_TYPES)}){hint}"
        )
    cfg = {**_DEFAULTS, **_TYPE_DEFAULTS[model_type], **raw}
    _refuse_unimplemented(cfg, model_type, folder)
    window, layer_types = _layer_types(cfg, model_type, folder)
    local_theta: float | None = None
    if model_type == "gemma3_text":
        rope_theta, rope_scaling, local_theta = _gemma3_rope(cfg, folder)
    else:
        default = _THETA_DEFAULTS.get(model_type, _ROPE_THETA_DEFAULT)
        rope_theta, rope_scaling = _rope_from_hf(cfg, folder, default)
    gen = _read_json(os.path.join(folder, "generation_config.json"))
    # generation_config's eos list is what generation should stop on (Llama 3 adds <|eot_id|> there).
    eos = list(dict.fromkeys(_as_ids(gen.get("eos_token_id")) + _as_ids(cfg.get("eos_token_id"))))
    n_head = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    n_layers = int(cfg["num_hidden_layers"])
    # transformers: Qwen2 always has q/k/v biases; Mistral, Mixtral and Phi3 never; the others when
    # attention_bias says so
    bias = {"qwen2": True, "mistral": False, "mixtral": False, "phi3": False}.get(
        model_type, bool(cfg.get("attention_bias"))
    )
    gemma = model_type in ("gemma2", "gemma3_text")
    moe: dict[str, Any] = {}
    if model_type == "mixtral":
        moe = dict(
            num_experts=int(cfg["num_local_experts"]), moe_intermediate_size=int(cfg["intermediate_size"])
        )
        moe.update(num_experts_per_tok=int(cfg["num_experts_per_tok"]), norm_topk_prob=True)
    elif model_type == "qwen3_moe":
        step, only = int(cfg["decoder_sparse_step"]), set(cfg.get("mlp_only_layers") or ())
        # transformers 5 writes num_local_experts (its attribute_map's name), the Hub's files num_experts
        names = [n for n in ("num_experts", "num_local_experts") if cfg.get(n) is not None]
        if len({cfg[n] for n in names}) > 1:
            raise ValueError(f"{folder}: config.json num_experts and num_local_experts disagree")
        experts = int(cfg[names[0]]) if names else 128
        dense = tuple(i for i in range(n_layers) if i in only or experts == 0 or (i + 1) % step)
        moe = dict(num_experts=experts, moe_intermediate_size=int(cfg["moe_intermediate_size"]))
        moe.update(num_experts_per_tok=int(cfg["num_experts_per_tok"]), dense_layers=dense)
        moe.update(norm_topk_prob=bool(cfg["norm_topk_prob"]))
        if experts == 0:
            moe = {}
    deepseek = _deepseek(cfg, model_type, folder) if model_type.startswith("deepseek") else {}
    act = cfg.get("hidden_activation") or cfg["hidden_act"]
    shape = dict(
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=int(cfg.get("head_dim") or hidden // n_head),
    )
    shape.update({k: deepseek.pop(k) for k in ("num_kv_heads", "head_dim") if k in deepseek})
    fields: dict[str, Any] = dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n_layers,
        num_heads=n_head,
        **shape,
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
        architecture=model_type,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=local_theta if local_theta is not None and local_theta != rope_theta else None,
        norm_offset=gemma,
        sandwich_norm=gemma,
        hidden_act="silu" if act == "swish" else act,
        embedding_scale=hidden**0.5 if gemma else None,
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
        attn_logit_softcapping=_float(cfg.get("attn_logit_softcapping")),
        final_logit_softcapping=_float(cfg.get("final_logit_softcapping")),
        **moe,
        **deepseek,
    )
    try:
        return ModelConfig(**fields)
    except ValueError as e:  # ModelConfig's own checks: name the folder, as the checks above do
        raise ValueError(f"{folder}: config.json: {e}") from None


def _deepseek(cfg: dict[str, Any], model_type: str, folder: str) -> dict[str, Any]:
    """ModelConfig's MLA and MoE fields of a deepseek_v2/v3 config.json, as transformers 5 reads it;
    what changes the math and is not implemented is refused."""

    def refuse(field: str, why: str) -> ValueError:
        return ValueError(f"{folder}: config.json {field}: {why}")

    v3 = model_type == "deepseek_v3"
    if cfg.get("attention_bias"):
        raise refuse("attention_bias=true", "MLA projection biases are not implemented")
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        raise refuse(
            f"moe_layer_freq={cfg['moe_layer_freq']}",
            "transformers' DeepSeek makes every layer from first_k_dense_replace on MoE; refused rather "
            "than guessing",
        )
    q_lora = cfg.get("q_lora_rank")
    r, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    out: dict[str, Any] = dict(
        kv_lora_rank=r,
        q_lora_rank=None if q_lora is None else int(q_lora),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=rope,
        v_head_dim=int(cfg["v_head_dim"]),
        # V2's RoPE multiplies complex pairs (always interleaved); V3 has the switch
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
        num_kv_heads=1,
        head_dim=(r + rope) // 2,  # the cache's layout (ModelConfig.mla_split)
    )
    if (r + rope) % 2:
        raise refuse(
            f"kv_lora_rank + qk_rope_head_dim = {r + rope}",
            "must be even: the KV cache holds the latent's two halves in K and V",
        )
    names = [n for n in ("n_routed_experts", "num_experts", "num_local_experts") if cfg.get(n) is not None]
    if len({cfg[n] for n in names}) > 1:
        raise refuse(", ".join(names), "disagree")
    experts = int(cfg[names[0]]) if names else 0
    if not experts:
        return out
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    want = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in want:
        raise refuse(f"topk_method={method!r}", f"{model_type} implements {', '.join(want)}")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise refuse(f"scoring_func={scoring!r}", f"{model_type} with {method} is not implemented with it")
    norm = bool(cfg.get("norm_topk_prob"))
    if norm and not v3:
        raise refuse("norm_topk_prob=true", "transformers' DeepseekV2 never renormalises; ambiguous, refused")
    top_k = cfg.get("num_experts_per_tok")
    if top_k is None:
        raise refuse("num_experts_per_tok", f"missing, with {experts} routed experts")
    n_layers, first = int(cfg["num_hidden_layers"]), int(cfg.get("first_k_dense_replace") or 0)
    out.update(
        num_experts=experts,
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=norm,
        dense_layers=tuple(range(min(first, n_layers))),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        router={"greedy": "softmax"}.get(method, method),
    )
    if method != "greedy":
        for field in ("n_group", "topk_group"):
            if cfg.get(field) is None:
                raise refuse(field, f"missing, needed by topk_method={method}")
        out.update(n_group=int(cfg["n_group"]), topk_group=int(cfg["topk_group"]))
    return out


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


def _read_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the weight files, one at a time."""
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, fh.get_tensor(name)


def load_safetensors_folder(
    folder: str, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, Tokenizer]:
    files = _weight_files(folder)
    config = config_from_hf(folder, files)
    total = 0
    for f in files:
        with safe_open(f, framework="pt") as fh:
            total += len(fh.keys())
    what = f"loading {os.path.basename(os.path.normpath(folder))}"
    tensors = dict(progress(_read_tensors(files), what, total=total, logger=log))
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
