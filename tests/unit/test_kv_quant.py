"""fp8 and narrower KV caches: what is stored, what reads give back, the scales and the preflight record."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.engine.llm_engine import kv_compat
from common.kv import quant
from common.kv.kv_cache import KVCacheSpec, KVScales, PagedKVCache
from tests.unit.test_kv_transfer_api import MODEL

SPEC = KVCacheSpec(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)


def fp8_cache(dtype: torch.dtype = torch.float8_e4m3fn) -> PagedKVCache:
    scales = KVScales(torch.tensor([[0.25, 1.0], [2.0, 0.5]]), torch.tensor([[1.0, 0.125], [1.0, 1.0]]))
    return PagedKVCache(dataclasses.replace(SPEC, dtype=dtype), compute_dtype=torch.float32, scales=scales)


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float8_e4m3fn, 2**-4), (torch.float8_e5m2, 2**-3)])
def test_fp8_stores_scaled_values_and_reads_them_back_within_the_format_precision(
    dtype: torch.dtype, rel: float
) -> None:
    kv = fp8_cache(dtype)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    slots = torch.tensor([0, 1, 2, 3, 8, 9])  # blocks 0 and 2
    kv.write(1, slots, k, v)
    # what is stored is x / scale (layer 1: K heads 2.0 and 0.5)
    stored = kv.k[1].view(-1, 2, 8)[slots].float()
    torch.testing.assert_close(stored, (k / torch.tensor([2.0, 0.5])[None, :, None]).to(dtype).float())
    got_k, got_v = kv.gather(1, torch.tensor([0, 2]), 6)
    assert got_k.dtype == torch.float32
    order = [0, 1, 2, 3, 4, 5]  # blocks 0 and 2 in table order are exactly slots 0-3, 8-9
    assert torch.allclose(got_k, k[order], rtol=rel, atol=1e-2)
    assert torch.allclose(got_v, v[order], rtol=rel, atol=1e-2)
    rk, rv = kv.read_blocks(1, torch.tensor([[0, 2]]))  # the batched-decode read: same values
    torch.testing.assert_close(rk.view(-1, 2, 8)[:6], got_k)
    torch.testing.assert_close(rv.view(-1, 2, 8)[:6], got_v)


def test_values_past_the_fp8_range_saturate_and_never_become_inf_or_nan() -> None:
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kv = fp8_cache(dtype)
        big = torch.full((1, 2, 8), 1e9)
        kv.write(0, torch.tensor([5]), big, -big)
        k, v = kv.gather(0, torch.tensor([1]), 2)
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
        fmax = torch.finfo(dtype).max
        assert k[1, 0, 0] == fmax * 0.25 and v[1, 1, 0] == -fmax * 0.125


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


def test_the_preflight_record_carries_the_dtype_and_the_scales_exponents() -> None:
    kv = fp8_cache()
    assert kv.scales is not None and kv.scales.digest() == "-2,0,1,-1,0,-3,0,0"
    spec = kv.spec
    a = kv_compat(MODEL, spec, kv.scales.digest())
    other = KVScales(kv.scales.k * 2, kv.scales.v)
    assert a.mismatches(kv_compat(MODEL, spec, other.digest())) == [
        "kv_scales ('-2,0,1,-1,0,-3,0,0' != '-1,1,2,0,0,-3,0,0')"
    ]
    plain = kv_compat(MODEL, dataclasses.replace(spec, dtype=torch.float32))
    assert a.mismatches(plain) == [
        "dtype ('float8_e4m3fn' != 'float32')",
        "kv_scales ('-2,0,1,-1,0,-3,0,0' != '')",
    ]
