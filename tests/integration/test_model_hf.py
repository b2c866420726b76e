"""Our model against Hugging Face transformers on the same weights, and the safetensors round trip.

The GGUF-loaded model is exported as an HF folder; transformers loads that folder and must agree with
our logits (this checks our architecture, RoPE and the GGUF Q/K un-permutation), and our own
safetensors loader must read the folder back to the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEXT = "The capital of France is Paris. 1234567 + 89 = ?\n  Ünïcödé 日本語 🙂 <|im_end|>"


def export_hf_folder(model: LlamaForCausalLM, tokenizer: Tokenizer, out: Path) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json for `model`."""
    c = model.config
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


@pytest.fixture(scope="module")
def hf_dir(smollm, tmp_path_factory) -> Path:
    model, tokenizer = smollm
    return export_hf_folder(model, tokenizer, tmp_path_factory.mktemp("smollm_hf"))


@torch.inference_mode()
def test_matches_transformers(smollm, hf_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": TEXT}]))
    ref = hf(torch.tensor([ids])).logits[0].float()  # (T, vocab)
    ours = model.dense_forward(torch.tensor(ids))
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-3, f"max abs logit diff vs transformers {diff}"


@torch.inference_mode()
def test_safetensors_round_trip(smollm, hf_dir: Path) -> None:
    model, tokenizer = smollm
    model2, tokenizer2 = load_model(str(hf_dir))
    c1, c2 = model.config, model2.config
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        assert getattr(c1, field) == getattr(c2, field), field
    assert c2.rms_norm_eps == c1.rms_norm_eps and c2.rope_theta == c1.rope_theta
    assert c2.tie_word_embeddings and c2.eos_token_ids == c1.eos_token_ids and c2.bos_token_id == 1
    assert c2.model_id == hf_dir.name and len(c2.weights_hash) == 16
    ids = torch.tensor(tokenizer.encode(TEXT))
    assert torch.equal(model.dense_forward(ids), model2.dense_forward(ids))
    msgs = [{"role": "user", "content": "hi"}]
    assert tokenizer2.apply_chat_template(msgs) == tokenizer.apply_chat_template(msgs)
    assert tokenizer2.encode(TEXT) == tokenizer.encode(TEXT)
    assert tokenizer2.eos_token_ids == (2,)


def test_tokenizer_matches_transformers(smollm, hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    _, tokenizer = smollm
    hf_tok = AutoTokenizer.from_pretrained(str(hf_dir))
    for text in (TEXT, "  leading spaces", "tabs\tand\nnewlines\n\n", "x" * 40, "3.14159e-10"):
        assert tokenizer.encode(text) == hf_tok.encode(text), text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    hf_text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(msgs) == hf_text
