"""Shared fixtures. The real model is loaded once per test session (it takes seconds)."""

from __future__ import annotations

import pytest
import torch

from common.model.llama import LlamaForCausalLM
from common.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm() -> tuple[LlamaForCausalLM, Tokenizer]:
    """The default SmolLM2-135M-Instruct GGUF, fp32, in eval mode: (model, tokenizer)."""
    from common.model.loader import load_model

    return load_model(dtype=torch.float32)
