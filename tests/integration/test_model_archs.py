"""Every supported architecture against transformers, token for token (issue 28).

For each family a tiny random-weight model is built with transformers itself (no download), saved as
an HF folder and loaded with our loader. Then, in fp32:

* logits over a prompt three times longer than the sliding window agree with transformers' forward
  to 1e-4, through the paged path (prefill in chunks that cross block and window boundaries, on
  shuffled blocks) and through the dense reference;
* 16 greedy tokens from `LLMEngine` (chunked prefill, then decode) equal transformers'
  `generate(do_sample=False)`;
* each quirk under test matters on this input: transformers without it (no window, no soft-cap, ...)
  gives logits that differ by far more than the tolerance, so a loader that dropped it would fail.

The models are tiny (hidden 64, 2-4 layers, vocabulary 256 with a word-level tokenizer), so the whole
file runs in seconds; each is built once per module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.kv.layer_groups import GroupedBlockManager
from common.model.attention import AttentionMetadata
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.sampling_params import SamplingParams
from common.text.tokenizer import Tokenizer

VOCAB = 256
WINDOW = 8
PROMPT = 40  # > 3 windows
NEW_TOKENS = 16
BLOCK = 4
CHUNK = 11  # prefill chunk of the paged-logits check: crosses blocks and windows at odd offsets
TOL = 1e-4
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
IDS = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(0))


@dataclass(frozen=True)
class Arch:
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    # config overrides under which transformers computes something else on IDS: each one a quirk that
    # must matter (a loader ignoring it would be caught)
    matters: dict[str, dict[str, Any]] = field(default_factory=dict)
    window: bool = False  # the model has sliding layers (checked by the config we read)


LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 500000.0,
}  # fmt: skip
DEEPSEEK = {
    "num_key_value_heads": 4, "num_hidden_layers": 3, "kv_lora_rank": 32, "q_lora_rank": 48,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
}  # fmt: skip
ARCHS = {
    "llama-llama3": Arch(
        "llama", {"rope_parameters": LLAMA3}, {"rope": {"rope_parameters": {"rope_theta": 500000.0}}}
    ),
    "llama-linear": Arch(
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
        {"rope": {"rope_parameters": {"rope_theta": 10000.0}}},
    ),
    # YaRN: factor 4 over an original 128 positions: low frequencies interpolated, cos/sin x1.14
    "llama-yarn": Arch(
        "llama",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "rope_theta": 10000.0}},
        {"rope": {"rope_parameters": {"rope_theta": 10000.0}}},
    ),
    "qwen3-yarn": Arch(  # the legacy layout, untruncated ramp and DeepSeek's mscale ratio
        "qwen3",
        {"rope_theta": 1e6,
         "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                          "beta_fast": 16, "beta_slow": 2, "truncate": False, "mscale": 1.0,
                          "mscale_all_dim": 0.5}},
        {"rope": {"rope_scaling": None, "rope_parameters": {"rope_theta": 1e6}}},
    ),
    "qwen3": Arch(
        "qwen3",
        {"rope_parameters": {"rope_theta": 1e6}, "num_hidden_layers": 3},
        {"rope": {"rope_parameters": {"rope_theta": 10000.0}}},
    ),
    "qwen3-window": Arch(  # layers 1 and 2 slide, layer 0 sees everything
        "qwen3",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
         "num_hidden_layers": 3},
        {"window": {"use_sliding_window": False}},
        window=True,
    ),
    "mistral": Arch(
        "mistral", {"sliding_window": WINDOW}, {"window": {"sliding_window": None}}, window=True
    ),
    "qwen2-window": Arch(
        "qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        {"window": {"use_sliding_window": False}},
        window=True,
    ),
    "phi3": Arch("phi3", {"sliding_window": WINDOW}, {"window": {"sliding_window": None}}, window=True),
    "gemma2": Arch(
        "gemma2",
        {
            "sliding_window": WINDOW, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0, "num_hidden_layers": 3,
        },
        {
            "window": {"sliding_window": 512},
            "attn_softcap": {"attn_logit_softcapping": None},
            "final_softcap": {"final_logit_softcapping": None},
            "scalar": {"query_pre_attn_scalar": 16},
        },
        window=True,
    ),
    "gemma3": Arch(
        "gemma3_text",
        {
            "sliding_window": WINDOW, "query_pre_attn_scalar": 24, "final_logit_softcapping": 5.0,
            "num_hidden_layers": 4, "sliding_window_pattern": 2,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        },
        {
            "window": {"sliding_window": 512},
            "final_softcap": {"final_logit_softcapping": None},
            "local_rope": {
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                }
            },
        },
        window=True,
    ),
    "mixtral": Arch(
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
        {"top_k": {"num_experts_per_tok": 1}, "window": {"sliding_window": None}},
        window=True,
    ),
    "qwen3_moe": Arch(
        "qwen3_moe",
        {
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False,
            "num_hidden_layers": 3, "mlp_only_layers": [1],
        },
        {"norm_topk_prob": {"norm_topk_prob": True}},
    ),
    # DeepSeek MLA (the latent cached; common/model/mla.py) and DeepSeek's MoE (shared experts, routed
    # weights scaled): V2-Lite's layout (no query compression, greedy softmax routing) with YaRN whose
    # mscale_all_dim also scales the softmax; V2 with query compression and group-limited routing; V3
    # (sigmoid routing with the correction bias, groups, renormalised, interleaved RoPE)
    "deepseek_v2": Arch(
        "deepseek_v2",
        {**DEEPSEEK, "q_lora_rank": None, "routed_scaling_factor": 2.0,
         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}},
        {"top_k": {"num_experts_per_tok": 1}, "scaling": {"routed_scaling_factor": 1.0},
         "rope": {"rope_parameters": {"rope_theta": 10000.0}},
         "mscale": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                        "original_max_position_embeddings": 128}}},
    ),
    "deepseek_v2-groups": Arch(
        "deepseek_v2",
        {**DEEPSEEK, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
        {"groups": {"topk_method": "greedy"}},
    ),
    "deepseek_v3": Arch(
        "deepseek_v3",
        {**DEEPSEEK, "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
        {"interleave": {"rope_interleave": False}, "norm_topk_prob": {"norm_topk_prob": False},
         "groups": {"topk_group": 2}},
    ),
}  # fmt: skip


def build(folder: Path, arch: Arch) -> Path:
    """Save a seeded random `arch` model with transformers, and a word-level tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    params = {**TINY, **arch.config}
    if arch.model_type.startswith("deepseek"):
        del params["head_dim"]  # derived (qk_rope_head_dim); transformers' V3 would take a given one
    config = AutoConfig.for_model(arch.model_type, **params)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    offset = arch.model_type.startswith("gemma")  # (1 + w) norms: w around 0
    with torch.no_grad():  # O(1) activations and logits, so that 1e-4 is a tight bound
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights around 1 (gemma: 1 + w), biases around 0
                centre = 1.0 if "norm" in name and not offset else 0.0
                p.copy_(centre + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                std = 1.0 if "embed" in name else p.shape[-1] ** -0.5
                if "lm_head" in name:
                    std *= 4  # a clear favourite per row: greedy decoding is stable against rounding
                p.copy_(std * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # deepseek_v3's router bias (zeros at init)
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(folder)
    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@dataclass
class Built:
    folder: Path
    hf: Any  # transformers' model
    ref: torch.Tensor  # transformers' logits for IDS, (PROMPT, vocab)
    ours: LlamaForCausalLM
    tokenizer: Tokenizer


@pytest.fixture(scope="module", params=list(ARCHS), ids=list(ARCHS))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    from transformers import AutoModelForCausalLM

    arch = ARCHS[request.param]
    folder = build(tmp_path_factory.mktemp(request.param), arch)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(IDS[None]).logits[0].float()
    model, tokenizer = load_model(str(folder))
    return Built(folder, hf, ref, model, tokenizer)


def paged_logits(
    model: LlamaForCausalLM, ids: torch.Tensor, chunk: int, kv_heads: int | None = None
) -> torch.Tensor:
    """Logits of every row of `ids`, prefilled in chunks of `chunk` tokens over shuffled KV blocks
    (`kv_heads`: a tensor-parallel shard's)."""
    c = model.config
    n_blocks = -(-len(ids) // BLOCK)
    heads = kv_heads or c.num_kv_heads
    cache = PagedKVCache(KVCacheSpec(c.num_layers, n_blocks + 3, BLOCK, heads, c.head_dim))
    table = torch.randperm(n_blocks + 3, generator=torch.Generator().manual_seed(2))[:n_blocks].tolist()
    out = []
    for start in range(0, len(ids), chunk):
        pos = torch.arange(start, min(start + chunk, len(ids)))
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in pos.tolist()])
        meta = AttentionMetadata([0, len(pos)], [int(pos[-1]) + 1], [torch.tensor(table)], slots)
        out.append(model.compute_logits(model(ids[pos], pos, cache, meta)))
    return torch.cat(out)


@torch.inference_mode()
def test_config_read(built: Built, request: pytest.FixtureRequest) -> None:
    arch = ARCHS[request.node.callspec.id]
    c = built.ours.config
    assert c.architecture == arch.model_type
    assert (c.sliding_window is not None) == arch.window
    if arch.window:
        assert c.sliding_window == WINDOW
    if arch.model_type.startswith("deepseek"):  # the latent cached: one 20-wide head in K, one in V
        assert c.mla_latent == (32, 8) and (c.num_kv_heads, c.head_dim) == (1, 20)
        assert c.q_lora_rank == arch.config["q_lora_rank"]
        assert c.dense_layers == (0,) and c.num_experts == 4 and c.n_shared_experts == 1


@torch.inference_mode()
def test_logits_match_transformers(built: Built) -> None:
    dense = built.ours.dense_forward(IDS)
    assert (dense - built.ref).abs().max().item() <= TOL, "dense forward"
    paged = paged_logits(built.ours, IDS, CHUNK)
    diff = (paged - built.ref).abs().max().item()
    assert diff <= TOL, f"max abs logit diff vs transformers {diff}"


@torch.inference_mode()
def test_quirks_matter(built: Built, request: pytest.FixtureRequest) -> None:
    """transformers without each quirk computes something else: the parity above tests the quirk."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((built.folder / "config.json").read_text())
    for what, overrides in ARCHS[request.node.callspec.id].matters.items():
        cfg = {**raw, **overrides}
        if "use_sliding_window" in overrides:
            del cfg["layer_types"]  # derived from use_sliding_window: derived again
        config = AutoConfig.for_model(**cfg)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        hf.load_state_dict(built.hf.state_dict())
        wrong = hf(IDS[None]).logits[0].float()
        assert (wrong - built.ref).abs().max().item() > 1e-2, f"{what} does not change the logits"
    if raw["model_type"] == "deepseek_v3":  # the router's correction bias (a weight, not a config field)
        state = {
            k: torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v
            for k, v in built.hf.state_dict().items()
        }
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw), dtype=torch.float32).eval()
        hf.load_state_dict(state)
        wrong = hf(IDS[None]).logits[0].float()
        assert (wrong - built.ref).abs().max().item() > 1e-2, "e_score_correction_bias does not matter"


# also through the Triton kernels (interpreted on a CPU): a window on every layer, and interleaved
# windowed and full layers with soft-capped scores
TRITON = ("mistral", "gemma2")


@torch.inference_mode()
def test_greedy_tokens_match_transformers(built: Built, request: pytest.FixtureRequest) -> None:
    hf_out = built.hf.generate(
        IDS[None], max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, PROMPT:].tolist()
    assert len(hf_out) == NEW_TOKENS
    # chunked prefill (16-token budget over a 40-token prompt), then decode steps
    cfg = EngineConfig(max_num_batched_tokens=16, num_kv_blocks=64, block_size=BLOCK, dtype="float32")
    engine = LLMEngine(built.ours, built.tokenizer, cfg)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
    out = engine.generate([IDS.tolist()], params)[0]
    assert out.token_ids == hf_out
    c = built.ours.config
    windows = [c.window(i) for i in range(c.num_layers)]
    if None in windows and any(w is not None for w in windows):  # full and sliding layers: grouped
        held_while_decoding(engine, params)
    if request.node.callspec.id in TRITON:
        pytest.importorskip("triton")
        triton_cfg = cfg.model_copy(update={"attention_backend": "triton"})
        engine = LLMEngine(built.ours, built.tokenizer, triton_cfg)
        assert engine.runner.use_kernels
        assert engine.generate([IDS.tolist()], params)[0].token_ids == hf_out
    if built.ours.config.is_mla:  # the preflight's record names the latent group, one 20-wide head
        compat = engine.kv_compat()
        assert (compat.layer_groups, compat.num_kv_heads, compat.head_dim) == ("mla32+8:3", 1, 20)
        assert engine.kv_cache.spec.bytes_per_block == 3 * BLOCK * 40 * 4  # the latent, once, fp32
    if request.node.callspec.id == "deepseek_v3":  # no Triton kernel over the latent: the torch path
        pytest.importorskip("triton")
        triton_cfg = cfg.model_copy(update={"attention_backend": "triton"})
        engine = LLMEngine(built.ours, built.tokenizer, triton_cfg)
        assert not engine.runner.use_kernels
        assert engine.generate([IDS.tolist()], params)[0].token_ids == hf_out
        # an fp8 latent cache (each half rotated and scaled as a K/V head; no offsets for a latent):
        # built, calibrated and served on the torch path; its accuracy is tests/unit/test_mla.py's
        fp8 = cfg.model_copy(update={"kv_cache_dtype": "fp8_e4m3"})
        engine = LLMEngine(built.ours, built.tokenizer, fp8)
        assert engine.kv_cache.quantized and not engine.kv_cache.offsets
        assert engine.kv_compat().dtype == "float8_e4m3fn" and engine.kv_compat().kv_scales
        assert len(engine.generate([IDS.tolist()], params)[0].token_ids) == NEW_TOKENS


def held_while_decoding(engine: LLMEngine, params: SamplingParams) -> None:
    """A model mixing full and sliding layers: a block table per layer group, the sliding groups'
    holding only the pages of their window once it decodes past it (common/kv/layer_groups.py)."""
    bm = engine.block_manager
    assert isinstance(bm, GroupedBlockManager) and engine.kv_cache.spec.groups.num_groups > 1
    engine.add_request(IDS.tolist(), params)
    held = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            computed, blocks = seq.num_computed_tokens, len(seq.block_table)
            held = bm.num_held(seq)
            sliding = [g for g, w in enumerate(bm.windows) if w is not None]
            want = bm.num_groups * blocks - sum(bm._first_live_of(g, computed) for g in sliding)  # noqa: SLF001
            assert held == want, f"{held} pages held at {computed} tokens, want {want}"
    assert held < bm.num_groups * -(-(PROMPT + NEW_TOKENS) // BLOCK)  # a table per group: less
    bm.check_integrity()


@torch.inference_mode()
def test_tensor_parallel_shards_match(built: Built) -> None:
    """Two tensor-parallel ranks (threads) give the whole model's logits: the families' per-head and
    elementwise quirks (q/k norms, windows, soft-caps, sandwich norms, embedding scale) shard as Llama
    does; a mixture of experts shards every expert's width (each rank routes alike, one all-reduce)."""
    from common.parallel.collective import TPRank
    from common.parallel.partition import shard_layouts
    from tests.unit.test_tensor_parallel import ThreadCollective, ThreadWorld, run_ranks

    whole, c = built.ours, built.ours.config
    layouts = shard_layouts(c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size, 2)
    world = ThreadWorld(2)
    shards = [whole.shard(TPRank(lay, ThreadCollective(world, lay.rank))) for lay in layouts]
    ids = IDS[:24]
    got = run_ranks(world, lambda r: paged_logits(shards[r], ids, CHUNK, len(layouts[r].kv_heads)))[0]
    torch.testing.assert_close(got, built.ref[:24], atol=TOL, rtol=0)
