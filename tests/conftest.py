"""Shared fixtures. The real model is loaded once per test session (it takes seconds)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter (numpy on the CPU), so every kernel is
# checked against the torch reference in `make test`. Must be set before triton.jit sees a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common.model.llama import LlamaForCausalLM
from common.text.tokenizer import Tokenizer
from tests.support.cluster import INTERNAL_SECRET

# Internal authentication is on in every test, as in every deployment: each service and router process a
# test starts (they inherit this environment), and each router built in-process, proves this secret.
# Tests that check behaviour without it set their own environment.
os.environ["SPLITSERVE_INTERNAL_SECRET"] = INTERNAL_SECRET


@pytest.fixture(scope="session")
def smollm() -> tuple[LlamaForCausalLM, Tokenizer]:
    """The default SmolLM2-135M-Instruct GGUF (or $SPLITSERVE_MODEL), fp32, in eval mode."""
    from common.model.loader import load_model

    return load_model(os.environ.get("SPLITSERVE_MODEL") or None, dtype=torch.float32)


# ---- Redis (integration tests run against a real server) ----


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One real Redis server for the whole session. $SPLITSERVE_TEST_REDIS_URL uses an existing one.

    Tests share it, so each must keep its keys under its own prefix (see tests/integration/test_state.py).
    """
    import os

    from common.cluster.redis_server import RedisServer

    existing = os.environ.get("SPLITSERVE_TEST_REDIS_URL")
    if existing:
        yield existing
        return
    with RedisServer() as server:
        yield server.url
