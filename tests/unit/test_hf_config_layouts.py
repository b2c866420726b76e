"""config.json as transformers writes it, old and new: our safetensors loader against transformers.

Tiny random-weight models are built with transformers itself (no download) and saved to a folder;
our loader must produce the logits transformers computes from the very same folder (fp32, 1e-4), or
refuse, naming the field, a config whose math it does not implement. Issue 28: transformers >= 5
keeps rope_theta and the scaling inside `rope_parameters`, which the loader once ignored (rope_theta
10000 instead of 500000, wrong from the second token on, silently).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from common.model.loader import load_model
from common.model.safetensors_loader import config_from_hf

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# Small original context, so that llama3 scaling moves head_dim 16's frequencies inside 40 tokens.
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}
IDS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))


def build(folder: Path, model_type: str, legacy: bool = False, **overrides: Any) -> Path:
    """Save a seeded random `model_type` model with transformers (config.json in transformers 5's
    layout, or with `legacy` in the older one: top-level rope_theta + rope_scaling) and a tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # O(1) logits, so that 1e-4 is a tight bound (transformers' init gives ~1e-3)
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights around 1, biases around 0
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                std = 1.0 if "embed" in name else p.shape[1] ** -0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    if legacy:
        cfg = json.loads((folder / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        (folder / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def hf_logits(folder: Path, **config_overrides: Any) -> torch.Tensor:
    """transformers' logits (T, vocab) for IDS, read from `folder`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **config_overrides).eval()
    with torch.inference_mode():
        return hf(IDS[None]).logits[0].float()


def write_config(folder: Path, **cfg: Any) -> str:
    """A bare config.json (no weights) for checks of config_from_hf alone."""
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **TINY, **cfg}))
    return str(folder)


@dataclass(frozen=True)
class Case:
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    legacy: bool = False
    # what a loader that ignored the field under test would run: transformers with it must differ
    ignored: dict[str, Any] | None = None


THETA_5E5 = {"rope_type": "default", "rope_theta": 500000.0}
PARITY = {
    "v5-rope_theta": Case("llama", {"rope_parameters": dict(THETA_5E5)}, ignored=DEFAULT_ROPE),
    "v5-llama3": Case("llama", {"rope_parameters": dict(LLAMA3)}, ignored=THETA_5E5),
    "legacy-llama3": Case("llama", {"rope_parameters": dict(LLAMA3)}, legacy=True),
    "legacy-rope_theta": Case("llama", {"rope_parameters": dict(THETA_5E5)}, legacy=True),
    "mistral-no-window": Case(
        "mistral", {"sliding_window": None, "rope_parameters": {"rope_theta": 1e6}}, ignored=DEFAULT_ROPE
    ),
    # Qwen2.5's shape: a window given but use_sliding_window off; q/k/v biases
    "qwen2": Case(
        "qwen2",
        {"use_sliding_window": False, "sliding_window": 16, "rope_parameters": {"rope_theta": 1e6}},
        ignored=DEFAULT_ROPE,
    ),
}


@pytest.mark.parametrize("case", PARITY.values(), ids=PARITY.keys())
def test_logits_match_transformers(tmp_path: Path, case: Case) -> None:
    folder = build(tmp_path, case.model_type, case.legacy, **case.config)
    if case.legacy:
        assert "rope_parameters" not in json.loads((folder / "config.json").read_text())
    ref = hf_logits(folder)
    model, _ = load_model(str(folder))
    with torch.inference_mode():
        diff = (model.dense_forward(IDS) - ref).abs().max().item()
    assert diff <= 1e-4, f"max abs logit diff vs transformers {diff}"
    if case.ignored is not None:  # the input is long enough to show the field matters
        wrong = hf_logits(folder, rope_parameters=dict(case.ignored))
        assert (wrong - ref).abs().max().item() > 1e-2


def test_mistral_sliding_window_matches_transformers(tmp_path: Path) -> None:
    """Once refused (no sliding-window attention here), now implemented: tests/integration/
    test_model_archs.py checks every family's window in depth."""
    folder = build(tmp_path, "mistral", sliding_window=16)
    # transformers applies the window: the first 16 rows agree with full attention, later ones do not
    ref, full = hf_logits(folder), hf_logits(folder, sliding_window=None)
    torch.testing.assert_close(ref[:16], full[:16])
    assert (ref[16:] - full[16:]).abs().max().item() > 1e-2
    model, _ = load_model(str(folder))
    assert model.config.sliding_window == 16 and model.config.layer_types is None
    with torch.inference_mode():
        assert (model.dense_forward(IDS) - ref).abs().max().item() <= 1e-4


def test_llama_o_proj_bias_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="o_proj biases"):
        load_model(str(build(tmp_path, "llama", attention_bias=True)))


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "extrapolation": 1}},
         "implement: extrapolation"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
          "original_max_position_embeddings": 32}, "original_max_position_embeddings=32 and .* disagree"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 4, "beta_fast": 32}}, "implement: beta_fast"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling type 'dynamic'"),
        ({"rope_scaling": {"type": "su", "factor": 4.0}}, "rope_scaling: unsupported rope_scaling type 'su'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "missing low_freq_factor"),
        (
            {"layer_types": ["full_attention", "sliding_attention"],
             "rope_parameters": {"full_attention": DEFAULT_ROPE, "sliding_attention": DEFAULT_ROPE}},
            "per layer type \\(full_attention, sliding_attention\\)",
        ),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
         "rope_theta twice, differently: rope_theta=10000.0, rope_parameters.rope_theta=500000.0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": {"rope_theta": 5e5}},
         "rope_parameters .* and rope_scaling .* disagree"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
         "rope_parameters.partial_rotary_factor=0.5"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"sliding_window": 64}, "sliding_window=64"),  # a Llama whose window transformers would drop
        ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        # other families' fields
        ({"logit_scale": 0.5}, "logit_scale=0.5"),
        ({"query_pre_attn_scalar": 64}, "query_pre_attn_scalar=64: not implemented for llama"),
        ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0},
         "attn_logit_softcapping=50.0: not implemented for gemma3_text"),
        ({"model_type": "gemma2", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"model_type": "gemma3", "text_config": {}}, "model_type 'gemma3' not supported.*gemma3_text"),
        ({"model_type": "olmo2"}, "model_type 'olmo2' not supported"),
        # phi3's long-context RoPE
        ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8,
          "long_factor": [2.0] * 8, "rope_theta": 1e4}}, "unsupported rope_scaling type 'longrope'"),
        ({"model_type": "phi3", "rope_scaling": {"type": "su", "short_factor": [1.0] * 8}}, "longrope"),
        ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
        # gemma3: per-layer-type RoPE, but no scaling on the sliding layers
        ({"model_type": "gemma3_text", "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
         "sliding layers is not implemented"),
        ({"model_type": "gemma3_text", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
         "per layer type"),
        # mistral slides every layer: layer_types naming full layers is ambiguous
        ({"model_type": "mistral", "sliding_window": 64, "layer_types": ["full_attention"] * 2},
         "ambiguous"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_local_experts": 8}, "disagree"),
    ],
)  # fmt: skip
def test_unimplemented_config_is_refused(tmp_path: Path, cfg: dict[str, Any], match: str) -> None:
    folder = write_config(tmp_path, **cfg)
    with pytest.raises(ValueError, match=match) as err:
        config_from_hf(folder, [])
    assert str(tmp_path) in str(err.value)  # the message names the model folder


@pytest.mark.parametrize(
    "cfg",
    [
        {},  # no rope field at all: theta 10000
        {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},  # both, agreeing
        # both layouts, the same scaling in two spellings
        {"rope_scaling": {"type": "linear", "factor": 2.0},
         "rope_parameters": {"rope_type": "linear", "factor": 2}},
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "mistral", "sliding_window": 512},  # the window covers the whole context
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
        # once refused, now implemented: sliding windows (mistral's default one), the newer families
        {"model_type": "mistral", "max_position_embeddings": 32768},
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
        {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64},
        {"model_type": "phi3", "sliding_window": 64},
        {"model_type": "gemma2"},
        {"model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4},
        {"model_type": "mixtral", "sliding_window": 64},
        {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2},
        {"partial_rotary_factor": 1.0, "hidden_act": "swish", "mlp_bias": False},
    ],
)  # fmt: skip
def test_config_accepted(tmp_path: Path, cfg: dict[str, Any]) -> None:
    config_from_hf(write_config(tmp_path, **cfg), [])


def test_layouts_read_the_same(tmp_path: Path) -> None:
    v5 = {"rope_parameters": dict(LLAMA3), "max_position_embeddings": 131072}
    (tmp_path / "v5").mkdir()
    (tmp_path / "v4").mkdir()
    a = config_from_hf(write_config(tmp_path / "v5", **v5), [])
    legacy = {"rope_theta": 500000.0, "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}}
    b = config_from_hf(write_config(tmp_path / "v4", **legacy, max_position_embeddings=131072), [])
    assert a.rope_theta == b.rope_theta == 500000.0
    assert a.rope_scaling == b.rope_scaling and a.rope_scaling is not None
    assert a.rope_scaling["rope_type"] == "llama3" and "rope_theta" not in a.rope_scaling
    # llama3 without original_max_position_embeddings: transformers 5 takes max_position_embeddings
    no_orig = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    (tmp_path / "no_orig").mkdir()
    c = config_from_hf(write_config(tmp_path / "no_orig", rope_parameters=no_orig), [])
    assert c.rope_scaling is not None and c.rope_scaling["original_max_position_embeddings"] == 512


# The Hub's config.json of DeepSeek-V2-Lite and DeepSeek-V3 (legacy layout: top-level rope_theta, a
# "type": "yarn" rope_scaling with DeepSeek's mscale pair; fields transformers 5 ignores included)
V2_LITE: dict[str, Any] = {
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "ep_size": 1,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
    "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001,
}  # fmt: skip
V3: dict[str, Any] = {
    **V2_LITE, "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "q_lora_rank": 1536, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}  # fmt: skip


def test_deepseek_hub_configs_are_read(tmp_path: Path) -> None:
    import math

    (tmp_path / "v2").mkdir()
    (tmp_path / "v3").mkdir()
    lite = config_from_hf(write_config(tmp_path / "v2", **V2_LITE), [])
    v3 = config_from_hf(write_config(tmp_path / "v3", **V3), [])
    for c in (lite, v3):  # the latent is what is cached: one head of (512 + 64) / 2 in K and in V
        assert c.is_mla and c.mla_latent == (512, 64) and (c.num_kv_heads, c.head_dim) == (1, 288)
        assert c.rope_dim == 64 and c.rope_interleave and c.rope_scaling is not None
        assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["factor"] == 40
    assert lite.q_lora_rank is None and v3.q_lora_rank == 1536
    assert (lite.router, lite.norm_topk_prob) == ("softmax", False)
    assert (lite.num_experts, lite.num_experts_per_tok) == (64, 6)
    assert (lite.n_shared_experts, lite.dense_layers, lite.routed_scaling_factor) == (2, (0,), 1.0)
    assert (v3.router, v3.n_group, v3.topk_group, v3.norm_topk_prob) == ("noaux_tc", 8, 4, True)
    assert (v3.n_shared_experts, v3.dense_layers, v3.routed_scaling_factor) == (1, (0, 1, 2), 2.5)
    # the softmax scale: (nope + rope) ** -0.5 times YaRN's mscale(40, mscale_all_dim) squared
    m = 0.1 * 0.707 * math.log(40) + 1
    assert math.isclose(lite.attn_scale, 192**-0.5 * m * m, rel_tol=1e-12)
    m = 0.1 * math.log(40) + 1
    assert math.isclose(v3.attn_scale, 192**-0.5 * m * m, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({**V2_LITE, "topk_method": "noaux_tc"}, "topk_method='noaux_tc': deepseek_v2 implements greedy"),
        ({**V2_LITE, "scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
        ({**V2_LITE, "norm_topk_prob": True}, "norm_topk_prob=true"),
        ({**V2_LITE, "moe_layer_freq": 2}, "moe_layer_freq=2"),
        ({**V2_LITE, "attention_bias": True}, "attention_bias=true"),
        ({**V2_LITE, "topk_method": "group_limited_greedy", "n_group": None}, "n_group: missing"),
        ({**V2_LITE, "n_routed_experts": 64, "num_local_experts": 32}, "disagree"),
        ({**V2_LITE, "num_experts_per_tok": None}, "num_experts_per_tok: missing"),
        ({**V2_LITE, "kv_lora_rank": 511}, "kv_lora_rank \\+ qk_rope_head_dim = 575.*even"),
        ({**V2_LITE, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope_scaling type"),
        ({**V3, "topk_method": "greedy"}, "topk_method='greedy': deepseek_v3 implements noaux_tc"),
        ({**V3, "scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({**V3, "n_group": 3}, "256 experts in n_group=3 groups"),
        ({**V3, "num_experts_per_tok": 200}, "more than the 4 groups kept hold"),
        ({**V3, "quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)  # fmt: skip
def test_deepseek_unimplemented_is_refused(tmp_path: Path, cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config_from_hf(write_config(tmp_path, **cfg), [])
