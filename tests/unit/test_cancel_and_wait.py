"""common.runtime.tasks.cancel_and_wait: a loop task whose cancellation is lost the way Python 3.11's
asyncio.wait_for loses one (redis-py sends every command through wait_for) is still stopped."""

from __future__ import annotations

import asyncio
import sys

import pytest

from common.runtime.tasks import cancel_and_wait


class Looper:
    """A task that loops on wait_for over a future the test completes, as a loop sending Redis
    commands does: each round's future is `fut`."""

    def __init__(self) -> None:
        self.rounds = 0
        self.fut: asyncio.Future[None] | None = None
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.rounds += 1
            self.fut = asyncio.get_running_loop().create_future()
            await asyncio.wait_for(self.fut, 60)

    async def waiting(self) -> None:
        while self.fut is None or self.fut.done():
            await asyncio.sleep(0)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for loses no cancellation from 3.12 on")
def test_a_plain_cancel_is_lost_when_the_awaited_call_completes_at_once() -> None:
    """What the helper is for: the call completes and the task is cancelled in the same step; wait_for
    returns the result, the cancellation is gone and the loop goes round again."""

    async def main() -> None:
        w = Looper()
        await w.waiting()
        assert w.fut is not None
        w.fut.set_result(None)
        w.task.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not w.task.done() and w.rounds == 2, "the cancellation was delivered"
        assert await cancel_and_wait(w.task)

    asyncio.run(main())


def test_cancel_and_wait_ends_a_task_whose_first_cancellation_is_lost() -> None:
    async def main() -> None:
        w = Looper()
        await w.waiting()
        assert w.fut is not None
        w.fut.set_result(None)  # and cancel_and_wait's first cancel() in the same step
        stopping = asyncio.ensure_future(cancel_and_wait(w.task, every_s=0.01))
        await asyncio.wait({stopping}, timeout=30)  # bounded: a helper that cancelled once waits forever
        assert stopping.done() and stopping.result(), "the task was not stopped"
        assert w.task.cancelled()
        assert w.rounds in (1, 2)  # 2 where the first cancel was lost (3.11)

    asyncio.run(main())


def test_cancel_and_wait_gives_up_after_its_timeout_and_collects_what_a_task_raised() -> None:
    async def main() -> None:
        refuse = [True]

        async def stubborn() -> None:
            while True:
                try:
                    await asyncio.Event().wait()  # until cancelled
                except asyncio.CancelledError:
                    if not refuse[0]:
                        raise ValueError("stopped with an error") from None

        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        assert not await cancel_and_wait(task, every_s=0.01, timeout_s=0.05)
        assert not task.done()
        refuse[0] = False
        assert await cancel_and_wait(task, every_s=0.01)
        assert isinstance(task.exception(), ValueError)

    asyncio.run(main())


def test_a_request_whose_client_left_is_stopped_even_if_it_swallows_a_cancel() -> None:
    """router.disconnect.until_disconnected: the client goes away; the request's task loses the first
    cancellation (as one lost inside a Redis call) and would go on for a client that is gone. It is
    cancelled again until it has ended, and the caller gets ClientGone."""
    from router.disconnect import ClientGone, until_disconnected

    class Gone:  # a request whose client has disconnected
        async def receive(self) -> dict[str, str]:
            return {"type": "http.disconnect"}

    cancels = []

    async def stubborn() -> str:
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancels.append(1)
                if len(cancels) > 1:
                    raise  # the second one ends it

    async def main() -> None:
        with pytest.raises(ClientGone):
            await asyncio.wait_for(until_disconnected(Gone(), stubborn()), 10)  # type: ignore[arg-type]

    asyncio.run(main())
    assert len(cancels) == 2
