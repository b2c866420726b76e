"""Backend selection, endpoints and the compatibility record (no network)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.engine.llm_engine import kv_compat
from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.model.config import ModelConfig
from kv_transfer import Endpoint, make_receiver, make_sender
from kv_transfer.backends.tcp import TcpReceiver, TcpSender
from tests.support.kv_helpers import Owner

SPEC = KVCacheSpec(
    num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16
)
MODEL = ModelConfig(
    vocab_size=10, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
    tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(0,), model_id="tiny", weights_hash="abc",
)  # fmt: skip


def test_compat_takes_model_shape_and_cache_dtype_and_block_size() -> None:
    c = kv_compat(MODEL, SPEC)
    assert (c.model_id, c.weights_hash, c.dtype, c.block_size) == ("tiny", "abc", "bfloat16", 16)
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (2, 2, 8)
    other = kv_compat(MODEL, dataclasses.replace(SPEC, block_size=32, dtype=torch.float32))
    assert c.mismatches(other) == ["dtype ('bfloat16' != 'float32')", "block_size (16 != 32)"]


def test_make_by_name_and_unknown_backend_lists_available() -> None:
    kv, c = PagedKVCache(SPEC), kv_compat(MODEL, SPEC)
    assert isinstance(make_sender("tcp", kv, c), TcpSender)
    assert isinstance(make_receiver("tcp", kv, c, Owner()), TcpReceiver)
    with pytest.raises(ValueError, match="available: tcp"):
        make_sender("nixl2", kv, c)
    with pytest.raises(ValueError, match="available: tcp"):
        make_receiver("rdma", kv, c, Owner())


def test_endpoint_parses_and_prints_every_scheme() -> None:
    assert Endpoint.parse("tcp://127.0.0.1:5000") == Endpoint("tcp", "127.0.0.1", 5000)
    assert Endpoint.parse("nixl://[::1]:7", "nixl") == Endpoint("nixl", "::1", 7)
    assert str(Endpoint("torch_dist", "::1", 7)) == "torch_dist://[::1]:7"
    assert str(Endpoint.parse("tcp://h:1")) == "tcp://h:1"
    for bad in ("127.0.0.1:5000", "tcp://host", "tcp://:5", "tcp://a:b"):
        with pytest.raises(ValueError, match="expected"):
            Endpoint.parse(bad)
    with pytest.raises(ValueError, match="not a tcp KV endpoint"):
        Endpoint.parse("nixl://a:1", "tcp")


def test_a_configured_backend_whose_library_is_missing_is_refused_naming_the_extra(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """kv_backend=nixl where NIXL is not installed (a run-only venv): a clear error before the model loads,
    never a silent fallback; auto says which it took and why."""
    import kv_transfer

    monkeypatch.setattr(kv_transfer, "available_backends", lambda: ["tcp"])
    with pytest.raises(ValueError, match=r"kv_backend=nixl .*pip install 'splitserve\[nixl\]'"):
        kv_transfer.resolve_backend("nixl")
    assert kv_transfer.resolve_backend("auto") == (
        "tcp",
        "auto: nixl does not import here (pip install 'splitserve[nixl]' on Linux x86_64)",
    )
    assert kv_transfer.resolve_backend("tcp") == ("tcp", "configured")
