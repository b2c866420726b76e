"""The GPU execution path's logic, checked on the CPU: placement and KV sizing rules, and the CUDA-graph
runner's padded static-buffer step (run eagerly here, Triton kernels interpreted) against a plain step."""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.engine.device import (
    Placement,
    graph_batch_sizes,
    kv_blocks_for_gpu,
    resolve_attention_backend,
    resolve_dtype,
)
from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.model.config import ModelConfig
from common.model.llama import LlamaForCausalLM

GiB = 2**30


def test_kv_blocks_take_the_utilization_share_minus_weights_others_and_activations() -> None:
    # 80 GiB card, 10 GiB in use (our weights + another process), 2 GiB activation peak, 0.9 share
    blocks = kv_blocks_for_gpu(80 * GiB, 70 * GiB, 2 * GiB, 0.9, 2**20)
    assert blocks == (72 - 10 - 2) * 1024
    # never more than is actually free, whatever the share says
    assert kv_blocks_for_gpu(80 * GiB, 5 * GiB, 1 * GiB, 1.0, 2**20) == 4 * 1024


def test_kv_blocks_refuse_a_card_with_no_room_and_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_blocks_for_gpu(80 * GiB, 10 * GiB, 2 * GiB, 0.9, 2**20)


def test_graph_batch_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    sizes = graph_batch_sizes(256)
    assert all(any(b >= n for b in sizes) for n in range(1, 257)) and sizes[-1] == 256


def test_cpu_placement_is_the_torch_reference_in_fp32_and_explicit_triton_needs_a_gpu_or_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU defaults")
    p = Placement.from_config(EngineConfig())
    assert (p.device.type, p.dtype, p.attention_backend, p.cuda_graphs) == (
        "cpu",
        torch.float32,
        "torch",
        False,
    )
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    pytest.importorskip("triton")  # imported while TRITON_INTERPRET=1: triton reads it at import time
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_attention_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="no CUDA GPU"):
        Placement.from_config(EngineConfig(device="cuda"))


TINY = ModelConfig(
    vocab_size=50, hidden_size=96, intermediate_size=128, num_layers=2, num_heads=6, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
    tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(0,), model_id="tiny", weights_hash="t",
)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the eager (capture=False) path; GPUs capture")
def test_decode_graph_step_with_padding_matches_the_plain_kernel_step() -> None:
    pytest.importorskip("triton")
    from common.engine.model_runner import ModelRunner

    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY).eval()
    for p in model.parameters():
        p.copy_(torch.randn_like(p) * 0.1)
    bs = 4
    spec = KVCacheSpec(TINY.num_layers, 24, bs, TINY.num_kv_heads, TINY.head_dim)
    cache = PagedKVCache(spec)
    runner = ModelRunner(model, cache, attention_backend="triton")
    # three sequences, prompts of 5, 9 and 2 tokens, in scattered blocks
    tables = [[7, 2], [11, 3, 20], [5]]
    prompts = [torch.randint(1, 50, (n,)).tolist() for n in (5, 9, 2)]

    def slots(table: list[int], positions: range) -> list[int]:
        return [table[p // bs] * bs + p % bs for p in positions]

    ids = sum(prompts, [])
    qsl = [0, 5, 14, 16]
    pos = [p for pr in prompts for p in range(len(pr))]
    slot_list = sum((slots(t, range(len(pr))) for t, pr in zip(tables, prompts, strict=True)), [])
    meta = runner.attention_metadata(qsl, [5, 9, 2], tables, torch.tensor(slot_list))
    with torch.inference_mode():
        model(torch.tensor(ids), torch.tensor(pos), cache, meta)  # prefill into the cache
    prefilled_k, prefilled_v = cache.k.clone(), cache.v.clone()

    # one decode step, plainly
    new_ids, new_pos = torch.tensor([3, 4, 5]), torch.tensor([5, 9, 2])
    ctx = [6, 10, 3]
    dslots = torch.tensor([slots(t, range(c - 1, c))[0] for t, c in zip(tables, ctx, strict=True)])
    meta = runner.attention_metadata([0, 1, 2, 3], ctx, tables, dslots)
    with torch.inference_mode():
        plain = model(new_ids, new_pos, cache, meta)
    plain_k, plain_v = cache.k.clone(), cache.v.clone()

    # the same step through the graph runner's static buffers, padded to a batch of 4
    cache.k.copy_(prefilled_k)
    cache.v.copy_(prefilled_v)
    runner.enable_graphs([2, 4], max_model_len=64, capture=False)
    assert runner.graphs is not None
    with torch.inference_mode():
        padded = runner.graphs.run(new_ids, new_pos, dslots, ctx, tables)
    assert padded.shape == plain.shape
    assert (padded - plain).abs().max().item() <= 1e-5
    # Padding rows (slot -1) must write nothing: every slot but the three real decode slots still holds
    # the prefilled K/V bit for bit (nothing computed them again; slot -1 read as a Python index would be
    # the last slot, read as a clamp slot 0: both are in here). The decode slots were computed by a batch
    # of 4 rather than 3, whose matmuls may round differently (seen: ~7e-8 on an AMD EPYC): fp32
    # tolerance there (torch.testing's float32 defaults).
    untouched = torch.ones(spec.num_blocks * bs, dtype=torch.bool)
    untouched[dslots] = False
    by_slot = (spec.num_layers, spec.num_blocks * bs, spec.num_kv_heads, spec.head_dim)
    for name, got, want, before in (
        ("k", cache.k, plain_k, prefilled_k),
        ("v", cache.v, plain_v, prefilled_v),
    ):
        got, want, before = got.view(by_slot), want.view(by_slot), before.view(by_slot)
        assert torch.equal(got[:, untouched], before[:, untouched]), f"padding rows wrote to {name}"
        torch.testing.assert_close(
            got[:, dslots], want[:, dslots], rtol=1.3e-6, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    # a smaller step reuses the buffers: stale rows from the larger step must not leak in
    with torch.inference_mode():
        one = runner.graphs.run(new_ids[:1], new_pos[:1], dslots[:1], ctx[:1], tables[:1])
    assert (one - plain[:1]).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="larger than the largest captured size"):
        runner.graphs.run(torch.zeros(5), torch.zeros(5), torch.zeros(5), [1] * 5, [[0]] * 5)
