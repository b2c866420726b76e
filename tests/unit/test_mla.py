"""MLA (deepseek; common/model/mla.py): the latent cache's layout, the decode batch over it, refusals.

Parity with transformers (logits, greedy, TP 2) is in tests/integration/test_model_archs.py and across
the split in tests/integration/test_kv_mla.py; here: a step where several sequences decode at once
(the padded decode batch, which one-request tests never reach) against the dense reference, and the
KV spec's MLA layer group."""

from __future__ import annotations

import pytest
import torch

from common.kv import quant
from common.kv.kv_cache import FP8, KVCacheSpec, PagedKVCache
from common.model.attention import AttentionMetadata
from common.model.calibration import kv_stats
from common.model.config import ModelConfig
from common.model.llama import LlamaForCausalLM

BLOCK = 4


def mla_config(**kw: object) -> ModelConfig:
    base: dict[str, object] = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=1,
        head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(), model_id="mla", weights_hash="x",
        architecture="deepseek_v3", kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=6, rope_interleave=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        dense_layers=(0,), n_shared_experts=1, routed_scaling_factor=2.0, router="noaux_tc", n_group=2,
        topk_group=1,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def random_model(cfg: ModelConfig) -> LlamaForCausalLM:
    model = LlamaForCausalLM.empty(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms around 1, the router's bias around 0
                p.copy_((0.0 if "bias" in name else 1.0) + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(p.shape[-1] ** -0.5 * torch.randn(p.shape, generator=gen))
    return model


def test_config_validates_the_latent_layout() -> None:
    c = mla_config()
    assert c.is_mla and c.mla_latent == (16, 8) and c.mla_split == (1, 12) and c.rope_dim == 8
    with pytest.raises(ValueError, match="cache layout of a 24-wide latent is \\(1, 12\\)"):
        mla_config(num_kv_heads=2, num_heads=4)
    with pytest.raises(ValueError, match="must be even"):
        mla_config(kv_lora_rank=15, head_dim=11)
    with pytest.raises(ValueError, match="sliding windows"):
        mla_config(sliding_window=8)
    with pytest.raises(ValueError, match="router='top1'"):
        mla_config(router="top1")


def test_the_kv_spec_names_the_latent_group() -> None:
    spec = KVCacheSpec(3, 10, BLOCK, 1, 12, mla=(16, 8))
    assert spec.layer_groups() == "mla16+8:3"
    assert spec.bytes_per_block == 3 * BLOCK * 24 * 4  # one latent per token and layer, fp32
    assert KVCacheSpec(3, 10, BLOCK, 1, 12).layer_groups() == "full:3"  # a K/V cache of that shape
    with pytest.raises(ValueError, match="1 head of 12"):
        KVCacheSpec(3, 10, BLOCK, 2, 12, mla=(16, 8))


def _latent_logits(
    model: LlamaForCausalLM, cache: PagedKVCache, seqs: list[list[int]], steps: int
) -> torch.Tensor:
    """The sequences prefilled together over shuffled blocks of `cache`, then each decoding `steps` more
    tokens together (the next tokens fixed in advance, the same for every cache): the logits of every
    row of every step, (rows, vocab)."""
    gen = torch.Generator().manual_seed(2)
    free = torch.randperm(cache.spec.num_blocks, generator=gen).tolist()
    extra = torch.randint(0, model.config.vocab_size, (steps, len(seqs)), generator=gen).tolist()
    tables: list[list[int]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    out = []
    for news in [list(seqs), *[[[t] for t in row] for row in extra]]:
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for i, new in enumerate(news):
            while len(tables[i]) * BLOCK < done[i] + len(new):
                tables[i].append(free.pop())
            for j, t in enumerate(new):
                p = done[i] + j
                ids.append(t)
                pos.append(p)
                slots.append(tables[i][p // BLOCK] * BLOCK + p % BLOCK)
            done[i] += len(new)
            qsl.append(qsl[-1] + len(new))
            lens.append(done[i])
        meta = AttentionMetadata(qsl, lens, [torch.tensor(t) for t in tables], torch.tensor(slots))
        hidden = model(torch.tensor(ids), torch.tensor(pos), cache, meta)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


@torch.inference_mode()
def test_fp8_latent_cache_stays_within_fp8_precision_of_fp32_kv() -> None:
    """An fp8 cache of the latent (each half rotated and scaled per channel as a K/V head, calibrated by
    kv_stats over other sequences; no offsets for a latent): the logits of every row of a prefill and
    two decode steps against fp32 KV's. The tolerance is relative to bf16 KV's drift on the same rows:
    e4m3 rounds with 3 mantissa bits, bf16 with 7, so e4m3's errors are up to 16x bf16's, e5m2's
    (2 bits) 32x; the bound allows twice that and also asks that fp8 did drift more than bf16 (its
    rounding is in play). Logits, not greedy tokens: a random-weight model's top two logits are often
    closer than any rounding (and where they are not, the bound already keeps the argmax). Both layers
    dense: a routed MoE layer turns a small drift into a jump where an expert choice flips."""
    model = random_model(mla_config(dense_layers=(0, 1)))
    c = model.config
    gen = torch.Generator().manual_seed(5)
    calib = [torch.randint(0, c.vocab_size, (n,), generator=gen).tolist() for n in (30, 17)]
    seqs = [torch.randint(0, c.vocab_size, (n,), generator=gen).tolist() for n in (21, 9, 14)]
    stats = kv_stats(model, calib)
    assert stats.k_lo.shape == (c.num_layers, 1, c.head_dim) and not stats.k_center.any()

    def logits(dtype: torch.dtype, exact_prefill: bool = True) -> torch.Tensor:
        scales = quant.calibrate(stats, dtype) if dtype in FP8 else None
        spec = KVCacheSpec(c.num_layers, 24, BLOCK, 1, c.head_dim, dtype, mla=c.mla_latent)
        cache = PagedKVCache(spec, compute_dtype=torch.float32, scales=scales, exact_prefill=exact_prefill)
        out = _latent_logits(model, cache, seqs, steps=2)
        assert cache.clamped == 0 and cache.quantized == (dtype in FP8)
        return out

    ref = logits(torch.float32)
    bf16 = (logits(torch.bfloat16) - ref).abs().max().item()
    prompt_rows = sum(len(s) for s in seqs)  # the prefill step's rows: the whole prompts in one chunk
    for dtype, bits in ((torch.float8_e4m3fn, 3), (torch.float8_e5m2, 2)):
        for exact in (True, False):
            got = logits(dtype, exact)
            drift = (got - ref).abs().max().item()
            bound = 2 * 2 ** (7 - bits) * bf16
            assert bf16 < drift <= bound, (dtype, exact, drift, bf16, bound)
            # the prompts read only their own latents: as computed (fp32's logits) or through the cache
            prompt = (got[:prompt_rows] - ref[:prompt_rows]).abs().max().item()
            assert (prompt <= 1e-4) == exact, (dtype, exact, prompt)


@pytest.mark.parametrize("interleave", [True, False])
@torch.inference_mode()
def test_decode_batch_over_the_latent_matches_the_dense_reference(interleave: bool) -> None:
    """Three sequences prefilled (in one step, over shuffled blocks), then two decode steps with all
    three decoding together: each row's logits equal the dense forward of its sequence so far."""
    model = random_model(mla_config(rope_interleave=interleave))
    c = model.config
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, c.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    spec = KVCacheSpec(c.num_layers, 16, BLOCK, 1, c.head_dim, mla=c.mla_latent)
    cache = PagedKVCache(spec)
    free = torch.randperm(16, generator=gen).tolist()
    tables: list[list[int]] = [[] for _ in seqs]

    def step(news: list[list[int]]) -> torch.Tensor:
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for i, new in enumerate(news):
            start = len(seqs[i]) - len(new)
            while len(tables[i]) * BLOCK < len(seqs[i]):
                tables[i].append(free.pop())
            for j, t in enumerate(new):
                p = start + j
                ids.append(t)
                pos.append(p)
                slots.append(tables[i][p // BLOCK] * BLOCK + p % BLOCK)
            qsl.append(qsl[-1] + len(new))
            lens.append(len(seqs[i]))
        meta = AttentionMetadata(qsl, lens, [torch.tensor(t) for t in tables], torch.tensor(slots))
        hidden = model(torch.tensor(ids), torch.tensor(pos), cache, meta)
        return model.compute_logits(hidden[[q - 1 for q in qsl[1:]]])  # each sequence's last row

    logits = step([list(s) for s in seqs])
    for _ in range(2):
        for i, s in enumerate(seqs):
            want = model.dense_forward(torch.tensor(s))[-1]
            torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=0)
        nxt = [int(row.argmax()) for row in logits]
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        logits = step([[t] for t in nxt])
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], model.dense_forward(torch.tensor(s))[-1], atol=1e-4, rtol=0)
