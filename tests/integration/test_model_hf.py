"""Our model against Hugging Face transformers on the same weights, and the safetensors round trip.

The GGUF-loaded model is exported as an HF folder; transformers loads that folder and must agree with
our logits (this checks our architecture, RoPE and the GGUF Q/K un-permutation), and our own
safetensors loader must read the folder back to the same model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.model.hf_export import export_hf_folder
from common.model.loader import load_model

TEXT = "The capital of France is Paris. 1234567 + 89 = ?\n  Ünïcödé 日本語 🙂 <|im_end|>"


@pytest.fixture(scope="module")
def hf_dir(smollm, tmp_path_factory) -> Path:
    model, tokenizer = smollm
    return export_hf_folder(model, tokenizer, tmp_path_factory.mktemp("smollm_hf"))


@torch.inference_mode()
def test_matches_transformers(smollm, hf_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir)).float().eval()  # config says float32
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
