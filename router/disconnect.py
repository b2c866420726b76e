"""The client going away before its answer starts: noticed (`until_disconnected`) and answered
(`ClientGone`, a 499 nobody reads)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from common.runtime.tasks import cancel_and_wait

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before we answered."""


async def until_disconnected(request: Request, coro: Coroutine[Any, Any, T]) -> T:
    """Run coro; if the client disconnects first, cancel it and raise ClientGone.

    Starlette notices a disconnect only for streaming bodies, so before the answer starts (and for
    the whole of a non-streaming request) we listen for it ourselves.
    """
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # cancelled until ended: a cancel lost inside a call (Python 3.11's timeouts can swallow one)
        # would otherwise leave the request running for a client that is gone
        await cancel_and_wait(watcher)
        if not task.done():
            await cancel_and_wait(task)
    if task.cancelled():
        raise ClientGone()
    return task.result()
