"""The shape of a Llama-family model, read once from the weight file and never mutated.

Both loaders (GGUF metadata, HF config.json) produce this one dataclass, so the model code and the
KV-transfer compatibility preflight (model_id + weights_hash + shapes) see the same description.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

# RoPE scaling types we implement; anything else is refused at load time rather than silently
# producing a model that drifts at long context.
#   linear:       positions divided by `factor` (== every frequency divided by `factor`)
#   llama3:       Llama 3.1 band-wise scaling (low frequencies scaled, high kept, smooth in between)
#   freq_factors: per-frequency divisors given explicitly (how GGUF stores Llama 3.1: rope_freqs.weight)
ROPE_SCALING_TYPES = ("linear", "llama3", "freq_factors")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_id: str
    weights_hash: str
    attention_bias: bool = False  # Qwen2 has biases on q/k/v

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        # Normalise HF's "default" / missing type to None so code only checks one thing.
        scaling = normalize_rope_scaling(self.rope_scaling)
        object.__setattr__(self, "rope_scaling", scaling)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Validate an HF-style rope_scaling dict; returns None for no scaling, else a dict with 'rope_type'."""
    if not scaling:
        return None
    # HF renamed "type" to "rope_type"; accept both.
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_SCALING_TYPES)} "
            "(or none/'default')"
        )
    required = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "freq_factors": ("factors",),
    }[kind]
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling type {kind!r} is missing {', '.join(missing)}")
    out = dict(scaling)
    out.pop("type", None)
    out["rope_type"] = kind
    return out


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) float32 on the CPU, with rope_scaling applied (HF semantics).

    Always computed on the CPU, also inside a `torch.device("meta")` block (`LlamaForCausalLM.empty`):
    an op on the meta device runs torch's Python references, which import torch._dynamo (~3 s)."""
    hd = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device="cpu") / hd))
    s = config.rope_scaling
    if s is None:
        return inv.float()
    kind = s["rope_type"]
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "freq_factors":
        factors = torch.tensor(list(s["factors"]), dtype=torch.float64, device="cpu")
        if factors.shape != inv.shape:
            raise ValueError(f"rope freq_factors has {factors.numel()} entries, expected {inv.numel()}")
        inv = inv / factors
    elif kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # Long wavelengths (beyond old_ctx/lo) are fully scaled, short ones (below old_ctx/hi) kept,
        # and the band between is interpolated linearly in 1/wavelen.
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / lo, inv / factor, torch.where(wavelen < old_ctx / hi, inv, mid))
    return inv.float()


def weights_hash(paths: Iterable[str]) -> str:
    """A cheap content fingerprint of weight files: size + first and last MiB of each (16 hex chars).

    Good enough to tell two different checkpoints apart before a KV transfer, without reading GBs.
    """
    h = hashlib.sha256()
    mib = 1 << 20
    for p in sorted(paths):
        size = os.path.getsize(p)
        h.update(str(size).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read(mib))
            if size > mib:
                f.seek(max(mib, size - mib))
                h.update(f.read(mib))
    return h.hexdigest()[:16]
