"""fp8 and narrower KV caches: what is stored, what reads give back, the scales and the preflight record."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.engine.llm_engine import kv_compat
from common.kv import quant
from common.kv.kv_cache import FP8, KVCacheSpec, KVScales, PagedKVCache, kv_rotation
from tests.unit.test_kv_transfer_api import MODEL

SPEC = KVCacheSpec(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)


def fp8_cache(dtype: torch.dtype = torch.float8_e4m3fn) -> PagedKVCache:
    """Per-head scales (repeated over the channels): layer 1's K heads 2.0 and 0.5, ..."""
    scales = KVScales(torch.tensor([[0.25, 1.0], [2.0, 0.5]]), torch.tensor([[1.0, 0.125], [1.0, 1.0]]))
    return PagedKVCache(dataclasses.replace(SPEC, dtype=dtype), compute_dtype=torch.float32, scales=scales)


def channel_scales(spec: KVCacheSpec) -> KVScales:
    """A different power of two for every (layer, head, channel): exponents -6 .. 5."""
    exps = torch.arange(spec.num_layers * spec.num_kv_heads * spec.head_dim).view(
        spec.num_layers, spec.num_kv_heads, spec.head_dim
    )
    return KVScales(torch.exp2((exps * 7 % 12 - 6).float()), torch.exp2((5 - exps * 5 % 12).float()))


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float8_e4m3fn, 2**-4), (torch.float8_e5m2, 2**-3)])
def test_fp8_stores_rotated_scaled_values_and_reads_them_back_within_the_format_precision(
    dtype: torch.dtype, rel: float
) -> None:
    """Stored: x rotated (kv_rotation), divided by its channel's scale. Read back in the rotated basis:
    each value within the format's precision of its channel; rotated back: each (token, head) vector
    within that precision in norm (the rotation keeps norms)."""
    spec = dataclasses.replace(SPEC, dtype=dtype)
    scales = channel_scales(spec)
    kv = PagedKVCache(spec, compute_dtype=torch.float32, scales=scales)
    g = torch.Generator().manual_seed(0)
    # each rotated channel about the size of its scale times 100: in the format's normal range
    rk = torch.randn(6, 2, 8, generator=g) * scales.k[1] * 100
    rv = torch.randn(6, 2, 8, generator=g) * scales.v[1] * 100
    r = kv_rotation(8)
    k, v = rk @ r, rv @ r  # the rotation is its own inverse: k @ r == rk
    slots = torch.tensor([0, 1, 2, 3, 8, 9])  # blocks 0 and 2
    kv.write(1, slots, k, v)
    stored = kv.k[1].view(-1, 2, 8)[slots].float()
    torch.testing.assert_close(stored, ((k @ r) / scales.k[1]).to(dtype).float())
    table = torch.tensor([0, 2])  # blocks 0 and 2 in table order are exactly slots 0-3, 8-9
    in_basis_k, in_basis_v = kv.gather(1, table, 6, rotated=True)
    assert ((in_basis_k - rk).abs() <= rel * rk.abs() + 1e-6).all()
    assert ((in_basis_v - rv).abs() <= rel * rv.abs() + 1e-6).all()
    got_k, got_v = kv.gather(1, table, 6)
    assert got_k.dtype == torch.float32
    torch.testing.assert_close(got_k, in_basis_k @ r)
    assert ((got_k - k).norm(dim=-1) <= rel * k.norm(dim=-1)).all()
    assert ((got_v - v).norm(dim=-1) <= rel * v.norm(dim=-1)).all()
    bk, bv = kv.read_blocks(1, torch.tensor([[0, 2]]))  # the batched-decode read: same values
    torch.testing.assert_close(bk.view(-1, 2, 8)[:6], got_k)
    torch.testing.assert_close(bv.view(-1, 2, 8)[:6], got_v)


def test_values_past_the_fp8_range_saturate_and_never_become_inf_or_nan() -> None:
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kv = fp8_cache(dtype)
        big = torch.full((1, 2, 8), 1e6)  # rotated: (1e6 * sqrt(8), 0, ..., 0) per head
        kv.write(0, torch.tensor([5]), big, -big)
        k, v = kv.gather(0, torch.tensor([1]), 2, rotated=True)
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
        fmax = torch.finfo(dtype).max
        assert k[1, 0, 0] == fmax * 0.25 and v[1, 1, 0] == -fmax * 0.125  # saturated at the largest
        assert kv.clamped == 4  # K and V, both heads: one rotated channel each


def test_an_fp8_cache_needs_scales_and_narrower_floats_are_casts() -> None:
    with pytest.raises(ValueError, match="needs scales"):
        PagedKVCache(dataclasses.replace(SPEC, dtype=torch.float8_e4m3fn))
    kv = PagedKVCache(dataclasses.replace(SPEC, dtype=torch.bfloat16), compute_dtype=torch.float32)
    x = torch.randn(1, 2, 8)
    kv.write(0, torch.tensor([0]), x, x)
    k, _ = kv.gather(0, torch.tensor([0]), 1)
    assert k.dtype == torch.float32 and torch.equal(k, x.to(torch.bfloat16).float())


def test_kv_dtype_names_and_capacity() -> None:
    assert quant.kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert quant.kv_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="fp8_e5m2"):
        quant.kv_dtype("int4", torch.float32)
    fp32, fp8 = SPEC.bytes_per_block, dataclasses.replace(SPEC, dtype=torch.float8_e5m2).bytes_per_block
    assert fp32 == 4 * fp8  # four times the blocks in the same memory


def test_the_rotation_is_orthogonal_symmetric_and_exact_for_any_head_size() -> None:
    for hd in (1, 8, 24, 64, 80, 96, 128):
        r = kv_rotation(hd)
        assert torch.equal(r, r.T)
        torch.testing.assert_close(r @ r, torch.eye(hd), atol=1e-6, rtol=0)
    assert torch.equal(kv_rotation(64).abs(), torch.full((64, 64), 0.125))  # +-1/8: exact
    assert PagedKVCache(SPEC).rotation is None  # only fp8 caches rotate
    x = torch.randn(3, 2, 8)
    assert PagedKVCache(SPEC).rotate(x) is x


def test_the_rotation_cuts_the_score_error_of_a_key_with_an_outlier_channel() -> None:
    """Why an fp8 cache rotates: K with one channel far larger than the rest (real models' K has a few)
    and queries that weigh it. Stored as is, each score carries that channel's rounding (fp8 keeps 3
    mantissa bits) almost whole; rotated, every channel holds a share of it and the roundings average
    out. Same per-channel calibration either way."""
    g = torch.Generator().manual_seed(1)
    spec = KVCacheSpec(1, 3, 16, 1, 64, torch.float8_e4m3fn)
    k = torch.randn(48, 1, 64, generator=g)
    k[:, :, 5] = 20 + torch.randn(48, 1, generator=g)
    q = torch.randn(20, 64, generator=g)
    q[:, 5] *= 5
    r = kv_rotation(64)
    slots, table = torch.arange(48), torch.tensor([0, 1, 2])
    errors = []
    for basis in (torch.eye(64), r):  # the identity: what a cache that did not rotate would store
        amax = (k @ basis).abs().amax(0)[None]  # (1 layer, 1 head, 64)
        kv = PagedKVCache(spec, compute_dtype=torch.float32, scales=quant.scales(amax, amax, spec.dtype))
        kv.rotation = basis
        kv.write(0, slots, k, k)
        got, _ = kv.gather(0, table, 48)
        errors.append((q @ got[:, 0].T - q @ k[:, 0].T).abs().mean())
    assert errors[1] < errors[0] / 3, errors  # measured: 2.33 -> 0.51


def test_calibrated_scales_are_the_power_of_two_at_or_above_headroom_times_amax() -> None:
    amax = torch.tensor([[[1e-9, 0.3, 1.0, 100.0]]])
    for dtype in FP8:
        sc = quant.scales(amax, amax, dtype)
        assert sc.k.shape == (1, 1, 4) and torch.equal(sc.k, torch.exp2(sc.k.log2().round()))
        need = quant.HEADROOM * amax.clamp(min=1e-6) / torch.finfo(dtype).max
        assert (sc.k >= need).all() and (sc.k < 2 * need).all()


def test_the_clamp_counter_counts_values_written_past_the_fp8_range() -> None:
    r = kv_rotation(8)
    for dtype in FP8:
        kv = fp8_cache(dtype)
        fmax = torch.finfo(dtype).max
        x = torch.ones(3, 2, 8)
        kv.write(0, torch.tensor([0, 1, 2]), x, x)
        assert kv.clamped == 0
        # values as stored (rotated); the rotation is its own inverse, so `@ r` gives what to write
        k = torch.ones(2, 2, 8)
        k[0, 1, 5] = 1e9  # one outlier past the range (layer 0, K head 1: scale 1.0)
        k[1, 0, :2] = -fmax * 0.25 * 2  # two more (head 0: scale 0.25), negative
        v = torch.full((2, 2, 8), fmax * 0.125 * 0.999)  # V head 1 (scale 0.125) just inside: kept
        kv.write(0, torch.tensor([3, 4]), k @ r, v @ r)
        assert kv.clamped == 3
        got, _ = kv.gather(0, torch.tensor([0, 1]), 5, rotated=True)
        assert got[3, 1, 5] == fmax  # saturated, and counted
    assert PagedKVCache(SPEC).clamped == 0  # not fp8: nothing to clamp


def test_scales_are_checked_against_the_cache_shape() -> None:
    spec = dataclasses.replace(SPEC, dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="this cache needs"):
        PagedKVCache(spec, scales=KVScales(torch.ones(2, 3, 8), torch.ones(2, 3, 8)))  # 3 heads, not 2
    with pytest.raises(ValueError, match="want"):
        PagedKVCache(spec, scales=KVScales(torch.ones(2, 2, 4), torch.ones(2, 2, 4)))  # head_dim 4, not 8
    # one scale per head is repeated over the channels
    kv = fp8_cache()
    assert kv.scales is not None and kv.scales.k.shape == (2, 2, 8)
    assert torch.equal(kv.scales.k[1, :, 5], torch.tensor([2.0, 0.5]))


def test_the_preflight_record_carries_the_dtype_and_a_short_hash_of_the_scales_exponents() -> None:
    kv = fp8_cache()
    assert kv.scales is not None
    digest = kv.scales.digest()
    assert digest.startswith("sha256:") and len(digest) == 23
    assert KVScales(kv.scales.k.clone(), kv.scales.v.clone()).digest() == digest  # exact, repeatable
    spec = kv.spec
    a = kv_compat(MODEL, spec, digest)
    one_channel = kv.scales.k.clone()
    one_channel[1, 0, 7] *= 2  # one channel's exponent differs
    other = KVScales(one_channel, kv.scales.v)
    assert other.digest() != digest
    assert a.mismatches(kv_compat(MODEL, spec, other.digest())) == [
        f"kv_scales ({digest!r} != {other.digest()!r})"
    ]
    swapped = KVScales(kv.scales.v, kv.scales.k)  # K's and V's are told apart
    assert swapped.digest() != digest
    plain = kv_compat(MODEL, dataclasses.replace(spec, dtype=torch.float32))
    assert a.mismatches(plain) == [
        "dtype ('float8_e4m3fn' != 'float32')",
        f"kv_scales ({digest!r} != '')",
    ]
