"""Stopping a background task for sure.

`task.cancel(); await task` can wait forever under Python 3.11. There asyncio.wait_for, on being
cancelled, returns the awaited call's result instead of raising when that call completed in the same
loop iteration (CPython gh-86296; wait_for was rewritten on asyncio.timeout in 3.12). redis-py sends
every command through wait_for whenever the connection has a socket timeout, and since redis-py 8 every
connection has one unless told otherwise (5 s). So a cancel() that lands while a loop task sends a Redis
command can be lost, and the task goes on looping: its owner's stop() then never returns. That hung a
KV-index test for its whole timeout in 3 of about 25 full test runs; run alone in a loop, that test
file hung within 1 to 83 runs in 4 tries of 5.

Our own code waits with `async with asyncio.timeout(...)` instead: it awaits in the task itself, so a
cancellation is raised there whatever else completes (and 3.11's Timeout tells its own expiry from an
outside cancel). redis-py's wait_for is not ours to change; that is what cancel_and_wait is for.

cancel_and_wait cancels again, every `every_s`, until the task has ended. A task that swallows one
cancellation reaches its next await soon (a loop sleeps or sends its next command), and the next
cancel() is delivered there. It is for loops with nothing to clean up once cancelled: a task still
cleaning up (a finally that awaits, say a record write) when the next cancel() comes would have that
clean-up cut short. A request's task, which records how it ended, is cancelled once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


async def cancel_and_wait(
    task: asyncio.Future[Any], every_s: float = 0.1, timeout_s: float | None = None
) -> bool:
    """Cancel `task` until it has ended; True once it has, False if `timeout_s` passed first.

    What the task raised or returned is not looked at (a loop being stopped has nothing to say).
    Cancelling the caller meanwhile propagates as usual and leaves the task cancelled once more."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not task.done():
        task.cancel()
        wait_s = every_s if deadline is None else min(every_s, deadline - time.monotonic())
        if wait_s <= 0:
            return False
        await asyncio.wait({task}, timeout=wait_s)
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at garbage collection
    return True
