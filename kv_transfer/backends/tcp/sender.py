"""The prefill side of the tcp backend: one connection per receiver, header frame + raw bytes per layer.
The protocol is described in kv_transfer/backends/tcp/__init__.py."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import torch

from common.kv.kv_cache import PagedKVCache
from common.protocol import KVCompat, KVDone, frame
from common.security.secret import InternalSecret
from kv_transfer.backends.tcp.sockio import send_views, socket_io
from kv_transfer.base import HeadSlice, TransferError
from kv_transfer.control.endpoint import Endpoint
from kv_transfer.control.framing import MAX_CONTROL_FRAME
from kv_transfer.control.messages import KVHello, KVHelloReply, KVLayerHeader
from kv_transfer.control.preflight import PreflightSender
from kv_transfer.layout import block_bytes, byte_view, layer_views, pack_heads, slice_bytes


@dataclasses.dataclass
class _Peer:
    sock: socket.socket
    lock: asyncio.Lock  # one message at a time on the stream: header and payload must not interleave


class TcpSender(PreflightSender[_Peer]):
    def __init__(
        self,
        kv: PagedKVCache,
        compat: KVCompat,
        sender_id: str = "",
        connect_timeout: float = 10.0,
        secret: InternalSecret | None = None,
    ) -> None:
        super().__init__(kv, compat, sender_id, connect_timeout, secret)

    async def send_layer(
        self,
        endpoint: str,
        request_id: str,
        fence: int,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        traceparent: str | None = None,
        heads: HeadSlice | None = None,
    ) -> None:
        self._check_source(layer, src_block_ids, dst_block_ids, heads)
        if heads is None:
            nbytes = len(dst_block_ids) * 2 * block_bytes(self.kv)
            header = KVLayerHeader(request_id, fence, layer, list(dst_block_ids), nbytes, traceparent)
        else:
            nbytes = len(dst_block_ids) * 2 * slice_bytes(self.kv, heads.count)
            ids, start, count = list(dst_block_ids), heads.dst_start, heads.count
            header = KVLayerHeader(request_id, fence, layer, ids, nbytes, traceparent, start, count)
        if heads is not None and heads.count < self.kv.spec.num_kv_heads:
            packed = pack_heads(self.kv, layer, src_block_ids, heads.src_start, heads.count)
            payload = [byte_view(packed.cpu())]
        elif self.kv.k.device.type == "cpu":  # every head of our shard: the packed slice is the blocks
            payload = layer_views(self.kv, layer, src_block_ids)
        else:
            idx = torch.tensor(src_block_ids, dtype=torch.long, device=self.kv.k.device)
            payload = [
                byte_view(torch.stack([self.kv.layer_k(layer)[idx], self.kv.layer_v(layer)[idx]]).cpu())
            ]
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
        ep = Endpoint.parse(endpoint, "tcp")
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                addrs = await loop.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
                family, kind, proto, _, addr = addrs[0]
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, addr)
                send, recv = socket_io(loop, sock)
                await self._authenticate(endpoint, send, recv)
                await send(KVHello(compat=self.compat, sender_id=self.sender_id))
                reply = await recv(KVHelloReply, MAX_CONTROL_FRAME)
            if reply is None:
                raise ConnectionError("connection closed during the preflight")
        except (OSError, TimeoutError, ValueError) as e:
            if sock is not None:
                sock.close()
            raise TransferError(f"cannot open a KV connection to {endpoint}: {e or type(e).__name__}") from e
        except BaseException:  # refused (PreflightError, AuthError), or cancelled
            if sock is not None:
                sock.close()
            raise
        if not reply.ok:
            sock.close()
            raise self._refuse(endpoint, reply.error)
        try:
            self._check_incarnation(endpoint, reply.incarnation)
        except TransferError:
            sock.close()
            raise
        return _Peer(sock, asyncio.Lock())

    def _retire(self, endpoint: str, peer: _Peer) -> None:
        self._drop(endpoint, peer)
