"""The compatibility record a service presents before KV moves to or from it (the transfer preflight)."""

from __future__ import annotations

from common.kv.kv_cache import KVCacheSpec
from common.model.config import ModelConfig
from common.protocol import KVCompat


def compat_for(model_config: ModelConfig, kv_spec: KVCacheSpec) -> KVCompat:
    """KVCompat for this model and KV cache: every field the two sides' KV bytes depend on.

    The model and spec must describe the same cache; a disagreement is a bug at start-up, not a mismatch
    to report to a peer, so it is asserted here.
    """
    assert (kv_spec.num_layers, kv_spec.num_kv_heads, kv_spec.head_dim) == (
        model_config.num_layers,
        model_config.num_kv_heads,
        model_config.head_dim,
    ), f"KV cache spec {kv_spec} does not match the model's shape"
    return KVCompat(
        model_id=model_config.model_id,
        weights_hash=model_config.weights_hash,
        dtype=str(kv_spec.dtype).removeprefix("torch."),  # torch.bfloat16 -> "bfloat16"
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=kv_spec.block_size,
    )
