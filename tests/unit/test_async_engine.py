"""The engine thread when a step raises: it stops stepping, every command waiting or sent later fails
with the reason, and the owner hears it once (a service exits there)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import pytest

from common.engine.api import Finish
from common.engine.async_engine import AsyncEngine
from common.engine.llm_engine import LLMEngine


class BrokenEngine:
    """An engine (a small fake) with work to do whose step raises, as a half-run step or a lost rank does."""

    def __init__(self) -> None:
        self.handled: list[Any] = []
        self.may_step = threading.Event()

    def has_unfinished(self) -> bool:
        return self.may_step.is_set()

    def handle(self, cmd: Any) -> None:
        self.handled.append(cmd)

    def step(self) -> Any:
        raise RuntimeError("tensor-parallel rank 1 is gone")


def test_a_failed_step_fails_every_command_and_tells_the_owner_once() -> None:
    async def main() -> None:
        fake = BrokenEngine()
        ae = AsyncEngine(cast(LLMEngine, fake))
        heard: list[str] = []
        ae.on_fatal = heard.append
        ae.start()
        assert await ae.submit(Finish("a", "abort")) is None  # before the failure: handled
        fake.may_step.set()
        for _ in range(100):
            if ae.failure is not None:
                break
            await asyncio.sleep(0.05)
        assert ae.failure == "engine step failed: RuntimeError('tensor-parallel rank 1 is gone')"
        assert heard == [ae.failure]
        with pytest.raises(RuntimeError, match="rank 1 is gone"):
            await ae.submit(Finish("b", "abort"))  # refused, never left waiting
        ae.stop()

    asyncio.run(main())
