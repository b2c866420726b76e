"""Typed control messages on an asyncio stream, one length-prefixed frame each (common.protocol framing)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from common.protocol import Message, ProtocolError, decode, frame, frame_length

MAX_CONTROL_FRAME = 1 << 20  # control messages are small (agent metadata is a few KiB); larger is garbage

Send = Callable[[Message], Awaitable[None]]  # one framed message, flushed
Recv = Callable[[Any, int], Awaitable[Any]]  # (expected type, frame limit) -> a message, None at a clean end


async def read_msg(reader: asyncio.StreamReader, expect: Any, limit: int = MAX_CONTROL_FRAME) -> Any | None:
    """One framed message of type `expect` (a struct or a Union); None at a clean end of stream.
    ProtocolError on garbage, a frame over `limit` bytes, or a message of another kind."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ProtocolError("connection closed inside a frame header") from e
        return None
    n = frame_length(head, limit)
    try:
        return decode(await reader.readexactly(n), expect)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError("connection closed inside a frame") from e


def write_msg(writer: asyncio.StreamWriter, msg: Message) -> None:
    """Queue one framed message (whole frames never interleave: write() only appends)."""
    writer.write(frame(msg))


def stream_io(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[Send, Recv]:
    """`send` and `recv` over a stream, for the steps every backend runs the same way (control.auth)."""

    async def send(msg: Message) -> None:
        write_msg(writer, msg)
        await writer.drain()

    async def recv(expect: Any, limit: int) -> Any | None:
        return await read_msg(reader, expect, limit)

    return send, recv
