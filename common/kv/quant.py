"""fp8 KV cache scales: one power of two per (layer, KV head), for K and for V, calibrated from the model.

A stored value is `x / scale`, clamped to the fp8 format's range. The scale is the power of two at or
above `HEADROOM * amax / fp8_max`, where amax is the largest |K| (|V|) that head produced over a fixed
calibration text (`CALIBRATION_TEXT`, run once through the model with plain causal attention, no cache).
Powers of two cost no precision to divide and multiply by, and are exact to compare: a prefill and a
decode service that loaded the same weights compute the same scales, and the transfer preflight checks
that they did (`KVScales.digest`). HEADROOM leaves room for prompts that push a head past what the
calibration text did; past that, values saturate at the format's largest (they never become inf/NaN).

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
    """Scales for an fp8 `dtype` cache from the largest |K| and |V| each (layer, KV head) produced over
    the calibration text, each (layers, kv_heads)."""
    assert dtype in FP8, dtype
    fmax = torch.finfo(dtype).max

    def pow2(amax: torch.Tensor) -> torch.Tensor:
        return torch.exp2(torch.ceil(torch.log2(HEADROOM * amax.clamp(min=1e-6) / fmax)))

    return KVScales(pow2(k_amax), pow2(v_amax))
