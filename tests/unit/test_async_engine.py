"""The engine thread: the load it publishes after every step and command (what services report, read
without touching the engine), and what happens when a step raises: it stops stepping, every command
waiting or sent later fails with the reason, and the owner hears it once (a service exits there)."""

from __future__ import annotations

import ast
import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from common.config import EngineConfig
from common.engine.api import AddRequest, EngineLoad, Finish
from common.engine.async_engine import AsyncEngine
from common.engine.llm_engine import LLMEngine
from common.model.llama import LlamaForCausalLM
from common.sampling_params import SamplingParams
from common.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
# What the engine thread changes at every step: a service that reads one of them from the event loop
# reads state mid-change. The services read the engine's published EngineLoad instead.
ENGINE_INTERNALS = {"scheduler", "block_manager", "speed"}
SERVICE_CODE = ("common/service", "common/runtime", "prefill_service", "decode_service")


class BrokenEngine:
    """An engine (a small fake) with work to do whose step raises, as a half-run step or a lost rank does."""

    def __init__(self) -> None:
        self.handled: list[Any] = []
        self.may_step = threading.Event()

    def has_unfinished(self) -> bool:
        return self.may_step.is_set()

    def load(self) -> EngineLoad:
        return EngineLoad()

    def handle(self, cmd: Any) -> None:
        self.handled.append(cmd)

    def step(self) -> Any:
        raise RuntimeError("tensor-parallel rank 1 is gone")


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Poll cond() from the event loop every 10 ms; AssertionError naming `what` past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_failed_step_fails_every_command_and_tells_the_owner_once() -> None:
    async def main() -> None:
        fake = BrokenEngine()
        ae = AsyncEngine(cast(LLMEngine, fake))
        heard: list[str] = []
        ae.on_fatal = heard.append
        ae.start()
        assert await ae.submit(Finish("a", "abort")) is None  # before the failure: handled
        fake.may_step.set()
        await until(lambda: ae.failure is not None, "the step to fail")
        assert ae.failure == "engine step failed: RuntimeError('tensor-parallel rank 1 is gone')"
        assert heard == [ae.failure]
        with pytest.raises(RuntimeError, match="rank 1 is gone"):
            await ae.submit(Finish("b", "abort"))  # refused, never left waiting
        ae.stop()

    asyncio.run(main())


def test_the_load_is_published_at_start_after_each_command_and_after_each_step(
    tiny: tuple[LlamaForCausalLM, Tokenizer],
) -> None:
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1, kv_cache_memory_mb=16))
    permits = threading.Semaphore(0)  # one per step the engine thread may take
    real_step = engine.step

    def gated_step() -> Any:
        permits.acquire()
        return real_step()

    engine.step = gated_step  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    a, b = list(range(10, 30)), list(range(40, 65))

    async def main() -> None:
        ae = AsyncEngine(engine)
        total = engine.block_manager.num_blocks
        budget = engine.config.max_num_batched_tokens
        # at start, before any step
        assert ae.load == EngineLoad(free_blocks=total, total_blocks=total, step_tokens=budget)
        ae.start()
        await ae.submit(AddRequest("a", a, params))
        load = ae.load  # published before the caller resumed; no step has run
        assert (load.waiting, load.running, load.queued_tokens, load.free_blocks) == (1, 0, len(a), total)
        assert load.oldest_arrival is not None and load.queue_wait_s(time.monotonic()) >= 0

        pending = asyncio.create_task(ae.submit(AddRequest("b", b, params)))
        # b's command is queued behind the held step: the engine thread applies it right after
        await until(lambda: ae._commands.qsize() == 1, "b's command to be queued")
        permits.release()  # step 1: a is admitted (one batch slot) and prefilled
        await pending
        load = ae.load
        assert ae.steps == 1
        assert (load.running, load.waiting, load.queued_tokens) == (1, 1, len(b))  # b waits for the slot
        assert load.free_blocks == total - engine.block_manager.blocks_needed(len(a) + 1)
        assert load.prefill_tps > 0  # the step's speed comes with it

        before = ae.load
        permits.release()  # step 2, no command: a decodes
        await until(lambda: ae.steps == 2, "step 2")
        assert ae.load is not before  # a new value, never one changed in place
        assert (ae.load.running, ae.load.waiting) == (1, 1)
        assert ae.load.queue_wait_s(time.monotonic()) > 0  # b has waited since it arrived

        permits.release(1000)
        await ae.submit(Finish("a", "abort"))
        await ae.submit(Finish("b", "abort"))
        load = ae.load  # nothing left to step: this is what an idle engine shows
        assert (load.running, load.waiting, load.queued_tokens, load.free_blocks) == (0, 0, 0, total)
        assert load.oldest_arrival is None and load.queue_wait_s(time.monotonic()) == 0
        ae.stop()

    asyncio.run(main())


def test_service_code_never_reads_the_engines_internals() -> None:
    """The event loop reads the engine only through what the engine thread hands over (commands,
    results, the published EngineLoad): a regression shows here as an attribute named."""
    reached = [
        f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}"
        for folder in SERVICE_CODE
        for path in sorted((ROOT / folder).glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS
    ]
    assert not reached, f"service code reads engine internals across threads: {reached}"
