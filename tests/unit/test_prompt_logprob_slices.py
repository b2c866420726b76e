"""Prompt logprobs are scored in bounded slices (issue 31, "Security round 2"): a long prompt chunk never
makes a (chunk x vocab) logits tensor at once — every compute_logits call the engine makes has at most
PROMPT_LOGPROB_ROWS rows — and the logprobs are those of one unsliced pass over the whole prompt."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from common.config import EngineConfig
from common.engine import model_runner
from common.engine.llm_engine import LLMEngine
from common.model.llama import LlamaForCausalLM
from common.sampling_params import SamplingParams, TokenLogprob
from common.text.tokenizer import Tokenizer

PROMPT_LEN = 700  # 699 scored positions: slices of 256, 256 and 187 in one chunk
K = 3


def _prompt_logprobs(
    tiny: tuple[LlamaForCausalLM, Tokenizer], ids: list[int], budget: int
) -> tuple[list[TokenLogprob | None], list[int]]:
    """The prompt's logprobs from the engine, and the rows of every compute_logits call it made."""
    model, tok = tiny
    engine = LLMEngine(
        model, tok, EngineConfig(kv_cache_memory_mb=32, max_num_batched_tokens=budget, num_threads=1)
    )
    real, rows = model.compute_logits, []

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return real(hidden)

    got: list[TokenLogprob | None] | None = None
    with pytest.MonkeyPatch.context() as m:
        m.setattr(model, "compute_logits", counted)
        engine.add_request(ids, SamplingParams(max_tokens=1, prompt_logprobs=K), request_id="r")
        while engine.has_unfinished():
            for o in engine.step().outputs:
                if o.prompt_logprobs is not None:
                    got = o.prompt_logprobs
    assert got is not None
    return got, rows


@pytest.mark.parametrize("budget", [1024, 300], ids=["one-chunk", "chunked"])
def test_sliced_prompt_logprobs_equal_the_unsliced_ones(
    tiny: tuple[LlamaForCausalLM, Tokenizer], budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(7)
    ids = [rng.randrange(tiny[0].config.vocab_size) for _ in range(PROMPT_LEN)]
    bound = 256
    sliced, sliced_rows = _prompt_logprobs(tiny, ids, budget)
    assert max(sliced_rows) <= bound, sliced_rows  # never more than one slice of logits at a time

    # the reference: one pass per chunk, which does make the big tensor
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 10**9)
    whole, whole_rows = _prompt_logprobs(tiny, ids, budget)
    assert max(whole_rows) > bound
    assert len(sliced) == len(whole) == PROMPT_LEN and sliced[0] is None and whole[0] is None
    for i, (a, b) in enumerate(zip(sliced[1:], whole[1:], strict=True), start=1):
        assert a is not None and b is not None
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4), i
        assert [t for t, _ in a.top] == [t for t, _ in b.top], i
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4), i


def test_the_slices_cover_each_chunk_exactly() -> None:
    """prepare() cuts a chunk's scored rows into consecutive slices of at most PROMPT_LOGPROB_ROWS, in
    order, with no row scored twice or left out."""
    from common.engine.model_runner import PROMPT_LOGPROB_ROWS

    runner = object.__new__(model_runner.ModelRunner)
    runner.block_size = 16
    runner.extra_groups = range(0)  # one block table

    class Seq:
        prompt_logprobs: list[Any] = [None]
        num_prompt_tokens = 1000
        num_computed_tokens = 100
        num_tokens = 1000
        token_ids = list(range(1000))
        block_table = list(range(63))

    class Out:
        scheduled = [(Seq(), 600)]
        padding: list[Any] = []

    step = runner.prepare(Out())  # type: ignore[arg-type]
    assert [n for _, _, _, n in step.prompt_rows] == [PROMPT_LOGPROB_ROWS, PROMPT_LOGPROB_ROWS, 88]
    positions = [p + j for _, _, p, n in step.prompt_rows for j in range(n)]
    assert positions == list(range(100, 700))  # rows 100..699 score tokens 101..700
    assert [r for _, r, _, _ in step.prompt_rows] == [0, 256, 512]
