"""Load a Hugging Face model folder: config.json, *.safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from safetensors.torch import load_file

from common.model.config import ModelConfig, weights_hash
from common.model.llama import LlamaForCausalLM
from common.text.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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


def config_from_hf(folder: str, files: list[str]) -> ModelConfig:
    cfg = _read_json(os.path.join(folder, "config.json"))
    if not cfg:
        raise ValueError(f"{folder}: config.json missing")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{folder}: model_type {model_type!r} not supported ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    gen = _read_json(os.path.join(folder, "generation_config.json"))
    # generation_config's eos list is what generation should stop on (Llama 3 adds <|eot_id|> there).
    eos = list(dict.fromkeys(_as_ids(gen.get("eos_token_id")) + _as_ids(cfg.get("eos_token_id"))))
    n_head = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=n_head,
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=int(cfg.get("head_dim") or hidden // n_head),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=cfg.get("rope_scaling"),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
        eos_token_ids=tuple(eos),
        model_id=os.path.basename(os.path.normpath(folder)),
        weights_hash=weights_hash(files),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
    )


def load_safetensors_folder(
    folder: str, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, Tokenizer]:
    files = _weight_files(folder)
    config = config_from_hf(folder, files)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
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
