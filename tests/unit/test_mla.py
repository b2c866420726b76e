"""MLA (deepseek; common/model/mla.py): the latent cache's layout, the decode batch over it, refusals.

Parity with transformers (logits, greedy, TP 2) is in tests/integration/test_model_archs.py and across
the split in tests/integration/test_kv_mla.py; here: a step where several sequences decode at once
(the padded decode batch, which one-request tests never reach) against the dense reference, and the
KV spec's MLA layer group."""

from __future__ import annotations

import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, KVScales, PagedKVCache
from common.model.attention import AttentionMetadata
from common.model.calibration import kv_amax
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


def test_fp8_kv_with_mla_is_refused() -> None:
    scales = KVScales(torch.ones(2, 1, 12), torch.ones(2, 1, 12))
    spec = KVCacheSpec(2, 4, BLOCK, 1, 12, torch.float8_e4m3fn, mla=(16, 8))
    with pytest.raises(ValueError, match="MLA"):
        PagedKVCache(spec, scales=scales)
    with pytest.raises(ValueError, match="fp8 KV for deepseek_v3"):
        kv_amax(random_model(mla_config()), [[1, 2, 3]])


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
