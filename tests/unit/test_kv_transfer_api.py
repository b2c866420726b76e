"""Backend selection, endpoint parsing and the compatibility record (no network)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.model.config import ModelConfig
from kv_transfer import compat_for, make_receiver, make_sender
from kv_transfer.tcp import TcpReceiver, TcpSender, parse_endpoint

SPEC = KVCacheSpec(
    num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16
)
MODEL = ModelConfig(
    vocab_size=10, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
    tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(0,), model_id="tiny", weights_hash="abc",
)  # fmt: skip


def test_compat_for_takes_model_shape_and_cache_dtype_and_block_size() -> None:
    c = compat_for(MODEL, SPEC)
    assert (c.model_id, c.weights_hash, c.dtype, c.block_size) == ("tiny", "abc", "bfloat16", 16)
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (2, 2, 8)
    other = compat_for(MODEL, dataclasses.replace(SPEC, block_size=32, dtype=torch.float32))
    assert c.mismatches(other) == ["dtype ('bfloat16' != 'float32')", "block_size (16 != 32)"]


def test_make_by_name_and_unknown_backend_lists_available() -> None:
    kv, c = PagedKVCache(SPEC), compat_for(MODEL, SPEC)
    assert isinstance(make_sender("tcp", kv, c), TcpSender)
    assert isinstance(make_receiver("tcp", kv, c, lambda r, f: True, lambda m: None), TcpReceiver)
    with pytest.raises(ValueError, match="available: tcp"):
        make_sender("nixl2", kv, c)
    with pytest.raises(ValueError, match="available: tcp"):
        make_receiver("rdma", kv, c, lambda r, f: True, lambda m: None)


def test_parse_endpoint() -> None:
    assert parse_endpoint("tcp://127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert parse_endpoint("tcp://[::1]:7") == ("::1", 7)
    for bad in ("127.0.0.1:5000", "tcp://host", "tcp://:5", "ucx://a:1"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)
