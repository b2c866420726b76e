"""The torch paged attention's batched decode call against its per-sequence path (the reference the
Triton kernels are also held to)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.kv.kv_cache import KVCacheSpec, KVScales, PagedKVCache
from common.model.attention import AttentionMetadata, decode_attention, paged_attention


def _step(
    new: list[int],
    ctx: list[int],
    bs: int,
    seed: int,
    kv_dtype: torch.dtype = torch.float32,
    exact_prefill: bool = True,
) -> tuple[AttentionMetadata, PagedKVCache]:
    """A step of sequences with `new` tokens each and `ctx` tokens in KV after it, on shuffled blocks of
    a random cache (an fp8 one: stored rotated, with per-channel scales 2^-3 .. 2^0 and offsets)."""
    g = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(1, 64, bs, 3, 16, kv_dtype)
    exps = -(torch.arange(3 * 16).view(1, 3, 16) % 4).float()
    offs = exps * 0.75 + 1
    scales = (
        KVScales(torch.exp2(exps), torch.exp2(exps.flip(-1)), offs, -offs) if kv_dtype.itemsize == 1 else None
    )
    cache = PagedKVCache(
        spec, device="cpu", compute_dtype=torch.float32, scales=scales, exact_prefill=exact_prefill
    )
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(kv_dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(kv_dtype))
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
@pytest.mark.parametrize(
    ("kv_dtype", "exact"),
    [(torch.float32, True), (torch.float8_e4m3fn, True), (torch.float8_e4m3fn, False)],
    ids=["fp32", "fp8", "fp8-through-cache"],
)
def test_batched_decode_attention_matches_the_per_sequence_path(
    monkeypatch: pytest.MonkeyPatch, new: list[int], ctx: list[int], kv_dtype: torch.dtype, exact: bool
) -> None:
    """fp8: the cache holds K and V rotated (less per-channel offsets) and attention reads them so,
    rotating the query and its output instead; the result is attention over K and V as read back
    (`gather`: the offsets added, rotated back), except that a prefill chunk (more than one new token)
    sees its own K and V as computed unless `exact_prefill` is off."""
    outs = []
    for batched in (True, False):
        meta, cache = _step(new, ctx, bs=8, seed=sum(ctx), kv_dtype=kv_dtype, exact_prefill=exact)
        if not batched:
            monkeypatch.setattr(AttentionMetadata, "decode_batch", lambda self, bs: None)
        g = torch.Generator().manual_seed(1)
        t = sum(new)
        q, k, v = (torch.randn(t, h, 16, generator=g) for h in (9, 3, 3))  # GQA: 3 query heads per KV head
        outs.append(paged_attention(q, k, v, 0, cache, meta, 0.25))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(outs[0]).all()
    # and both against plain attention in float64 over each sequence's keys, read back from the cache
    meta, cache = _step(new, ctx, bs=8, seed=sum(ctx), kv_dtype=kv_dtype, exact_prefill=exact)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(new), h, 16, generator=g) for h in (9, 3, 3))
    cache.write(0, meta.slot_mapping, k, v)
    want = torch.empty_like(q)
    for i, (n, c) in enumerate(zip(new, ctx, strict=True)):
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        kc, vc = cache.gather(0, meta.block_tables[i], c)
        if n > 1 and exact:
            kc[c - n :], vc[c - n :] = k[rows], v[rows]
        kc, vc = (x.double().repeat_interleave(3, dim=1) for x in (kc, vc))
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), kc) * 0.25  # (9, n, c)
        scores.masked_fill_(torch.arange(c)[None, :] > torch.arange(c - n, c)[:, None], float("-inf"))
        want[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vc).float()
    torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_sdpa_with_grouped_query_heads(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    d, n_heads, n_kv, length, hd = 3, 9, 3, 21, 16
    q = torch.randn(d, n_heads, hd, generator=g).to(dtype)
    k, v = (torch.randn(d, n_kv, length, hd, generator=g).to(dtype) for _ in range(2))
    for i, n in enumerate((21, 5, 13)):  # each sequence against its own keys
        got = decode_attention(q[i], k[i, :, :n], v[i, :, :n], 0.25)
        want = F.scaled_dot_product_attention(
            q[i : i + 1].float().unsqueeze(2), k[i : i + 1, :, :n].float(), v[i : i + 1, :, :n].float(),
            scale=0.25, enable_gqa=True,
        ).squeeze(2)[0]  # fmt: skip
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert got.shape == (n_heads, hd)
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def _reference(
    q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata, window: int | None, softcap: float | None
) -> torch.Tensor:
    """Plain attention in float64 over each sequence's keys read back from the cache, with a sliding
    window (a query at position p sees keys p - window + 1 .. p) and soft-capped scores."""
    want = torch.empty_like(q)
    group = q.shape[1] // cache.k.shape[-2]
    for i, c in enumerate(meta.context_lens):
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        n = rows.stop - rows.start
        kc, vc = (
            x.double().repeat_interleave(group, dim=1) for x in cache.gather(0, meta.block_tables[i], c)
        )
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), kc) * 0.25
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos, kpos = torch.arange(c - n, c)[:, None], torch.arange(c)[None, :]
        hidden = kpos > qpos
        if window is not None:
            hidden |= kpos <= qpos - window
        scores.masked_fill_(hidden, float("-inf"))
        want[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vc).float()
    return want


# decodes (batched), one lone decode, prefill chunks over a paged prefix, ctx both below and above window
STEPS = {
    "mixed": ([1, 5, 1, 1, 3, 9], [30, 5, 2, 17, 12, 40]),
    "lone-decode": ([4, 1], [4, 29]),
}


@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
@pytest.mark.parametrize(("window", "softcap"), [(7, None), (None, 1.5), (8, 2.0), (1, None)])
def test_sliding_window_and_softcap_match_plain_attention(
    step: tuple[list[int], list[int]], window: int | None, softcap: float | None
) -> None:
    new, ctx = step
    meta, cache = _step(new, ctx, bs=8, seed=sum(ctx))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(new), h, 16, generator=g) * 2 for h in (9, 3, 3))
    out = paged_attention(q, k, v, 0, cache, meta, 0.25, window, softcap)
    torch.testing.assert_close(out, _reference(q, cache, meta, window, softcap), rtol=1e-5, atol=1e-5)
    if window is not None:  # the window matters here: without it the rows past it differ
        meta2, cache2 = _step(new, ctx, bs=8, seed=sum(ctx))
        full = paged_attention(q, k, v, 0, cache2, meta2, 0.25, None, softcap)
        assert (full - out).abs().max() > 1e-2


@pytest.mark.parametrize(("window", "softcap"), [(7, None), (None, 1.5), (13, 2.0)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_kernel_window_and_softcap_match_the_reference(
    window: int | None, softcap: float | None, num_splits: int
) -> None:
    """The Triton kernels (interpreted on a CPU) against the torch reference above, key tiles (64
    positions) skipped before a window included: contexts up to 150 tokens."""
    pytest.importorskip("triton")
    from common.kernels.paged_attention import paged_attention_launch, store_kv
    from common.model.attention import KernelMetadata

    new, ctx = [1, 6, 1, 70, 1], [150, 90, 3, 140, 66]
    meta, cache = _step(new, ctx, bs=8, seed=3)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(new), h, 16, generator=g) * 2 for h in (6, 3, 3))
    ref_cache = PagedKVCache(cache.spec, device="cpu")
    ref_cache.k.copy_(cache.k)
    ref_cache.v.copy_(cache.v)
    want = paged_attention(q, k, v, 0, ref_cache, meta, 0.25, window, softcap)
    km = KernelMetadata.build(meta.query_start_loc, ctx, [t.tolist() for t in meta.block_tables], q.device)
    store_kv(k, v, cache.k[0], cache.v[0], meta.slot_mapping)
    out = torch.zeros_like(q)
    common = (q, cache.k[0], cache.v[0], out, km.block_tables, km.query_start_loc, km.context_lens)
    opts = {"window": window, "softcap": softcap}
    paged_attention_launch(*common, km.decode_ids, 0.25, 1, decode=True, num_splits=num_splits, **opts)
    paged_attention_launch(*common, km.prefill_ids, 0.25, km.max_prefill_tokens, decode=False, **opts)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
