"""End-to-end checks on the real SmolLM2 model: tokenizer, chat template, greedy generation, bf16."""

from __future__ import annotations

import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.model.attention import AttentionMetadata
from common.model.loader import default_model_path, load_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], steps: int, eos: tuple[int, ...]) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(steps):
        nxt = int(model.dense_forward(torch.tensor(ids))[-1].argmax())
        ids.append(nxt)
        if nxt in eos:
            break
    return ids[len(prompt_ids) :]


def test_config_from_gguf(smollm) -> None:
    model, tokenizer = smollm
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and model.lm_head is None
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,) and tokenizer.eos_token_ids == (2,)
    assert c.model_id == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(c.weights_hash) == 16
    assert tokenizer.vocab_size == c.vocab_size == 49152
    assert default_model_path().endswith(c.model_id)


def test_tokenizer_round_trip(smollm) -> None:
    _, tok = smollm
    for text in (
        "Hello, world!",
        "Ünïcödé naïve café — 日本語 🙂🚀",
        "0123456789 3.14 1,000,000",
        " a\n\tb  ",
    ):
        assert tok.decode(tok.encode(text)) == text
    # smollm pre-tokenizer: every digit is its own token
    digits = tok.encode("2024")
    assert len(digits) == 4 and tok.decode(digits) == "2024"
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)


def test_special_tokens_are_single_ids(smollm) -> None:
    _, tok = smollm
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("x<|im_end|>\n")[1] == 2
    assert tok.decode([1, 2], skip_special_tokens=True) == ""
    assert tok.decode([1], skip_special_tokens=False) == "<|im_start|>"


def test_chat_template_renders_chatml(smollm) -> None:
    _, tok = smollm
    text = tok.apply_chat_template(QUESTION)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds a default system turn
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n") and "<|im_start|>assistant" not in no_prompt
    own_system = tok.apply_chat_template([{"role": "system", "content": "S"}, *QUESTION])
    assert own_system.startswith("<|im_start|>system\nS<|im_end|>\n")


def test_greedy_answers_paris(smollm) -> None:
    model, tok = smollm
    prompt = tok.encode(tok.apply_chat_template(QUESTION))
    out = greedy(model, prompt, 20, tok.eos_token_ids)
    assert "Paris" in tok.decode(out)


@torch.inference_mode()
def test_bf16_first_token_matches_fp32(smollm) -> None:
    model, tok = smollm
    bf16, _ = load_model(dtype=torch.bfloat16)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    prompt = torch.tensor(tok.encode(tok.apply_chat_template(QUESTION)))
    logits16 = bf16.dense_forward(prompt)
    assert logits16.dtype == torch.float32 and torch.isfinite(logits16).all()
    first = int(model.dense_forward(prompt)[-1].argmax())
    assert int(logits16[-1].argmax()) == first
    # the paged path in bf16 too: one prefill step over a bf16 cache, contiguous blocks
    c, T = bf16.config, len(prompt)
    cache = PagedKVCache(
        KVCacheSpec(c.num_layers, -(-T // 16), 16, c.num_kv_heads, c.head_dim, torch.bfloat16)
    )
    table = torch.arange(cache.spec.num_blocks)
    meta = AttentionMetadata([0, T], [T], [table], torch.arange(T))
    hidden = bf16(prompt, torch.arange(T), cache, meta)
    assert hidden.dtype == torch.bfloat16
    assert int(bf16.compute_logits(hidden[-1:]).argmax()) == first
