"""Shared fixtures. The real model is loaded once per test session (it takes seconds)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from common.model.llama import LlamaForCausalLM
from common.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm() -> tuple[LlamaForCausalLM, Tokenizer]:
    """The default SmolLM2-135M-Instruct GGUF, fp32, in eval mode: (model, tokenizer)."""
    from common.model.loader import load_model

    return load_model(dtype=torch.float32)


# ---- Redis (integration tests run against a real server) ----


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One real Redis server for the whole session. $SPLITSERVE_TEST_REDIS_URL uses an existing one.

    Tests share it, so each must keep its keys under its own prefix (see tests/integration/test_state.py).
    """
    import os

    from common.redis_server import RedisServer

    existing = os.environ.get("SPLITSERVE_TEST_REDIS_URL")
    if existing:
        yield existing
        return
    with RedisServer() as server:
        yield server.url
