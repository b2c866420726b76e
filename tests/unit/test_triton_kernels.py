"""The Triton kernels against the torch reference (`paged_attention` without kernel metadata).

On a machine without a GPU these run under TRITON_INTERPRET=1 (set in tests/conftest.py): the same
kernel source, interpreted by Triton on the CPU. Shapes are small; what varies is what the kernels
index by: GQA ratios, head sizes that are not powers of two, block sizes smaller and larger than a
key tile and not powers of two, ragged context lengths and chunk lengths, shuffled block tables.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from common.kernels.paged_attention import paged_attention_launch, store_kv  # noqa: E402
from common.kv.kv_cache import FP8, KVCacheSpec, KVScales, PagedKVCache, kv_rotation  # noqa: E402
from common.model.attention import AttentionMetadata, KernelMetadata, paged_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclasses.dataclass
class Step:
    """A random step: sequences with (new tokens, context after the step), their blocks, and q/k/v."""

    cache: PagedKVCache
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qsl: list[int]
    ctx: list[int]
    tables: list[list[int]]
    slots: torch.Tensor


def make_step(
    seqs: list[tuple[int, int]],  # (new tokens, context length after the step)
    n_heads: int,
    n_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    kv_dtype: torch.dtype | None = None,  # the cache's, if not `dtype` (fp8: with per-channel scales)
    offsets: bool = False,  # fp8: and per-channel offsets
    exact_prefill: bool = True,  # fp8: prefill chunks read their own K/V as computed
) -> Step:
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for _, c in seqs]
    num_blocks = sum(need) + spare_blocks
    spec = KVCacheSpec(2, num_blocks, block_size, n_kv, head_dim, kv_dtype or dtype)
    cache = new_cache(spec, dtype, offsets, exact_prefill)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(spec.dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(spec.dtype))
    perm = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered over the cache
    tables, slots, qsl = [], [], [0]
    for (n, c), nb in zip(seqs, need, strict=True):
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c - n, c)]
        qsl.append(qsl[-1] + n)
    T = qsl[-1]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(dtype).to(DEVICE)

    return Step(
        cache,
        rand(T, n_heads, head_dim),
        rand(T, n_kv, head_dim),
        rand(T, n_kv, head_dim),
        qsl,
        [c for _, c in seqs],
        tables,
        torch.tensor(slots, dtype=torch.long, device=DEVICE),
    )


def new_cache(
    spec: KVCacheSpec, compute_dtype: torch.dtype, offsets: bool = False, exact_prefill: bool = True
) -> PagedKVCache:
    """An empty cache; an fp8 one with power-of-two scales varying over (layer, head, channel), K and V
    (exponents -4 .. 3, each channel of a head its own), and with `offsets` per-channel offsets too
    (K's between -3 and 3, V's -2 and 2, most of them comparable to the values' own size)."""
    scales = None
    if spec.dtype in FP8:
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        exps = torch.arange(spec.num_layers * spec.num_kv_heads * spec.head_dim).view(shape) * 5 % 8
        k_off = v_off = None
        if offsets:
            k_off = (exps.float() * 3 % 7 - 3) * 0.75
            v_off = (exps.float() % 5 - 2) * 0.5
        scales = KVScales(torch.exp2(exps.float() - 4), torch.exp2(3 - exps.float()), k_off, v_off)
    return PagedKVCache(
        spec, device=DEVICE, compute_dtype=compute_dtype, scales=scales, exact_prefill=exact_prefill
    )


def run_both(step: Step, layer: int = 1, scale: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch reference output, kernel output); each on its own copy of the cache, compared after."""
    ref_cache = new_cache(step.cache.spec, step.q.dtype, step.cache.offsets, step.cache.exact_prefill)
    ref_cache.k.copy_(step.cache.k)
    ref_cache.v.copy_(step.cache.v)
    tables_t = [torch.tensor(t, dtype=torch.long, device=DEVICE) for t in step.tables]
    ref_meta = AttentionMetadata(step.qsl, step.ctx, tables_t, step.slots)
    ref = paged_attention(step.q, step.k, step.v, layer, ref_cache, ref_meta, scale)
    km = KernelMetadata.build(step.qsl, step.ctx, step.tables, DEVICE)
    meta = AttentionMetadata(step.qsl, step.ctx, [], step.slots, kernel=km)
    out = paged_attention(step.q, step.k, step.v, layer, step.cache, meta, scale)
    assert torch.equal(step.cache.k, ref_cache.k) and torch.equal(step.cache.v, ref_cache.v), (
        "store_kv wrote the cache differently from the reference"
    )
    return ref, out


def tol(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 4e-2


@pytest.mark.parametrize(
    "n_heads,n_kv,head_dim",
    [(4, 4, 16), (4, 2, 16), (6, 2, 16), (9, 3, 64), (8, 1, 32), (16, 2, 24)],
    ids=["mha", "gqa2", "gqa3", "smollm2", "mqa8", "hd24"],
)
@pytest.mark.parametrize("block_size", [4, 16, 5, 128])
def test_decode_matches_reference(n_heads: int, n_kv: int, head_dim: int, block_size: int) -> None:
    seqs = [(1, c) for c in (1, 7, 16, 17, 70, 3)]  # ragged: shorter and longer than a tile / a block
    step = make_step(seqs, n_heads, n_kv, head_dim, block_size, seed=block_size + n_heads)
    ref, out = run_both(step)
    assert (ref - out).abs().max().item() <= tol(torch.float32)


@pytest.mark.parametrize(
    "n_heads,n_kv,head_dim",
    [(4, 4, 16), (6, 2, 16), (9, 3, 64), (8, 1, 32)],
    ids=["mha", "gqa3", "smollm2", "mqa8"],
)
@pytest.mark.parametrize("block_size", [4, 16, 7])
def test_varlen_prefill_with_paged_prefix_matches_reference(
    n_heads: int, n_kv: int, head_dim: int, block_size: int
) -> None:
    # whole prompts (new == context), chunks after a cached prefix, and chunks longer than a query tile
    seqs = [(5, 5), (3, 20), (40, 40), (17, 90), (2, 2)]
    step = make_step(seqs, n_heads, n_kv, head_dim, block_size, seed=7 * block_size + n_kv)
    ref, out = run_both(step)
    assert (ref - out).abs().max().item() <= tol(torch.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_step_decode_and_chunks_together(seed: int) -> None:
    """Selective batching: one step holds decode tokens and prefill chunks; two launches cover it."""
    g = torch.Generator().manual_seed(100 + seed)
    seqs = []
    for _ in range(7):
        ctx = int(torch.randint(1, 60, (1,), generator=g))
        new = (
            1
            if torch.rand(1, generator=g).item() < 0.5
            else int(torch.randint(1, ctx + 1, (1,), generator=g))
        )
        seqs.append((new, ctx))
    step = make_step(seqs, 6, 2, 32, 8, seed=seed)
    ref, out = run_both(step)
    assert (ref - out).abs().max().item() <= tol(torch.float32)


def test_bfloat16_matches_reference_within_bf16_precision() -> None:
    step = make_step([(1, 33), (12, 40), (1, 5)], 9, 3, 64, 16, dtype=torch.bfloat16, seed=3)
    ref, out = run_both(step)
    assert out.dtype == torch.bfloat16
    assert (ref.float() - out.float()).abs().max().item() <= tol(torch.bfloat16)


@pytest.mark.parametrize("exact", [True, False], ids=["exact-prefill", "through-cache"])
@pytest.mark.parametrize("offsets", [False, True], ids=["scaled", "offset"])
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize(
    "seed,n_heads,n_kv,head_dim", [(0, 9, 3, 64), (1, 16, 2, 24)], ids=["smollm2", "hd24"]
)
def test_fp8_cache_matches_the_reference_over_the_same_bytes(
    kv_dtype: torch.dtype, seed: int, n_heads: int, n_kv: int, head_dim: int, offsets: bool, exact: bool
) -> None:
    """Both paths store the same fp8 bytes (run_both checks: rotated, less the offsets, scaled per
    channel), and attention over them with the per-channel scales and offsets applied in the kernel
    (K's scales to the query and q . offset to the scores, V's scales and offset to the output) matches
    the reference's attention over the dequantized values; a head size that is not a power of two pads
    the vectors (masked) and rotates by two Hadamard blocks (24 = 16 + 8). `exact`: the prefill chunks
    read their own K/V as computed (passed to the kernel in the cache's units), the cached prefix from
    the cache, as the reference does."""
    seqs = [(1, 33), (12, 40), (1, 5), (1, 70), (7, 7)]
    step = make_step(
        seqs, n_heads, n_kv, head_dim, 16, seed=seed, kv_dtype=kv_dtype, offsets=offsets, exact_prefill=exact
    )
    step.k[0, 0, :4] = torch.tensor([1e6, -1e6, 3.0, 0.0])  # past the range: saturates, never inf/NaN
    ref, out = run_both(step)
    assert torch.isfinite(out).all() and (ref - out).abs().max().item() <= 1e-4
    # the values past the range (stored rotated: the two outliers spread over the head's channels),
    # counted as they were written
    sc, fmax = step.cache.scales, torch.finfo(kv_dtype).max
    assert sc is not None
    assert sc.k_off is not None and sc.v_off is not None
    past = sum(
        int((((x.cpu() @ kv_rotation(head_dim)) - o[1].cpu()) / s[1].cpu()).abs().gt(fmax).sum())
        for x, s, o in ((step.k, sc.k, sc.k_off), (step.v, sc.v, sc.v_off))
    )
    assert past > 0 and step.cache.clamped == past


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_offsets_in_the_kernel_with_a_softcap_and_split_decode(num_splits: int) -> None:
    """K's offset shifts every score of a query row by q . offset: softmax alone would not notice, a
    soft-cap does, so the kernel adds it; V's is added to the output, through split decode's merge too.
    Against the reference over the same bytes; and the offsets matter: left out, the output differs."""
    seqs = [(1, 150), (6, 90), (1, 3), (40, 70), (1, 66)]
    step = make_step(seqs, 6, 3, 16, 8, seed=9, kv_dtype=torch.float8_e5m2, offsets=True)
    ref_cache = new_cache(step.cache.spec, step.q.dtype, offsets=True)
    ref_cache.k.copy_(step.cache.k)
    ref_cache.v.copy_(step.cache.v)
    tables_t = [torch.tensor(t, dtype=torch.long, device=DEVICE) for t in step.tables]
    ref_meta = AttentionMetadata(step.qsl, step.ctx, tables_t, step.slots)
    want = paged_attention(step.q, step.k, step.v, 1, ref_cache, ref_meta, 0.3, softcap=2.0)
    cache = step.cache
    store_kv(
        cache.quantize(step.k, 1, "k"), cache.quantize(step.v, 1, "v"), cache.k[1], cache.v[1], step.slots
    )
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)
    km = KernelMetadata.build(step.qsl, step.ctx, step.tables, DEVICE)
    q = cache.rotate(step.q)
    sc = cache.scales
    assert sc is not None and sc.k_off is not None and sc.v_off is not None and cache.offsets
    outs = []
    for with_offsets in (True, False):
        out = torch.zeros_like(q)
        common = (q, cache.k[1], cache.v[1], out, km.block_tables, km.query_start_loc, km.context_lens)
        opts = dict(k_scale=sc.k[1], v_scale=sc.v[1], softcap=2.0)
        if with_offsets:
            opts.update(k_off=sc.k_off[1], v_off=sc.v_off[1])
        paged_attention_launch(*common, km.decode_ids, 0.3, 1, decode=True, num_splits=num_splits, **opts)
        own = {"k_new": cache.stored_units(step.k, 1, "k"), "v_new": cache.stored_units(step.v, 1, "v")}
        paged_attention_launch(
            *common, km.prefill_ids, 0.3, km.max_prefill_tokens, decode=False, **opts, **own
        )  # the chunks' own K/V as computed (exact_prefill, the default)
        outs.append(cache.rotate(out))
    assert (outs[0] - want).abs().max().item() <= 1e-4
    assert (outs[1] - want).abs().max().item() > 0.1  # without them: not the same attention
    with pytest.raises(ValueError, match="k_new and v_new come together"):
        paged_attention_launch(
            *common, km.prefill_ids, 0.3, km.max_prefill_tokens, decode=False, **opts, k_new=own["k_new"]
        )
    with pytest.raises(ValueError, match="k_off and v_off"):
        paged_attention_launch(
            *common, km.decode_ids, 0.3, 1, decode=True, k_scale=sc.k[1], v_scale=sc.v[1], k_off=sc.k_off[1]
        )


def test_padding_rows_give_zeros_and_write_nothing() -> None:
    """CUDA-graph padding: context length 0 and slot -1. Zeros out, and no block of the cache changes."""
    step = make_step([(1, 9), (1, 1)], 4, 2, 16, 4, seed=5)
    before_k, before_v = step.cache.k.clone(), step.cache.v.clone()
    slots = step.slots.clone()
    slots[1] = -1
    kc, vc = step.cache.k[1], step.cache.v[1]
    store_kv(step.k, step.v, kc, vc, slots)
    changed = (step.cache.k != before_k).flatten(2).any(-1)  # (layers, blocks)
    first = int(step.slots[0]) // 4
    assert changed.nonzero().tolist() == [[1, first]], "only the one real token's block may change"
    assert torch.equal(step.cache.v[0], before_v[0])
    km = KernelMetadata.build([0, 1, 2], [9, 0], step.tables, DEVICE)
    out = torch.full_like(step.q, 7.0)
    common = (step.q, kc, vc, out, km.block_tables, km.query_start_loc, km.context_lens)
    paged_attention_launch(*common, km.decode_ids, 0.25, 1, decode=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out[0]).all() and not torch.equal(out[0], torch.full_like(out[0], 7.0))


def test_launch_covers_only_the_sequences_it_is_given() -> None:
    step = make_step([(1, 9), (4, 12)], 4, 2, 16, 4, seed=6)
    km = KernelMetadata.build(step.qsl, step.ctx, step.tables, DEVICE)
    out = torch.full_like(step.q, 7.0)
    kc, vc = step.cache.k[1], step.cache.v[1]
    common = (step.q, kc, vc, out, km.block_tables, km.query_start_loc, km.context_lens)
    paged_attention_launch(*common, km.decode_ids, 0.25, 1, decode=True)
    assert km.decode_ids.tolist() == [0] and km.prefill_ids.tolist() == [1] and km.max_prefill_tokens == 4
    assert not torch.equal(out[0], torch.full_like(out[0], 7.0))
    assert torch.equal(out[1:], torch.full_like(out[1:], 7.0)), "the prefill sequence's rows were touched"


def test_bad_shapes_are_refused_with_a_reason() -> None:
    step = make_step([(1, 4)], 4, 2, 16, 4)
    km = KernelMetadata.build(step.qsl, step.ctx, step.tables, DEVICE)
    kc = step.cache.k[1]
    with pytest.raises(ValueError, match="do not divide"):
        q = torch.zeros(1, 3, 16, device=DEVICE)
        args = (q, kc, kc, q.clone(), km.block_tables, km.query_start_loc, km.context_lens, km.decode_ids)
        paged_attention_launch(*args, 1.0, 1, decode=True)
    with pytest.raises(ValueError, match="contiguous"):
        k = torch.zeros(1, 16, 2, device=DEVICE).transpose(1, 2)  # head dim strided
        store_kv(k, k, kc, kc, torch.zeros(1, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("n_heads,n_kv", [(9, 3), (8, 1)], ids=["smollm2", "mqa8"])
def test_split_context_decode_matches_reference(num_splits: int, n_heads: int, n_kv: int) -> None:
    """Flash-decoding style: each sequence's context spread over num_splits programs, partials merged.
    Contexts from 1 token (most splits empty) to 300 (several key tiles per split)."""
    seqs = [(1, c) for c in (1, 40, 64, 65, 300, 129)]
    step = make_step(seqs, n_heads, n_kv, 32, 16, seed=num_splits)
    ref, _ = run_both(step)  # also writes the new K/V into step.cache
    km = KernelMetadata.build(step.qsl, step.ctx, step.tables, DEVICE)
    out = torch.full_like(step.q, 7.0)
    common = (
        step.q,
        step.cache.k[1],
        step.cache.v[1],
        out,
        km.block_tables,
        km.query_start_loc,
        km.context_lens,
    )
    paged_attention_launch(*common, km.decode_ids, 0.3, 1, decode=True, num_splits=num_splits)
    assert (ref - out).abs().max().item() <= tol(torch.float32)
    # a padding row (context 0): every split empty, the merge must give zeros, not NaN
    km0 = KernelMetadata.build([0, 1], [0], [[0]], DEVICE)
    out0 = torch.full_like(step.q[:1], 7.0)
    args0 = (step.q[:1], step.cache.k[1], step.cache.v[1], out0, km0.block_tables, km0.query_start_loc)
    paged_attention_launch(
        *args0, km0.context_lens, km0.decode_ids, 0.3, 1, decode=True, num_splits=num_splits
    )
    assert torch.equal(out0, torch.zeros_like(out0))


def test_decode_splits_depend_on_the_batch_only() -> None:
    from common.kernels.paged_attention import MAX_SPLITS, decode_splits

    assert decode_splits(4, 3, torch.device("cpu")) == 1
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        assert decode_splits(1, 1, dev) == MAX_SPLITS
        assert decode_splits(256, 8, dev) == 1


@pytest.mark.parametrize(
    "n_heads,rank,rope,block_size,dtype",
    [
        (16, 32, 16, 4, torch.float32),  # width 48: halves 24, the second half partly value (8 of 24)
        (20, 40, 8, 5, torch.float32),  # heads over two programs; width 48, halves 24, value 16 of the second
        (4, 48, 16, 16, torch.float32),  # width 64: halves 32, the second half 16 value, 16 rope
        (16, 32, 16, 4, torch.bfloat16),
    ],
    ids=["v2lite-ish", "two-head-tiles", "few-heads", "bf16"],
)
def test_mla_decode_kernel_matches_the_latent_torch_path(
    n_heads: int, rank: int, rope: int, block_size: int, dtype: torch.dtype
) -> None:
    """The MLA decode kernel (common/kernels/mla_attention.py) against `mla_paged_attention`'s torch
    path: ragged contexts over shuffled blocks, every row one new token, the new latents written by the
    torch path first (as the model does), then the kernel reads the same cache."""
    from common.kernels.mla_attention import mla_decode_launch
    from common.model.mla import mla_paged_attention

    width = rank + rope
    half = width // 2
    g = torch.Generator().manual_seed(n_heads + rank)
    ctx = [1, 7, 16, 40, 3, 33]
    need = [-(-c // block_size) for c in ctx]
    num_blocks = sum(need) + 2
    spec = KVCacheSpec(2, num_blocks, block_size, 1, half, dtype, mla=(rank, rope))
    cache = PagedKVCache(spec, device=DEVICE, compute_dtype=dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for c, nb in zip(ctx, need, strict=True):
        table, perm = perm[:nb], perm[nb:]
        tables.append(torch.tensor(table, dtype=torch.long, device=DEVICE))
        slots.append(table[(c - 1) // block_size] * block_size + (c - 1) % block_size)
    T = len(ctx)
    q = torch.randn((T, n_heads, width), generator=g).to(dtype).to(DEVICE)
    latent = torch.randn((T, width), generator=g).to(dtype).to(DEVICE)
    meta = AttentionMetadata(list(range(T + 1)), ctx, tables, torch.tensor(slots, device=DEVICE))
    ref = mla_paged_attention(q, latent, rank, 1, cache, meta, 0.2)  # writes the new latents too
    batch = meta.decode_batch(block_size)
    assert batch is not None
    out = torch.full_like(ref, float("nan"))
    mla_decode_launch(q, cache.k[1], cache.v[1], out, batch.rows, batch.blocks, batch.lens, 0.2)
    assert not out.isnan().any(), "every decode row written"
    assert (ref.float() - out.float()).abs().max().item() <= tol(dtype)


def test_mla_decode_kernel_refuses_what_it_does_not_run() -> None:
    from common.kernels.mla_attention import mla_decode_launch

    q = torch.zeros((2, 16, 48))
    cache = torch.zeros((4, 4, 1, 24))
    rows, blocks, lens = torch.tensor([0, 1]), torch.zeros((2, 1), dtype=torch.long), torch.tensor([1, 1])
    with pytest.raises(ValueError, match="rank"):
        mla_decode_launch(q, cache, cache, torch.zeros((2, 16, 20)), rows, blocks, lens, 1.0)
    with pytest.raises(ValueError, match="fp8 runs on the torch path"):
        fp8 = cache.to(torch.float8_e4m3fn)
        mla_decode_launch(q, fp8, fp8, torch.zeros((2, 16, 32)), rows, blocks, lens, 1.0)
