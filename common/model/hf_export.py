"""Export a loaded model as a Hugging Face folder (config.json, model.safetensors, tokenizer files).

Used to compare against transformers on the very same weights (tests, `bench peer-hf`) and to turn
a GGUF into a folder the safetensors loader reads back.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from common.model.llama import LlamaForCausalLM
from common.text.tokenizer import Tokenizer


def export_hf_folder(model: LlamaForCausalLM, tokenizer: Tokenizer, out: str | Path) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json for `model`."""
    c = model.config
    plain = c.architecture in ("llama", "mistral", "qwen2") and c.sliding_window is None
    if not plain or c.qk_norm or c.num_experts:
        # config.json below describes a Llama: any other family's would load as a different model
        raise ValueError(f"exporting a {c.architecture} model as an HF folder is not implemented")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = model.hf_state_dict()
    save_file({k: v.float() for k, v in weights.items()}, str(out / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "hidden_act": "silu",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids),
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tokenizer.chat_template,
        "bos_token": tokenizer.id_to_token(c.bos_token_id),
        "eos_token": tokenizer.id_to_token(c.eos_token_ids[0]),
        "add_bos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return out
