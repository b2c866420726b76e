"""GGUF files of each family our GGUF loader reads, written here as llama.cpp's converter writes them,
loaded by us and by transformers: the logits must agree.

Tiny random-weight models (transformers, seeded) are written the way convert_hf_to_gguf.py writes them
(llama: Q/K rows permuted for llama.cpp's interleaved RoPE; gemma: norms stored as 1 + w; llama.cpp's
tensor and metadata names), their tensors quantized to Q8_0, Q5_0, Q4_0, F16 and F32 with the gguf
package; then our loader and transformers' GGUF loader read the same file. Both dequantize with the
gguf package, so the weights are the same numbers and the logits agree to float32 rounding. The
loader is made to dequantize in small slices (one head of rows), so every tensor is read in several.
The K-quants, which the gguf package cannot write, are checked on the real Gemma 3 270M
(tests/integration/test_gemma3_gguf.py).

gemma models here use head_dim 256: transformers' GGUF loader assumes query_pre_attn_scalar 256
(its config default) where llama.cpp (and we) take the head dim, the same number for every Gemma but
the 27B ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from common.model import gguf_loader
from common.model.loader import load_model

Q = gguf.GGMLQuantizationType
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + list("abcdefgh")
IDS = torch.tensor([2] + [(i * 37) % len(TOKENS) for i in range(1, 40)])  # 40 tokens, past the windows


def _hf_model(arch: str) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    cfg: Any
    model: Any
    common: dict[str, Any] = dict(
        vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, max_position_embeddings=256
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "gemma2":
        cfg = tf.Gemma2Config(**common, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=256, sliding_window=8, rms_norm_eps=1e-6)  # fmt: skip
        model = tf.Gemma2ForCausalLM(cfg)
    else:
        cfg = tf.Gemma3TextConfig(**common, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=256, sliding_window=8, rms_norm_eps=1e-6)  # fmt: skip
        model = tf.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not the init's 0 / 1: the (1 + w) convention must show
                p.copy_(torch.randn(p.shape) * 0.3 + (0 if arch != "llama" else 1))
    return model.float().eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (HF half-split rotary rows -> llama.cpp's pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}  # fmt: skip


def _gguf_name(arch: str, hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, idx, rest = hf.split(".", 3)
    part = rest.removesuffix(".weight")
    gemma = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip
    llama = {"post_attention_layernorm": "ffn_norm"}
    name = _NAMES.get(part) or (llama if arch == "llama" else gemma)[part]
    return f"blk.{idx}.{name}.weight"


def write_gguf(model: Any, arch: str, path: Path) -> Path:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "llama":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        theta = cfg.rope_parameters.get("full_attention", cfg.rope_parameters).get("rope_theta")
        w.add_rope_freq_base(theta)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * 8)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    kinds = [Q.Q8_0, Q.Q5_0, Q.Q4_0, Q.F16]
    for i, (name, t) in enumerate(model.state_dict().items()):
        if arch != "llama" and name == "lm_head.weight":
            continue  # tied: stored once
        a = t.float().numpy()
        if arch != "llama" and name.endswith("norm.weight"):
            a = a + 1  # llama.cpp's converter: gemma norms are stored as 1 + w
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            a = _permute(a, heads)
        kind = Q.F32 if a.ndim == 1 else Q.Q8_0 if "embed" in name else kinds[i % len(kinds)]
        if kind == Q.F32:
            w.add_tensor(_gguf_name(arch, name), a.astype(np.float32))
        elif kind == Q.F16:
            w.add_tensor(_gguf_name(arch, name), a.astype(np.float16))
        else:
            w.add_tensor(_gguf_name(arch, name), gguf.quants.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _transformers_from_gguf(path: Path) -> Any:
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM

    # transformers 5 asks for accelerate before any GGUF load; its GGUF path runs without it
    real = transformers.modeling_utils.is_accelerate_available
    transformers.modeling_utils.is_accelerate_available = lambda *a, **k: True
    try:
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    finally:
        transformers.modeling_utils.is_accelerate_available = real


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
@torch.inference_mode()
def test_logits_match_transformers(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(_hf_model(arch), arch, tmp_path / f"tiny-{arch}.gguf")
    monkeypatch.setattr(gguf_loader, "_CHUNK_ELEMENTS", 256)  # every tensor in several slices
    ours, tokenizer = load_model(str(path))
    c = ours.config
    if arch != "llama":
        assert c.architecture == ("gemma2" if arch == "gemma2" else "gemma3_text") and c.norm_offset
        assert c.sliding_window == 8 and c.layer_types is not None and c.query_pre_attn_scalar == 256
    if arch == "gemma2":
        assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    if arch == "gemma3":
        assert c.qk_norm and c.rope_local_theta == 10000.0
        assert c.layer_types is not None and c.layer_types[5] == "full_attention"
    hf = _transformers_from_gguf(path).eval()
    ref = hf(IDS[None]).logits[0].float()
    got = ours.dense_forward(IDS)
    # a loader without the Q/K un-permutation is 8e-3 off here (llama), one without gemma's norm offset
    # 1.5 (gemma3): both far past this
    assert (got - ref).abs().max().item() < 1e-4
