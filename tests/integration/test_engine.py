"""The engine: batch invariance under chunked prefill and preemption, sampling (on the tiny test model),
and the real model's answer and stop strings."""

from __future__ import annotations

import pytest

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about cats and dogs living together in a small house by the sea.",
    "2+2=",
    "Explain photosynthesis to a child in simple words, please, with an example from a garden.",
    "Hi",
    "List the days of the week.",
    "Why do we dream at night? Give a short answer.",
]
MAX_TOKENS = 12


def _prompts(tok) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def alone(tiny) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Each prompt run by itself, no chunking, no memory pressure."""
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1, max_num_batched_tokens=4096))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [engine.generate([p], params)[0].token_ids for p in _prompts(tok)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_batch_invariance_with_chunking_and_preemption(tiny, alone, mode) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    prompts = _prompts(tok)
    # 12 blocks of 16 tokens hold ~3 of these sequences: the rest wait, and running ones get preempted.
    cfg = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=24,
        num_kv_blocks=12,
        preemption_mode=mode,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(model, tok, cfg)
    together = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert engine.scheduler.stats[f"preempt_{mode}"] > 0, "the small KV budget must force preemption"
    for got, want, q in zip(together, alone, QUESTIONS, strict=True):
        assert got.token_ids == want, f"tokens differ for {q!r}"
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == 12


def test_prefix_cache_hits_give_the_same_tokens(tiny, alone) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    prompts = _prompts(tok)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    first = engine.generate(prompts[:4], params)
    again = engine.generate(prompts[:4], params)  # the system-prompt prefix and whole prompts are cached
    assert engine.block_manager.prefix_hits > 0
    assert [c.token_ids for c in first] == [c.token_ids for c in again] == alone[:4]


def test_generate_answers_paris(smollm) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm
    engine = LLMEngine(model, tok, EngineConfig())
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    assert "Paris" in out.text and out.finish_reason in ("stop", "length")


def test_sampling_seed_is_reproducible_and_batch_independent(tiny) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig())
    prompts = _prompts(tok)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    solo = engine.generate([prompts[0]], params)[0].token_ids
    crowd = engine.generate(prompts[:4], params)[0].token_ids
    assert solo == crowd
    other = engine.generate(
        [prompts[0]], SamplingParams(max_tokens=10, temperature=0.9, seed=99, ignore_eos=True)
    )
    greedy = engine.generate([prompts[0]], SamplingParams(max_tokens=10, ignore_eos=True))
    assert other[0].token_ids != solo or greedy[0].token_ids != solo


def test_stop_strings_and_stop_tokens(smollm) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm
    engine = LLMEngine(model, tok, EngineConfig())
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    full = engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    assert "Paris" in full.text
    cut = engine.generate([prompt], SamplingParams(max_tokens=24, stop=("Paris",)))[0]
    assert cut.finish_reason == "stop" and "Paris" not in cut.text and full.text.startswith(cut.text)
    first = full.token_ids[2]
    by_id = engine.generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=(first,)))[0]
    assert by_id.token_ids == full.token_ids[:3] and by_id.finish_reason == "stop"
    # EOS ends a request unless ignore_eos; the model's EOS comes from its metadata
    assert full.finish_reason == "stop" and full.token_ids[-1] in model.config.eos_token_ids
    longer = engine.generate([prompt], SamplingParams(max_tokens=len(full.token_ids) + 3, ignore_eos=True))[0]
    assert len(longer.token_ids) == len(full.token_ids) + 3 and longer.finish_reason == "length"


def test_static_policy_gives_the_same_tokens(tiny, alone) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(policy="static", max_num_seqs=4))
    out = engine.generate(_prompts(tok), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [c.token_ids for c in out] == alone
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_rejects_what_cannot_fit(tiny) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=4))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request([1] * 9000, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("seed", [None, 7])
def test_a_migrated_request_continues_exactly_where_it_was(tiny, seed) -> None:  # type: ignore[no-untyped-def]
    """A request moved to another engine with its prompt plus the k output tokens already sent
    (num_output_tokens=k) goes on with output k: the same tokens, greedy or seeded, as never moving."""
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig())
    prompt = _prompts(tok)[2]
    temperature = 0.0 if seed is None else 0.9
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, ignore_eos=True)
    whole = engine.generate([prompt], params)[0].token_ids
    k = 5
    rid = engine.add_request(prompt + whole[:k], params, num_output_tokens=k)
    rest: list[int] = []
    while engine.has_unfinished():
        for o in engine.step().outputs:
            assert o.request_id == rid and o.index == k + len(rest)
            rest += o.token_ids
    assert whole[:k] + rest == whole and len(rest) == MAX_TOKENS - k
    with pytest.raises(ValueError, match="leaves none"):
        engine.add_request(prompt + whole, params, num_output_tokens=MAX_TOKENS)
