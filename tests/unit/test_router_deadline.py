"""The rate limits' Redis deadline (router/access.py `within`) counts only time the router's loop was
free to read an answer: a loop that was busy past the deadline (a long step) does not turn an answer
into a timeout, while an answer that never comes still times out. The busy loop is simulated by blocking
it (time.sleep inside a callback): the stall itself is what is tested, nothing waits on it."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.access import within


def _answer_after(seconds: float, value: int) -> asyncio.Future[int]:
    """Redis' answer, arriving `seconds` from now."""
    loop = asyncio.get_running_loop()
    answer = loop.create_future()
    loop.call_later(seconds, answer.set_result, value)
    return answer


def _stall(seconds: float) -> None:
    time.sleep(seconds)  # the loop busy with something else: no callback, no I/O runs meanwhile


def test_an_answer_that_came_while_the_loop_was_busy_is_not_a_timeout() -> None:
    async def main() -> int:
        answer = _answer_after(0.01, 7)
        asyncio.get_running_loop().call_soon(_stall, 0.25)  # past the 0.1 s deadline
        return await within(answer, 0.1)

    assert asyncio.run(main()) == 7


def test_the_time_a_busy_loop_took_is_given_back() -> None:
    async def main() -> int:
        answer = _answer_after(0.35, 8)  # after the deadline, within the time the stall took
        asyncio.get_running_loop().call_soon(_stall, 0.3)  # the deadline (0.1 s) fires 0.2 s late
        return await within(answer, 0.1)

    assert asyncio.run(main()) == 8


def test_no_answer_is_a_timeout_and_the_call_is_cancelled() -> None:
    async def main() -> bool:
        gone = asyncio.Event()

        async def never() -> int:
            try:
                await asyncio.Event().wait()
            finally:
                gone.set()
            return 0

        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await within(never(), 0.1)
        assert time.monotonic() - t0 < 1.0
        return gone.is_set()

    assert asyncio.run(main())
