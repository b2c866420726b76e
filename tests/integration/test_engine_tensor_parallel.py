"""Tensor parallelism on the tiny test model: an engine of 2 ranks (2 processes, gloo) against 1 rank.

It has SmolLM2-135M's 3 KV heads, so 2 ranks split them unevenly ([2, 1]). Greedy tokens must be the same
and logprobs close (the sharded matmuls and all-reduces sum in another order: never bit for bit)."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.config import ModelConfig
from common.model.llama import LlamaForCausalLM
from common.sampling_params import SamplingParams
from common.text.tokenizer import Tokenizer

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about cats and dogs living together in a small house by the sea.",
    "2+2=",
    "Hi",
    "List the days of the week.",
]


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    """Each request's tokens, their logprobs (own and top-2) and prompt logprobs, stepping by hand."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got: dict[str, Any] = {i: {"tokens": [], "logprobs": [], "top": [], "prompt": None} for i in ids}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            r = got[o.request_id]
            r["tokens"] += o.token_ids
            for lp in o.logprobs or []:
                r["logprobs"].append(lp.logprob)
                r["top"].append(lp.top)
            if o.prompt_logprobs is not None:
                r["prompt"] = [None if lp is None else lp.logprob for lp in o.prompt_logprobs]
    return got


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)  # a zombie
    except FileNotFoundError:
        return True


@pytest.mark.timeout(180)
def test_two_ranks_generate_what_one_does(tiny: tuple[LlamaForCausalLM, Tokenizer]) -> None:
    model, tok = tiny
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    # A KV cache of 12 blocks of 16 tokens holds ~3 of these sequences: with all six at once the rest
    # wait and running ones are swapped out and back in, on every rank.
    base: dict[str, Any] = dict(
        num_threads=1, max_num_seqs=8, max_num_batched_tokens=24, num_kv_blocks=12,
        preemption_mode="swap", enable_prefix_caching=False,
    )  # fmt: skip
    greedy = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    scored = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    three = ([prompts[0], prompts[1], prompts[2]], [greedy, scored, greedy])
    six = (prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts))

    one = LLMEngine(model, tok, EngineConfig(**base))
    want_three, want_six = _run(one, *three), _run(one, *six)

    t0 = time.monotonic()
    two = LLMEngine(model, tok, EngineConfig(**base, tensor_parallel_size=2))
    started = time.monotonic() - t0
    try:
        assert two.tp_workers is not None
        pids = two.tp_workers.alive
        assert len(pids) == 1
        assert two.kv_cache.spec.num_kv_heads == 2  # rank 0's share of the 3 KV heads
        assert two.model.embed_tokens.weight.shape[0] == model.config.vocab_size // 2
        got_three = _run(two, *three)
        got_six = _run(two, *six)
        assert two.scheduler.stats["preempt_swap"] > 0, "the small KV budget must force swapping"
        two.block_manager.check_integrity()
        compat = two.kv_compat()  # rank 0's preflight record: the model's 3 KV heads, rank 0 of 2
        assert (compat.num_kv_heads, compat.tp_size, compat.tp_rank) == (3, 2, 0)
    finally:
        two.close()
    for got, want in zip(got_three.values(), want_three.values(), strict=True):
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3)
        assert [[t for t, _ in top] for top in got["top"]] == [[t for t, _ in top] for top in want["top"]]
    got_p, want_p = list(got_three.values())[1]["prompt"], list(want_three.values())[1]["prompt"]
    assert want_p is not None and len(want_p) == len(prompts[1])
    assert got_p[0] is None and got_p[1:] == pytest.approx(want_p[1:], abs=1e-3)
    for got, want in zip(got_six.values(), want_six.values(), strict=True):
        assert got["tokens"] == want["tokens"]
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), "close() must stop the worker processes"
    print(f"TP=2 started in {started:.1f} s")


def test_refusals(tiny: tuple[LlamaForCausalLM, Tokenizer]) -> None:
    from common.engine.kv_connector import KVConnector

    class Shipping(KVConnector):
        pass

    model, tok = tiny
    with pytest.raises(ValueError, match="needs the worker ranks' transfer agents"):
        LLMEngine(model, tok, EngineConfig(tensor_parallel_size=2), connector=Shipping())
    with pytest.raises(ValueError, match=f"exceeds the {model.config.num_heads} attention heads"):
        LLMEngine(model, tok, EngineConfig(tensor_parallel_size=10))
    inter = model.config.intermediate_size
    with pytest.raises(ValueError, match=f"does not divide intermediate_size={inter}"):
        LLMEngine(model, tok, EngineConfig(tensor_parallel_size=5))


def tiny_model() -> LlamaForCausalLM:
    """A random 2-layer model with SmolLM2's head ratio (6 query heads, 3 KV heads): starts fast."""
    cfg = ModelConfig(
        vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=6, num_kv_heads=3,
        head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(0,), model_id="tiny", weights_hash="t",
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


# rank 0 in a process of its own (so that the test can SIGKILL it), with the same tiny model
RANK0 = f"""
import time
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.config import ModelConfig
from common.model.llama import LlamaForCausalLM

{inspect.getsource(tiny_model)}

if __name__ == "__main__":
    engine = LLMEngine(tiny_model(), None, EngineConfig(tensor_parallel_size=2, num_threads=1))
    print(" ".join(map(str, engine.tp_workers.alive)), flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_workers_exit_when_rank_0_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=root
    )
    try:
        assert proc.stdout is not None
        t0 = time.monotonic()
        pids = [int(p) for p in proc.stdout.readline().split()]
        print(f"rank 0 up after {time.monotonic() - t0:.1f} s")
        assert len(pids) == 1, "rank 0 did not start its worker"
        assert not any(_gone(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 20
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in pids), "a worker outlived rank 0"
        print(f"workers gone {time.monotonic() - t0:.1f} s after the start")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(120)
def test_a_dead_worker_fails_the_next_step() -> None:
    engine = LLMEngine(tiny_model(), None, EngineConfig(tensor_parallel_size=2, num_threads=1))  # type: ignore[arg-type]
    try:
        assert engine.tp_workers is not None
        (pid,) = engine.tp_workers.alive
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while engine.tp_workers.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 is gone"):
            engine.step()
    finally:
        engine.close()
