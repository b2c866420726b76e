"""ModelConfig validation, RoPE scaling math, GGUF Q/K un-permutation, loader dispatch errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from common.model.config import (
    ModelConfig,
    normalize_rope_scaling,
    rope_attention_scaling,
    rope_inv_freq,
    weights_hash,
)
from common.model.gguf_loader import unpermute_qk
from common.model.loader import load_model
from common.text.tokenizer import Tokenizer

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def make_config(**kw: object) -> ModelConfig:
    base: dict[str, object] = dict(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_ids=(0,),
        model_id="tiny",
        weights_hash="0",
    )
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def test_no_scaling_is_plain_rope() -> None:
    cfg = make_config(rope_scaling={"rope_type": "default"})
    assert cfg.rope_scaling is None
    expected = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    torch.testing.assert_close(rope_inv_freq(cfg), expected.float())


@pytest.mark.parametrize(
    "yarn",
    [
        {"factor": 4.0, "original_max_position_embeddings": 32},
        {"factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 8, "beta_slow": 2},
        {"factor": 4.0, "original_max_position_embeddings": 32, "truncate": False},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 0.707},
        {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5},
        {"factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 0.9},
        {"factor": 1.0, "original_max_position_embeddings": 128},
    ],
)
@pytest.mark.parametrize("theta, head_dim", [(10000.0, 16), (1e6, 128)])
def test_yarn_matches_transformers(yarn: dict[str, Any], theta: float, head_dim: int) -> None:
    """YaRN's frequencies and cos/sin scale equal transformers' own `_compute_yarn_parameters`."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, **yarn},
    )  # fmt: skip
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = make_config(
        rope_theta=theta,
        head_dim=head_dim,
        hidden_size=head_dim * 4,
        rope_scaling={"rope_type": "yarn", **yarn},
    )
    torch.testing.assert_close(rope_inv_freq(cfg), want_inv.float(), rtol=1e-6, atol=0)
    assert rope_attention_scaling(cfg) == pytest.approx(want_scale, rel=1e-12)
    assert rope_attention_scaling(make_config()) == 1.0


def test_linear_scaling_divides_frequencies() -> None:
    plain = rope_inv_freq(make_config())
    # legacy HF key "type" is accepted too
    scaled = rope_inv_freq(make_config(rope_scaling={"type": "linear", "factor": 4.0}))
    torch.testing.assert_close(scaled, plain / 4)


def test_llama3_scaling_bands() -> None:
    cfg = make_config(head_dim=128, num_heads=4, hidden_size=512, rope_theta=500000.0, rope_scaling=LLAMA3)
    plain = rope_inv_freq(make_config(head_dim=128, num_heads=4, hidden_size=512, rope_theta=500000.0))
    scaled = rope_inv_freq(cfg)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4.0  # short wavelengths untouched
    low = wavelen > 8192 / 1.0  # long wavelengths divided by factor
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    mid = ~high & ~low
    assert mid.any()
    assert torch.all(scaled[mid] < plain[mid]) and torch.all(scaled[mid] > plain[mid] / 8)


def test_llama3_scaling_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # legacy kwargs (rope_theta, rope_scaling) are accepted by transformers 4.x and 5.x alike
    legacy: dict[str, Any] = dict(rope_theta=500000.0, rope_scaling=dict(LLAMA3))
    hf_cfg = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=131072, **legacy
    )
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    ours = rope_inv_freq(
        make_config(
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=500000.0,
            rope_scaling=LLAMA3,
        )
    )
    torch.testing.assert_close(ours, hf_inv.float(), rtol=1e-6, atol=0)


def test_freq_factors_scaling() -> None:
    factors = tuple(float(i + 1) for i in range(8))
    plain = rope_inv_freq(make_config())
    scaled = rope_inv_freq(make_config(rope_scaling={"rope_type": "freq_factors", "factors": factors}))
    torch.testing.assert_close(scaled, plain / torch.tensor(factors))
    with pytest.raises(ValueError, match="8"):
        rope_inv_freq(make_config(rope_scaling={"rope_type": "freq_factors", "factors": (1.0, 2.0)}))


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"rope_type": "yarn", "factor": 4.0}, "missing original_max_position_embeddings"),
        ({"type": "dynamic", "factor": 2.0}, "unsupported rope_scaling type 'dynamic'"),
        ({"rope_type": "linear"}, "missing factor"),
        ({"rope_type": "llama3", "factor": 8.0}, "missing low_freq_factor"),
    ],
)
def test_bad_rope_scaling_is_a_clear_error(scaling: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        normalize_rope_scaling(scaling)
    with pytest.raises(ValueError, match=match):
        make_config(rope_scaling=scaling)


def test_bad_head_counts() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        make_config(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="even"):
        make_config(head_dim=15)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # what convert_hf_to_gguf does
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for n_head, rows in ((9, 576), (3, 192)):
        w = torch.randn(rows, 10)
        assert not torch.equal(permute(w, n_head), w)
        assert torch.equal(unpermute_qk(permute(w, n_head), n_head), w)
        b = torch.randn(rows)
        assert torch.equal(unpermute_qk(permute(b, n_head), n_head), b)


def test_weights_hash_tracks_content(tmp_path) -> None:
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"x" * 3_000_000)
    b.write_bytes(b"x" * 2_999_999 + b"y")  # differs only in the last MiB
    assert weights_hash([str(a)]) == weights_hash([str(a)])
    assert weights_hash([str(a)]) != weights_hash([str(b)])
    assert len(weights_hash([str(a)])) == 16


def test_load_model_rejects_unknown_paths(tmp_path) -> None:
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_model(str(tmp_path / "nope.bin"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"0")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_model(str(f))
    with pytest.raises(ValueError, match="config.json missing|no \\*.safetensors"):
        load_model(str(tmp_path))


def test_gguf_tokenizer_kinds() -> None:
    with pytest.raises(NotImplementedError, match="'t5'"):  # SentencePiece ("llama") builds; T5's does not
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5"})
    with pytest.raises(NotImplementedError, match="pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf_metadata(
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery", "tokenizer.ggml.tokens": ["a"]}
        )
    with pytest.raises(ValueError, match="no vocabulary"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
