"""What the service-level integration tests share: chat prompts and the one-process engine's greedy
answers to them (the reference every split path must reproduce token for token)."""

from __future__ import annotations

import pytest

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:  # type: ignore[no-untyped-def]
    _, tok = tiny
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(tiny, prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1))
    return [engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS))[0].token_ids for p in prompts]
