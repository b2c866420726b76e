"""fp8 KV cache scales: one power of two per (layer, KV head, channel), for K and for V, calibrated from
the model.

A stored value is `x R / scale` (R: the fixed rotation of common/kv/kv_cache.py `kv_rotation`), clamped
to the fp8 format's range. The scale is the power of two at or above `HEADROOM * amax / fp8_max`, where
amax is the largest |x R| of that channel over a fixed calibration (`CALIBRATION_TEXT` as plain text and
rendered through the model's chat template, so that its special tokens and default system prompt are
covered: common/model/calibration.py `calibration_ids`), run once through the model with plain causal
attention, no cache. Per channel, so that no channel's range is set by another's. (What fp8 costs in
accuracy is its mantissa, not the scales: floats keep the same relative precision at any scale, and on
SmolLM2 per-channel scales alone changed the KL divergence to fp32 KV by 3 %; the rotation is what cut
it, see kv_cache.py.) Attention pays nothing for per-channel scales: K's multiply the query per channel
before q . k, V's the output (common/kernels/paged_attention.py; the torch path reads dequantized).

Powers of two cost no precision to divide and multiply by, and are exact to compare: a prefill and a
decode service that loaded the same weights compute the same scales, and the transfer preflight checks
that they did (`KVScales.digest`, a hash of the exponents). HEADROOM leaves room for prompts that push a
channel past what the calibration did; past that, values saturate at the format's largest (never inf or
NaN) and are counted (`PagedKVCache.clamped`).

The KV layer does not run the model: common/model/calibration.py measures amax (`kv_amax`), `scales`
here turns it into the scales, and the engine calls the two.
"""

from __future__ import annotations

import torch

from common.kv.kv_cache import FP8, KVScales

HEADROOM = 4.0
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget. Revenue rose 12% to $4.1 million, while costs "
    "fell; the chair asked why. Q: What is 17 * 23? A: 391. def mean(xs): return sum(xs) / len(xs). "
    "Paris, Tokyo, Nairobi and Lima are capitals. She said: \"We'll ship on 2026-12-01, no later.\" "
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

    def pow2(amax: torch.Tensor) -> torch.Tensor:
        return torch.exp2(torch.ceil(torch.log2(HEADROOM * amax.float().clamp(min=1e-6) / fmax)))

    return KVScales(pow2(k_amax), pow2(v_amax))
