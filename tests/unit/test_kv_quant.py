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


def test_offsets_are_subtracted_before_scaling_and_added_back_on_reads() -> None:
    """(x R - off) / scale is stored; reads add the offset back. For values clustered around a channel's
    bias, the error is then relative to the distance from the offset, not to the value: an offset at
    the bias makes the read-back error several times smaller than none does, same scales."""
    spec = dataclasses.replace(SPEC, dtype=torch.float8_e5m2)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(2, 8, generator=g) * 50  # per (head, channel) of the rotated K and V
    rk = bias + torch.randn(6, 2, 8, generator=g)
    rv = -bias + torch.randn(6, 2, 8, generator=g)
    r = kv_rotation(8)
    slots, table = torch.tensor([0, 1, 2, 3, 8, 9]), torch.tensor([0, 2])
    errors = []
    for off in (None, bias.round()):
        sc = torch.full((2, 2, 8), 2.0**-4)
        k_off = None if off is None else torch.stack([torch.zeros(2, 8), off])  # layer 1's
        v_off = None if off is None else torch.stack([torch.zeros(2, 8), -off])
        kv = PagedKVCache(spec, compute_dtype=torch.float32, scales=KVScales(sc, sc, k_off, v_off))
        assert kv.offsets == (off is not None)
        kv.write(1, slots, rk @ r, rv @ r)
        stored = kv.k[1].view(-1, 2, 8)[slots].float()
        m = torch.zeros(2, 8) if off is None else off
        torch.testing.assert_close(stored, ((rk - m) / 2.0**-4).to(spec.dtype).float())
        got_k, got_v = kv.gather(1, table, 6, rotated=True)
        assert ((got_k - rk).abs() <= 2**-3 * (rk - m).abs() + 1e-6).all()
        assert ((got_v - rv).abs() <= 2**-3 * (rv + m).abs() + 1e-6).all()
        back_k, _ = kv.gather(1, table, 6)  # rotated back out of the cache's basis
        torch.testing.assert_close(back_k, got_k @ r)
        errors.append(((got_k - rk).abs().mean() + (got_v - rv).abs().mean()).item())
    assert errors[1] < errors[0] / 4, errors


def test_calibrated_offsets_sit_on_a_coarse_grid_and_the_scales_cover_what_is_left() -> None:
    g = torch.Generator().manual_seed(4)
    lo = -torch.rand(2, 3, 8, generator=g) * 10
    hi = torch.rand(2, 3, 8, generator=g) * 10 + 0.5
    center = lo + (hi - lo) * torch.rand(2, 3, 8, generator=g)
    stats = quant.KVStats(lo, hi, center, 2 * lo, 2 * hi, 2 * center)
    for dtype in FP8:
        sc = quant.calibrate(stats, dtype)
        assert sc.k_off is not None and sc.v_off is not None
        amax = torch.maximum(lo.abs(), hi.abs())
        grid = torch.exp2(torch.ceil(torch.log2(amax)) - quant.OFFSET_BITS)
        steps = sc.k_off / grid
        assert torch.equal(steps, steps.round()) and (steps.abs() <= 2**quant.OFFSET_BITS).all()
        assert ((sc.k_off - center).abs() <= grid / 2).all()  # the weighted mean, rounded
        left = torch.maximum(hi - sc.k_off, sc.k_off - lo)  # what the scale must hold
        need = quant.HEADROOM * left / torch.finfo(dtype).max
        assert torch.equal(sc.k, torch.exp2(sc.k.log2().round())) and (sc.k >= need).all()
        assert (sc.k < 2 * need).all()
        # the same weights summed in another order round alike: a prefill and a decode service agree
        nudged = quant.KVStats(lo, hi, center * (1 + 1e-6), 2 * lo, 2 * hi, 2 * center)
        again = quant.calibrate(nudged, dtype)
        assert again.digest() == sc.digest() and again.k_off is not None
        assert torch.equal(again.k_off, sc.k_off)
    with pytest.raises(ValueError, match="only"):
        quant.calibrate(stats, torch.bfloat16)


def test_offsets_are_in_the_digest_sliced_by_head_and_checked_against_the_scales() -> None:
    k, v = channel_scales(SPEC).k, channel_scales(SPEC).v
    plain = KVScales(k, v)
    assert KVScales(k, v, torch.zeros_like(k), torch.zeros_like(v)).digest() == plain.digest()  # zero: none
    off = torch.zeros_like(k)
    off[1, 1, 3] = 0.5
    with_k = KVScales(k, v, off, torch.zeros_like(v))
    with_v = KVScales(k, v, torch.zeros_like(k), off)
    assert len({plain.digest(), with_k.digest(), with_v.digest()}) == 3  # K's and V's told apart
    tp_rank1 = with_k.heads(1, 2)  # a tensor-parallel rank's KV head
    assert tp_rank1.k_off is not None and torch.equal(tp_rank1.k_off, off[:, 1:2])
    assert torch.equal(tp_rank1.k, k[:, 1:2]) and plain.heads(0, 1).k_off is None
    spec = dataclasses.replace(SPEC, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_off"):
        PagedKVCache(spec, scales=KVScales(k, v, torch.zeros(2, 2, 4), None))
    kv = PagedKVCache(spec, scales=KVScales(k, v))  # absent offsets: zeros, and the kernel skips them
    assert kv.scales is not None and kv.scales.k_off is not None and not kv.scales.k_off.any()
    assert not kv.offsets


def test_the_calibration_centers_each_channel_on_the_keys_attention_reads() -> None:
    """kv_stats: lo <= center <= hi per channel; a one-token sequence draws all of its own attention, so
    run alone (or twice, back to back: each sequence sees only itself) its center is its rotated K and
    V; kv_amax is the range's larger end."""
    from common.model.calibration import kv_amax, kv_stats
    from tests.unit.test_tensor_parallel import tiny, whole_model

    model = whole_model(tiny(tied=False, bias=False))
    st = kv_stats(model, [[5, 9, 2, 7, 7, 1], [3, 4]])
    for lo, c, hi in ((st.k_lo, st.k_center, st.k_hi), (st.v_lo, st.v_center, st.v_hi)):
        assert lo.shape == (2, 3, 8) and (lo <= c + 1e-6).all() and (c <= hi + 1e-6).all()
        assert (hi - lo).gt(0).all()
    k_amax, _ = kv_amax(model, [[5, 9, 2, 7, 7, 1], [3, 4]])
    torch.testing.assert_close(k_amax, torch.maximum(st.k_lo.abs(), st.k_hi.abs()))
    one, twice = kv_stats(model, [[5]]), kv_stats(model, [[5], [5]])
    for s in (one, twice):
        torch.testing.assert_close(s.k_center, one.k_lo, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s.v_center, one.v_hi, rtol=1e-5, atol=1e-6)
    assert torch.equal(one.k_lo, one.k_hi)
