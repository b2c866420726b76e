"""The real model through the Triton attention backend (interpreted on a CPU, compiled on a GPU) gives
the same greedy tokens as the torch reference, across chunked prefill, prefix-cache hits and decode."""

from __future__ import annotations

import pytest

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams

pytest.importorskip("triton")

PROMPTS = [
    "The capital of France is",
    "The capital of France is a city where",  # shares its first block with the one above
    "1, 2, 3, 4,",
]


def test_triton_backend_generates_what_the_torch_reference_does(tiny) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    # 8-token budget: prompts arrive in chunks over a paged prefix, decodes ride along with chunks
    cfg = dict(max_num_batched_tokens=8, num_kv_blocks=64, block_size=4, dtype="float32")
    ref = LLMEngine(model, tok, EngineConfig(attention_backend="torch", **cfg)).generate(PROMPTS, params)
    engine = LLMEngine(model, tok, EngineConfig(attention_backend="triton", **cfg))
    assert engine.runner.use_kernels
    out = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
