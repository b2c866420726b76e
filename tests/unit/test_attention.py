"""The torch paged attention's batched decode call against its per-sequence path (the reference the
Triton kernels are also held to)."""

from __future__ import annotations

import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.model.attention import AttentionMetadata, paged_attention


def _step(new: list[int], ctx: list[int], bs: int, seed: int) -> tuple[AttentionMetadata, PagedKVCache]:
    """A step of sequences with `new` tokens each and `ctx` tokens in KV after it, on shuffled blocks of
    a random cache."""
    g = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(1, 64, bs, 3, 16)
    cache = PagedKVCache(spec, device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    free = torch.randperm(64, generator=g).tolist()
    tables, slots, qsl = [], [], [0]
    for n, c in zip(new, ctx, strict=True):
        table = [free.pop() for _ in range(-(-c // bs))]
        tables.append(torch.tensor(table))
        slots += [table[p // bs] * bs + p % bs for p in range(c - n, c)]
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(qsl, ctx, tables, torch.tensor(slots)), cache


@pytest.mark.parametrize(("new", "ctx"), [
    ([1, 1, 1, 1, 1], [1, 7, 8, 9, 40]),  # decodes only: one a single token, one on a block boundary
    ([1, 5, 1, 1, 3], [30, 5, 2, 17, 12]),  # decodes around prefill chunks
    ([4, 1], [4, 9]),  # one decode: the per-sequence path
])  # fmt: skip
def test_batched_decode_attention_matches_the_per_sequence_path(
    monkeypatch: pytest.MonkeyPatch, new: list[int], ctx: list[int]
) -> None:
    outs = []
    for batched in (True, False):
        meta, cache = _step(new, ctx, bs=8, seed=sum(ctx))
        if not batched:
            monkeypatch.setattr(AttentionMetadata, "decode_batch", lambda self, bs: None)
        g = torch.Generator().manual_seed(1)
        t = sum(new)
        q, k, v = (torch.randn(t, h, 16, generator=g) for h in (9, 3, 3))  # GQA: 3 query heads per KV head
        outs.append(paged_attention(q, k, v, 0, cache, meta, 0.25))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(outs[0]).all()
