"""Work that outlives whoever started it: the cleanup of a request whose client went away runs to its
end (`shielded`), and a best-effort call nobody waits for runs on (`spawn`). Both are kept referenced
until they finish (the event loop holds tasks only weakly)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

_background: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Run `coro` in the background, referenced until it ends."""
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def shielded(coro: Coroutine[Any, Any, None]) -> None:
    """Run cleanup to the end even when the caller is being cancelled (the client went away)."""
    await asyncio.shield(spawn(coro))
