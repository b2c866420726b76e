"""fp8 KV cache scales and offsets: per (layer, KV head, channel), for K and for V, calibrated from the
model.

A stored value is `(x R - off) / scale` (R: the fixed rotation of common/kv/kv_cache.py `kv_rotation`),
clamped to the fp8 format's range. The calibration (`CALIBRATION_TEXT` as plain text and rendered
through the model's chat template, so that its special tokens and default system prompt are covered:
common/model/calibration.py `calibration_ids`) runs once through the model with its own attention, no
cache, and measures each channel of x R: its least and largest value, and its mean weighted by the
attention each key drew (`KVStats`). `calibrate` turns that into:

* the offset: that weighted mean, rounded to a multiple of the power of two at or above
  amax / 2^OFFSET_BITS (amax: the channel's largest |x R|). fp8's error is relative to the stored
  value, so its finest steps go where the keys attention weighs most lie (why weighted, not the plain
  mean: common/kv/kv_cache.py). Rounded onto that coarse grid, an offset is an exact fp32 value that
  a prefill and a decode service compute alike from the same weights even when their sums round a
  little differently (a difference moves it only if it straddles a grid midpoint);
* the scale: the power of two at or above `HEADROOM * amax' / fp8_max`, amax' the largest |x R - off|
  of the channel. Per channel, so that no channel's range is set by another's. (What fp8 costs in
  accuracy is its mantissa, not the scales: floats keep the same relative precision at any scale, and
  on SmolLM2 per-channel scales alone changed the KL divergence to fp32 KV by 3 %; the rotation is
  what cut it, see kv_cache.py.)

Attention pays nothing for per-channel scales: K's multiply the query per channel before q . k, V's the
output (common/kernels/paged_attention.py; the torch path reads dequantized); the offsets cost one dot
per query row (K) and one add per output row (V).

Powers of two cost no precision to divide and multiply by, and are exact to compare: a prefill and a
decode service that loaded the same weights compute the same scales and offsets, and the transfer
preflight checks that they did (`KVScales.digest`, a hash of the exponents and offsets). HEADROOM
leaves room for prompts that push a channel past what the calibration did; past that, values saturate
at the format's largest (never inf or NaN) and are counted (`PagedKVCache.clamped`).

The KV layer does not run the model: common/model/calibration.py measures (`kv_stats`), `calibrate`
here turns it into scales and offsets, and the engine calls the two. (`scales` is the same without
offsets, from amax alone.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kv.kv_cache import FP8, KVScales

HEADROOM = 4.0
OFFSET_BITS = 8  # offsets are multiples of the power of two at or above amax / 2^OFFSET_BITS
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget. Revenue rose 12% to $4.1 million, while costs "
    "fell; the chair asked why. Q: What is 17 * 23? A: 391. def mean(xs): return sum(xs) / len(xs). "
    'Paris, Tokyo, Nairobi and Lima are capitals. She said: "We\'ll ship on 2026-12-01, no later." '
    "Translate 'good morning' into French: bonjour. 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144."
)

KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: "auto" is the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: use auto or one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def scales(k_amax: torch.Tensor, v_amax: torch.Tensor, dtype: torch.dtype) -> KVScales:
    """Scales for an fp8 `dtype` cache from the largest |K| and |V| each (layer, KV head, channel)
    produced over the calibration, each (layers, kv_heads, head_dim) (or (layers, kv_heads): per head)."""
    assert dtype in FP8, dtype
    fmax = torch.finfo(dtype).max

    return KVScales(_pow2_scale(k_amax, fmax), _pow2_scale(v_amax, fmax))


def _pow2_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(HEADROOM * amax.float().clamp(min=1e-6) / fmax)))


@dataclass(frozen=True)
class KVStats:
    """What the calibration measured of K and of V, each (layers, kv_heads, head_dim) fp32, per channel
    of the rotated head: the least (`lo`) and largest (`hi`) value, and the mean over the calibration's
    tokens weighted by the attention each drew (`center`, within lo .. hi)."""

    k_lo: torch.Tensor
    k_hi: torch.Tensor
    k_center: torch.Tensor
    v_lo: torch.Tensor
    v_hi: torch.Tensor
    v_center: torch.Tensor


def offset(lo: torch.Tensor, hi: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    """`center` rounded to a multiple of the power of two at or above amax / 2^OFFSET_BITS (amax: the
    larger of |lo| and |hi|): exact in fp32 (an integer of at most OFFSET_BITS bits, and a sign, times
    a power of two). A center of 0 (no offset wanted) stays 0."""
    if not (lo.shape == hi.shape == center.shape):
        raise ValueError(f"KV stats of shapes {tuple(lo.shape)}, {tuple(hi.shape)}, {tuple(center.shape)}")
    lo, hi = lo.float(), hi.float()
    amax = torch.maximum(lo.abs(), hi.abs()).clamp(min=1e-6)
    grid = torch.exp2(torch.ceil(torch.log2(amax)) - OFFSET_BITS)
    return torch.round(center.float().clamp(-amax, amax) / grid) * grid


def calibrate(stats: KVStats, dtype: torch.dtype) -> KVScales:
    """Scales and offsets for an fp8 `dtype` cache from the calibration's `stats` (see the module doc)."""
    if dtype not in FP8:
        raise ValueError(f"fp8 KV scales for {dtype}: only {', '.join(map(str, FP8))} are scaled")
    fmax = torch.finfo(dtype).max
    k_off = offset(stats.k_lo, stats.k_hi, stats.k_center)
    v_off = offset(stats.v_lo, stats.v_hi, stats.v_center)
    k_amax = torch.maximum(stats.k_hi.float() - k_off, k_off - stats.k_lo.float())
    v_amax = torch.maximum(stats.v_hi.float() - v_off, v_off - stats.v_lo.float())
    return KVScales(_pow2_scale(k_amax, fmax), _pow2_scale(v_amax, fmax), k_off, v_off)
