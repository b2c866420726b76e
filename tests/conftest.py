"""Shared fixtures and the test environment.

Two models: the tiny random-weight one (tests/support/tiny_model.py) is what every service process a test
starts serves, unless the test names another (SPLITSERVE_MODEL and SPLITSERVE_ROUTER_MODEL point at it);
the real SmolLM2 (`smollm`) is for tests whose point is the text or parity with transformers. Each is
loaded once per test process (pytest-xdist: once per worker).
"""

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
from tests.support.tiny_model import real_model_path, tiny_model_path

# What a pytest-xdist worker that goes down says: a timeout's report, stacks on a signal, how it ended.
pytest_plugins = ["tests.support.xdist_report"]

# Internal authentication is on in every test, as in every deployment: each service and router process a
# test starts (they inherit this environment), and each router built in-process, proves this secret.
# Tests that check behaviour without it set their own environment.
os.environ["SPLITSERVE_INTERNAL_SECRET"] = INTERNAL_SECRET

# Every service, router and CLI a test starts serves the tiny model unless the test says otherwise (its
# `env`, or a Cluster made with model=real_model_path()). Built once per machine, at collection.
TINY_MODEL = tiny_model_path()
os.environ["SPLITSERVE_MODEL"] = TINY_MODEL
os.environ["SPLITSERVE_ROUTER_MODEL"] = TINY_MODEL


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that loads the real model in process says so (`-m "not real_model"` skips them).

    Then the files are ordered costliest first (the live compose test, which builds images for
    minutes, then chaos, then those that start services, then those on the real model, then the
    rest), each file's tests kept together and in order: pytest-xdist hands out whole files in this
    order, so the long ones start at once and short ones fill in at the end, instead of one worker
    finishing a long file alone. Only with --no-loadscope-reorder (the Makefile passes it): by default
    pytest-xdist 3.7 and newer re-sort the files by their number of tests, which put the
    single-test files (the soak, the benches, minutes of work between them) last."""
    for item in items:
        if "smollm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
    tiers = ("docker", "chaos", "services", "real_model")
    cost: dict[str, int] = {}  # file -> its costliest test's tier
    for item in items:
        tier = next((i for i, m in enumerate(tiers) if item.get_closest_marker(m)), len(tiers))
        cost[str(item.path)] = min(tier, cost.get(str(item.path), len(tiers)))
    items.sort(key=lambda item: cost[str(item.path)])  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def smollm() -> tuple[LlamaForCausalLM, Tokenizer]:
    """The real SmolLM2-135M-Instruct GGUF, fp32, in eval mode: for tests about text or parity."""
    from common.model.loader import load_model

    return load_model(real_model_path(), dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny() -> tuple[LlamaForCausalLM, Tokenizer]:
    """The tiny random-weight model the test services serve (SmolLM2's tokenizer), fp32, in eval mode."""
    from common.model.loader import load_model

    return load_model(TINY_MODEL, dtype=torch.float32)


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
