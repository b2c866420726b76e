"""The `tcp` KV transport: one TCP connection per (sender, receiver) pair, reused for every request.

Connection = KVHello → KVHelloReply (the compatibility preflight; refused → the receiver closes), then
any number of messages, each a length-prefixed msgpack frame (common.protocol.frame):

    KVLayerHeader{request_id, fence, layer, block_ids, nbytes}   followed by exactly nbytes raw bytes
                 in the order of kv_transfer.layout (K of each block in block_ids order, then V of each)
    KVDone{request_id, fence, first_token, num_tokens}           no payload

The receiver reads the raw bytes straight into its KV tensors (recvmsg_into over the destination runs),
after checking the header (layer and block ids in range, nbytes exact) and the fence. A bad header closes
the connection before any byte is written; a stale fence reads the payload into scratch and drops it.
Caches on a device are staged through one host buffer per layer (this backend moves host bytes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import torch

from common.kv.kv_cache import PagedKVCache
from common.protocol import (
    KVCompat,
    KVDone,
    KVHello,
    KVHelloReply,
    KVLayerHeader,
    ProtocolError,
    decode,
    frame,
)

from .base import AcceptFn, DoneFn, TransferError
from .handshake import PreflightReceiver, PreflightSender, endpoint_url
from .layout import block_bytes, byte_view, check_layer_header, layer_views
from .sockio import recv_frame, recv_views, send_views

log = logging.getLogger(__name__)

MAX_HEADER = 1 << 20  # a header frame is block ids + names; anything larger is garbage, not a header
SCRATCH = 1 << 20  # drained (stale) payloads are read through this many bytes at a time


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """ "tcp://host:port" (host may be "[v6addr]") -> (host, port)."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp endpoint: {endpoint!r} (expected tcp://host:port)")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a tcp endpoint: {endpoint!r} (expected tcp://host:port)")
    return host.strip("[]"), int(port)


def _staged(kv: PagedKVCache, n: int) -> torch.Tensor:
    """A host buffer for n blocks of K and V of one layer: (2, n, bs, n_kv, hd)."""
    return torch.empty((2, n, *kv.k.shape[2:]), dtype=kv.k.dtype)


class TcpReceiver(PreflightReceiver):
    _name = "tcp"

    def __init__(
        self,
        kv: PagedKVCache,
        compat: KVCompat,
        accept: AcceptFn,
        on_done: DoneFn,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        super().__init__(kv, compat, accept, on_done)
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
        return endpoint_url("tcp", self._advertise or host, port)

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
        try:
            if not await self._preflight(conn, peer):
                return
            while (body := await recv_frame(loop, conn, MAX_HEADER)) is not None:
                msg = decode(body)
                if isinstance(msg, KVLayerHeader):
                    await self._recv_layer(conn, msg)
                elif isinstance(msg, KVDone):
                    self.stats.dones_received += 1
                    self._notify_done(msg)
                else:
                    raise ProtocolError(f"unexpected {msg.kind!r} message on a KV connection")
        except ValueError as e:  # ProtocolError, an oversized frame, a bad header
            self.stats.bad_messages += 1
            log.error("kv tcp: closing the connection from %s: %s", peer, e)
        except OSError as e:
            log.warning("kv tcp: connection from %s lost: %s", peer, e)
        finally:
            conn.close()

    async def _preflight(self, conn: socket.socket, peer: str) -> bool:
        loop = asyncio.get_running_loop()
        body = await recv_frame(loop, conn, MAX_HEADER)
        if body is None:
            return False
        hello = decode(body, expect=KVHello)
        problems = self._compat_problems(hello.compat)
        error = self._refusal(peer, hello.sender_id, problems) if problems else ""
        reply = KVHelloReply(ok=not problems, error=error)
        await send_views(loop, conn, [memoryview(frame(reply))])
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
            if self.kv.k.device.type == "cpu":
                await recv_views(loop, conn, layer_views(self.kv, h.layer, h.block_ids))
            else:
                staged = _staged(self.kv, len(h.block_ids))  # (2, n, bs, n_kv, hd)
                await recv_views(loop, conn, [byte_view(staged)])
                idx = torch.tensor(h.block_ids, dtype=torch.long, device=self.kv.k.device)
                self.kv.k[h.layer, idx] = staged[0].to(self.kv.k.device)
                self.kv.v[h.layer, idx] = staged[1].to(self.kv.v.device)
        finally:
            self._writing[h.request_id] -= 1
            if not self._writing[h.request_id]:
                del self._writing[h.request_id]
            async with self._idle:
                self._idle.notify_all()
        self.stats.layers_received += 1
        self.stats.bytes_received += h.nbytes


@dataclasses.dataclass
class _Peer:
    sock: socket.socket
    lock: asyncio.Lock  # one message at a time on the stream: header and payload must not interleave


class TcpSender(PreflightSender[_Peer]):
    def __init__(
        self, kv: PagedKVCache, compat: KVCompat, sender_id: str = "", connect_timeout: float = 10.0
    ) -> None:
        super().__init__(kv, compat, sender_id, connect_timeout)

    async def send_layer(
        self,
        endpoint: str,
        request_id: str,
        fence: int,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        traceparent: str | None = None,
    ) -> None:
        self._check_source(layer, src_block_ids, dst_block_ids)
        nbytes = len(dst_block_ids) * 2 * block_bytes(self.kv)
        header = KVLayerHeader(request_id, fence, layer, list(dst_block_ids), nbytes, traceparent)
        if self.kv.k.device.type == "cpu":
            payload = layer_views(self.kv, layer, src_block_ids)
        else:
            idx = torch.tensor(src_block_ids, dtype=torch.long, device=self.kv.k.device)
            payload = [byte_view(torch.stack([self.kv.k[layer, idx], self.kv.v[layer, idx]]).cpu())]
        await self._send(endpoint, [memoryview(frame(header)), *payload])
        self.stats.layers_sent += 1
        self.stats.bytes_sent += nbytes

    async def send_done(self, endpoint: str, msg: KVDone) -> None:
        await self._send(endpoint, [memoryview(frame(msg))])
        self.stats.dones_sent += 1

    async def close(self) -> None:
        for peer in self._peers.values():
            peer.sock.close()
        self._peers.clear()

    async def _send(self, endpoint: str, views: list[memoryview]) -> None:
        peer = await self._peer(endpoint)
        async with peer.lock:
            try:
                await send_views(asyncio.get_running_loop(), peer.sock, views)
            except OSError as e:
                self._drop(endpoint, peer)
                raise TransferError(f"sending to {endpoint} failed: {e}") from e
            except asyncio.CancelledError:
                self._drop(endpoint, peer)  # half a message is on the wire: this stream cannot continue
                raise

    def _drop(self, endpoint: str, peer: _Peer) -> None:
        peer.sock.close()
        if self._peers.get(endpoint) is peer:
            del self._peers[endpoint]

    async def _connect(self, endpoint: str) -> _Peer:
        loop = asyncio.get_running_loop()
        host, port = parse_endpoint(endpoint)
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                family, kind, proto, _, addr = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[
                    0
                ]
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, addr)
                hello = KVHello(compat=self._hello_compat(), sender_id=self.sender_id)
                await send_views(loop, sock, [memoryview(frame(hello))])
                body = await recv_frame(loop, sock, MAX_HEADER)
            if body is None:
                raise ConnectionError("connection closed during the preflight")
            reply = decode(body, expect=KVHelloReply)
        except (OSError, TimeoutError, ValueError) as e:
            if sock is not None:
                sock.close()
            raise TransferError(f"cannot open a KV connection to {endpoint}: {e}") from e
        if not reply.ok:
            sock.close()
            raise self._refuse(endpoint, reply.error)
        return _Peer(sock, asyncio.Lock())
