"""The shape and the per-family options of a decoder-only model, read once from the weight file and
never mutated.

Both loaders (GGUF metadata, HF config.json) produce this one dataclass, so the model code and the
KV-transfer compatibility preflight (model_id + weights_hash + shapes) see the same description. The
fields after `attention_bias` say how a family departs from Llama (docs/models.md lists the families);
each defaults to Llama's behaviour, so a config that does not mention one is a plain Llama.
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
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn", "freq_factors")
# The gated MLP's activations (HF's hidden_act / hidden_activation names)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# How a mixture of experts picks each token's experts (ModelConfig.router)
ROUTERS = ("softmax", "group_limited_greedy", "noaux_tc")


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
    # --- per-family options (Llama's behaviour by default) ---
    architecture: str = "llama"  # HF model_type, for messages and TP support checks
    qk_norm: bool = False  # qwen3, gemma3: an RMSNorm over each head's q and k, before RoPE
    # Sliding-window attention: a query at position p sees keys p - sliding_window + 1 .. p (transformers'
    # `kv_idx > q_idx - sliding_window`). layer_types says which layers slide ("sliding_attention") and
    # which see everything ("full_attention"); None with a window: every layer slides (mistral, phi3).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # RoPE of the sliding layers where it differs from the full ones' (gemma3: rope_local_base_freq)
    rope_local_theta: float | None = None
    rope_local_scaling: dict[str, Any] | None = None
    norm_offset: bool = False  # gemma: RMSNorm scales by (1 + weight), in fp32
    sandwich_norm: bool = False  # gemma2/3: norms on the attention and MLP outputs, and before the MLP
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh (gemma)
    embedding_scale: float | None = None  # gemma: embeddings times sqrt(hidden), in the model dtype
    query_pre_attn_scalar: float | None = None  # gemma: attention scale is this ** -0.5, not head_dim's
    attn_logit_softcapping: float | None = None  # gemma2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # gemma2/3: logits -> cap * tanh(logits / cap)
    # Mixture of experts (mixtral, qwen3_moe): num_experts > 0. Router softmax -> top num_experts_per_tok,
    # renormalised when norm_topk_prob; every MoE layer's experts are gated MLPs of moe_intermediate_size.
    # dense_layers: layers that keep a dense MLP of intermediate_size (qwen3_moe's mlp_only_layers).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # DeepSeek's MoE (deepseek_v2/v3): n_shared_experts gated MLPs of n_shared_experts *
    # moe_intermediate_size that every token goes through, the routed experts' weights times
    # routed_scaling_factor, and the router (`ROUTERS`): "softmax" (mixtral, qwen3_moe, deepseek_v2's
    # greedy), "group_limited_greedy" (deepseek_v2: the experts in n_group groups, only the topk_group
    # groups of the best expert considered) or "noaux_tc" (deepseek_v3: sigmoid scores, plus the
    # e_score_correction_bias for the choice only, groups ranked by their two best).
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    # Multi-head latent attention (deepseek_v2/v3), on when kv_lora_rank > 0: each token's K and V are
    # decompressed from a latent of kv_lora_rank (normalised) + qk_rope_head_dim (the one rotated key
    # all heads share); the latent is what the KV cache holds: one "KV head" whose kv_lora_rank +
    # qk_rope_head_dim values are split over K (the first half) and V (the second), so num_kv_heads is
    # 1 and head_dim is half the latent (`mla_split`). Queries: q_proj, or q_a_proj -> RMSNorm -> q_b_proj
    # with q_lora_rank (None: no query compression, DeepSeek-V2-Lite). rope_interleave: RoPE over
    # adjacent pairs (DeepSeek's layout; V2 always, V3 by default) instead of the two halves.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.is_mla:
            self._check_mla()
        elif self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        # Normalise HF's "default" / missing type to None so code only checks one thing.
        scaling = normalize_rope_scaling(self.rope_scaling)
        object.__setattr__(self, "rope_scaling", scaling)
        object.__setattr__(self, "rope_local_scaling", normalize_rope_scaling(self.rope_local_scaling))
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                n = len(self.layer_types)
                raise ValueError(f"layer_types has {n} entries for {self.num_layers} layers")
            unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise ValueError(f"unknown layer types {sorted(unknown)}")
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be at least 1")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r}: supported {', '.join(ACTIVATIONS)}")
        bad_topk = not 0 < self.num_experts_per_tok <= self.num_experts
        if self.num_experts and (bad_topk or self.moe_intermediate_size < 1):
            raise ValueError(
                f"mixture of experts: {self.num_experts_per_tok} of {self.num_experts} experts per "
                f"token, moe_intermediate_size={self.moe_intermediate_size}"
            )
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r}: supported {', '.join(ROUTERS)}")
        if self.router != "softmax" and (
            self.n_group < 1 or self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group
        ):
            raise ValueError(
                f"router {self.router}: {self.num_experts} experts in n_group={self.n_group} groups, "
                f"topk_group={self.topk_group}"
            )
        if self.router != "softmax" and self.num_experts_per_tok > self.topk_group * (
            self.num_experts // self.n_group
        ):
            raise ValueError(
                f"router {self.router}: {self.num_experts_per_tok} experts per token, more than the "
                f"{self.topk_group} groups kept hold"
            )
        if self.router == "noaux_tc" and self.num_experts // self.n_group < 2:
            raise ValueError("router noaux_tc ranks each group by its two best experts: groups of 2 or more")

    def _check_mla(self) -> None:
        dims = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if min(dims) < 1 or self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MLA: kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim} (even), v_head_dim={self.v_head_dim}: "
                "each must be at least 1"
            )
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"MLA: q_lora_rank={self.q_lora_rank} must be at least 1 (or None)")
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        if latent % 2:
            raise ValueError(
                f"MLA: the latent (kv_lora_rank + qk_rope_head_dim = {latent}) must be even: the KV cache "
                "holds its two halves in K and V"
            )
        if (self.num_kv_heads, self.head_dim) != self.mla_split:
            raise ValueError(
                f"MLA: num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}; the cache layout of a "
                f"{latent}-wide latent is {self.mla_split}"
            )
        if self.sliding_window is not None or self.qk_norm or self.sandwich_norm or self.norm_offset:
            raise ValueError("MLA with sliding windows, q/k norms or gemma's norms is not implemented")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def mla_split(self) -> tuple[int, int]:
        """(num_kv_heads, head_dim) of an MLA model's KV cache: one head, half the latent in K and
        half in V."""
        return 1, (self.kv_lora_rank + self.qk_rope_head_dim) // 2

    @property
    def mla_latent(self) -> tuple[int, int] | None:
        """(kv_lora_rank, qk_rope_head_dim): what an MLA model's cache holds per token; None otherwise."""
        return (self.kv_lora_rank, self.qk_rope_head_dim) if self.is_mla else None

    @property
    def rope_dim(self) -> int:
        """How many dims of each query and key head RoPE rotates (MLA: qk_rope_head_dim)."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """What q.k is multiplied by before the softmax. MLA: over the query head's nope + rope dims,
        and with YaRN's mscale_all_dim squared on top, as transformers' DeepSeek (yarn_apply_mscale)."""
        if self.is_mla:
            scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
            s = self.rope_scaling
            if s is not None and s.get("mscale_all_dim") and float(s["factor"]) > 1:
                m = 0.1 * float(s["mscale_all_dim"]) * math.log(float(s["factor"])) + 1.0
                scale *= m * m
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends over the sliding window (and uses the local RoPE, if any)."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int | None:
        """The attention window of `layer`; None: it sees the whole context."""
        return self.sliding_window if self.is_sliding(layer) else None

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers


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
        "yarn": ("factor", "original_max_position_embeddings"),
        "freq_factors": ("factors",),
    }[kind]
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling type {kind!r} is missing {', '.join(missing)}")
    out = dict(scaling)
    out.pop("type", None)
    out["rope_type"] = kind
    return out


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies (rope_dim/2,) float32 on the CPU, with rope_scaling applied (HF semantics);
    `local`: those of the sliding layers (rope_local_theta / rope_local_scaling, gemma3).

    Always computed on the CPU, also inside a `torch.device("meta")` block (`LlamaForCausalLM.empty`):
    an op on the meta device runs torch's Python references, which import torch._dynamo (~3 s)."""
    hd = config.rope_dim
    theta, s = config.rope_theta, config.rope_scaling
    if local:
        assert config.rope_local_theta is not None, "the model has no local RoPE"
        theta, s = config.rope_local_theta, config.rope_local_scaling
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device="cpu") / hd))
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
    elif kind == "yarn":
        # YaRN (arXiv 2309.00071), as transformers computes it: dimensions that turn fewer than beta_slow
        # times over the original context are interpolated (divided by factor), those that turn more than
        # beta_fast times kept, a linear ramp between; cos/sin are scaled by rope_attention_scaling.
        factor, old_ctx = float(s["factor"]), float(s["original_max_position_embeddings"])
        fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

        def dim_at(rotations: float) -> float:  # the dimension that turns `rotations` times over old_ctx
            return hd * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_at(fast), dim_at(slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, hd - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(hd // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        inv = (inv / factor) * ramp + inv * (1 - ramp)
    return inv.float()


def rope_attention_scaling(config: ModelConfig, local: bool = False) -> float:
    """The factor RoPE's cos and sin are multiplied by (1.0 but for YaRN: its attention temperature,
    `attention_factor`, else 0.1 * ln(factor) + 1, or the mscale / mscale_all_dim ratio)."""
    s = config.rope_local_scaling if local else config.rope_scaling
    if s is None or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"]))
    return mscale()


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
