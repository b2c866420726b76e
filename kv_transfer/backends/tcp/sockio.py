"""Scatter/gather I/O on a non-blocking socket from asyncio: writev/readv straight from/into tensor memory.

`loop.sock_sendall`/`sock_recv_into` take one buffer per call (one future each); a layer with many
non-adjacent blocks is many buffers, so these helpers hand the kernel up to IOV_MAX of them per syscall
(sendmsg / recvmsg_into) and only fall back to the event loop when the socket would block.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from common.protocol import Message, decode, frame, frame_length
from kv_transfer.control.framing import Recv, Send

IOV_MAX = 1024  # Linux's limit on buffers per sendmsg/recvmsg call


async def _ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, write: bool) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        # The selector may report the fd again before our task runs; set the result only once.
        if not fut.done():
            fut.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await fut
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first n bytes from a list of buffers."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if n:
        rest[0] = rest[0][n:]
    return rest


async def send_views(loop: asyncio.AbstractEventLoop, sock: socket.socket, views: list[memoryview]) -> None:
    """Send every byte of `views`, in order (zero-copy gather)."""
    views = [v for v in views if len(v)]
    while views:
        try:
            n = sock.sendmsg(views[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await _ready(loop, sock, write=True)
            continue
        views = _advance(views, n)


async def recv_views(loop: asyncio.AbstractEventLoop, sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every byte of `views`, in order (zero-copy scatter); ConnectionError on EOF before that."""
    views = [v for v in views if len(v)]
    while views:
        try:
            n, _, _, _ = sock.recvmsg_into(views[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await _ready(loop, sock, write=False)
            continue
        if n == 0:
            raise ConnectionError("peer closed the connection mid-message")
        views = _advance(views, n)


async def recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, max_len: int) -> bytes | None:
    """One length-prefixed frame body; None when the peer hung up before the next frame's body began."""
    head = bytearray(4)
    try:
        await recv_views(loop, sock, [memoryview(head)])
    except ConnectionError:
        return None
    n = frame_length(bytes(head), max_len)  # ProtocolError past the limit, before allocating
    body = bytearray(n)
    await recv_views(loop, sock, [memoryview(body)])
    return bytes(body)


def socket_io(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[Send, Recv]:
    """`send` and `recv` of framed messages on the socket, for the steps every backend runs the same way
    (control.auth)."""

    async def send(msg: Message) -> None:
        await send_views(loop, sock, [memoryview(frame(msg))])

    async def recv(expect: Any, limit: int) -> Any | None:
        body = await recv_frame(loop, sock, limit)
        return None if body is None else decode(body, expect)

    return send, recv
