"""The decode side of the tcp backend: a listener, one task per sender connection, layers received
straight into the KV tensors. The protocol is described in kv_transfer/backends/tcp/__init__.py."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import torch

from common.kv.kv_cache import PagedKVCache
from common.protocol import KVCompat, KVDone, ProtocolError, decode
from common.security.secret import InternalSecret
from kv_transfer.backends.tcp.sockio import recv_frame, recv_views, socket_io
from kv_transfer.base import ReceiverOwner
from kv_transfer.control.endpoint import Endpoint
from kv_transfer.control.framing import MAX_CONTROL_FRAME, Recv, Send
from kv_transfer.control.messages import KVHello, KVHelloReply, KVLayerHeader
from kv_transfer.control.preflight import HANDSHAKE_TIMEOUT_S, PreflightReceiver
from kv_transfer.layout import byte_view, check_layer_header, layer_views, unpack_heads

log = logging.getLogger(__name__)

SCRATCH = 1 << 20  # drained (stale) payloads are read through this many bytes at a time


def _staged(kv: PagedKVCache, n: int, heads: int = 0) -> torch.Tensor:
    """A host buffer for n blocks of K and V of one layer: (2, n, bs, heads or n_kv, hd)."""
    bs, n_kv, hd = kv.k.shape[2:]
    return torch.empty((2, n, bs, heads or n_kv, hd), dtype=kv.k.dtype)


class TcpReceiver(PreflightReceiver):
    _name = "tcp"

    def __init__(
        self,
        kv: PagedKVCache,
        compat: KVCompat,
        owner: ReceiverOwner,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        secret: InternalSecret | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        super().__init__(kv, compat, owner, secret, handshake_timeout_s)
        self._addr = (host, port)
        self._advertise = advertise_host
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writing: Counter[str] = Counter()  # request_id -> layers landing in the tensors right now
        self._idle = asyncio.Condition()
        self._scratch = bytearray(SCRATCH)  # shared by all connections: its contents are thrown away

    async def start(self) -> str:
        self._listener = socket.create_server(self._addr)
        self._listener.setblocking(False)
        self._spawn(self._accept_loop(self._listener))
        host, port = self._listener.getsockname()[:2]
        return str(Endpoint("tcp", self._advertise or host, port, self.incarnation))

    async def wait_idle(self, request_id: str) -> None:
        async with self._idle:
            await self._idle.wait_for(lambda: not self._writing[request_id])

    async def close(self) -> None:
        # Cancel first: a cancelled task unregisters its fd from the event loop before the socket closes.
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, peer = await loop.sock_accept(listener)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve(conn, f"{peer[0]}:{peer[1]}"))

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        loop = asyncio.get_running_loop()
        send, recv = socket_io(loop, conn)
        try:
            if not await self._authenticate(send, recv, peer) or not await self._preflight(send, recv, peer):
                return
            while (body := await recv_frame(loop, conn, MAX_CONTROL_FRAME)) is not None:
                msg = decode(body, KVLayerHeader | KVDone)
                if isinstance(msg, KVLayerHeader):
                    await self._recv_layer(conn, msg)
                else:
                    self.stats.dones_received += 1
                    self._notify_done(msg)
        except ValueError as e:  # ProtocolError, an oversized frame, a bad header
            self.stats.bad_messages += 1
            log.error("kv tcp: closing the connection from %s: %s", peer, e)
        except OSError as e:
            log.warning("kv tcp: connection from %s lost: %s", peer, e or type(e).__name__)
        finally:
            conn.close()

    async def _preflight(self, send: Send, recv: Recv, peer: str) -> bool:
        """The compatibility preflight on an authenticated connection: True when it passed."""
        try:
            async with asyncio.timeout(self.handshake_timeout_s):
                hello = await recv(KVHello, MAX_CONTROL_FRAME)
            if hello is None:
                return False
            problems, sender = self._compat_problems(hello.compat), hello.sender_id
        except ProtocolError as e:  # another protocol version, or not a hello: say so before closing
            problems, sender = [str(e)], "?"
        error = self._refusal(peer, sender, problems) if problems else ""
        await send(KVHelloReply(ok=not problems, error=error, incarnation=self.incarnation))
        return not problems

    async def _recv_layer(self, conn: socket.socket, h: KVLayerHeader) -> None:
        loop = asyncio.get_running_loop()
        why = check_layer_header(h, self.kv)
        if why is not None:
            raise ProtocolError(f"bad kv_layer header (request {h.request_id!r}): {why}")
        if not self._accepts(h.request_id, h.fence):
            # The blocks may have been freed and reused: read the payload off the wire, write nothing.
            left = h.nbytes
            while left:
                n = min(left, SCRATCH)
                await recv_views(loop, conn, [memoryview(self._scratch)[:n]])
                left -= n
            self.stats.stale_drops += 1
            return
        self._writing[h.request_id] += 1
        try:
            if h.head_count and h.head_count < self.kv.spec.num_kv_heads:  # some of our heads: scatter
                staged = _staged(self.kv, len(h.block_ids), h.head_count)  # (2, n, bs, count, hd)
                await recv_views(loop, conn, [byte_view(staged)])
                unpack_heads(self.kv, h.layer, h.block_ids, h.head_start, staged)
            elif self.kv.k.device.type == "cpu":  # every head of our shard: the plain block layout
                await recv_views(loop, conn, layer_views(self.kv, h.layer, h.block_ids))
            else:
                staged = _staged(self.kv, len(h.block_ids))  # (2, n, bs, n_kv, hd)
                await recv_views(loop, conn, [byte_view(staged)])
                idx = torch.tensor(h.block_ids, dtype=torch.long, device=self.kv.k.device)
                self.kv.layer_k(h.layer)[idx] = staged[0].to(self.kv.k.device)
                self.kv.layer_v(h.layer)[idx] = staged[1].to(self.kv.v.device)
            self._arrived(h.request_id, h.fence, h.layer, h.nbytes)
        finally:
            self._writing[h.request_id] -= 1
            if not self._writing[h.request_id]:
                del self._writing[h.request_id]
            async with self._idle:
                self._idle.notify_all()
