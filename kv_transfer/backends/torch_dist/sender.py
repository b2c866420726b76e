"""The prefill side of the torch_dist backend: per receiver a control connection and a two-rank process
group whose thread sends packed layers. The protocol and its guarantees are in
kv_transfer/backends/torch_dist/__init__.py."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import logging
from typing import Any

import torch
import torch.distributed as dist

from common.kv.kv_cache import PagedKVCache
from common.protocol import KVCompat, KVDone, ProtocolError
from common.security.secret import InternalSecret
from kv_transfer.backends.torch_dist.messages import KVTorchDistHello, KVTorchDistHelloReply
from kv_transfer.backends.torch_dist.pair import (
    JOIN_S,
    RECEIVER_RANK,
    SENDER_RANK,
    PairWorker,
    group_backends,
    join_all,
    make_group,
    p2p,
    staging_device,
)
from kv_transfer.base import HeadSlice, TransferError
from kv_transfer.control.endpoint import Endpoint
from kv_transfer.control.framing import write_msg
from kv_transfer.control.messages import KVLayerHeader
from kv_transfer.control.preflight import PreflightSender, drain_control
from kv_transfer.layout import block_bytes, pack_heads, slice_bytes

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Peer:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    worker: PairWorker
    device: torch.device  # where layers are packed (the staging buffers' device)
    num_blocks: int
    free: list[torch.Tensor] = dataclasses.field(default_factory=list)  # staging buffers not in flight
    task: asyncio.Task[None] | None = None  # reads the control connection: its end drops the peer
    broken: str = ""

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 staging buffer of at least nbytes, owned by the caller until `give`."""
        for i, buf in enumerate(self.free):
            if buf.numel() >= nbytes:
                return self.free.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buf: torch.Tensor, _: object = None) -> None:
        self.free.append(buf)


class TorchDistSender(PreflightSender[_Peer]):
    def __init__(
        self,
        kv: PagedKVCache,
        compat: KVCompat,
        sender_id: str = "",
        connect_timeout: float = 10.0,
        op_timeout_s: float = 60.0,
        secret: InternalSecret | None = None,
    ) -> None:
        super().__init__(kv, compat, sender_id, connect_timeout, secret)
        self.op_timeout_s = op_timeout_s  # a send taking longer breaks the pair
        self._workers: set[PairWorker] = set()  # every pair's thread not joined yet

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
        peer = await self._peer(endpoint)
        # A header the receiver refuses closes the pair with our bytes already posted: check for it.
        self._check_destination(peer.num_blocks, dst_block_ids)
        if not dst_block_ids:
            return
        per_block = block_bytes(self.kv) if heads is None else slice_bytes(self.kv, heads.count)
        nbytes = len(dst_block_ids) * 2 * per_block
        buf = peer.take(nbytes)
        packed = self._pack(buf, layer, src_block_ids, heads)  # a copy: the send no longer reads the cache
        start, count = (0, 0) if heads is None else (heads.dst_start, heads.count)
        ids = list(dst_block_ids)
        header = KVLayerHeader(request_id, fence, layer, ids, nbytes, traceparent, start, count)
        # Header and job are queued in one step of the loop: the control stream and the group's stream
        # carry layers in the same order.
        write_msg(peer.writer, header)
        sent = peer.worker.submit(functools.partial(self._send, peer, buf[:nbytes], packed))
        sent.add_done_callback(functools.partial(peer.give, buf))
        await self._drain(endpoint, peer)
        try:
            # Not cancellable: the header is out, so these bytes must follow it or the stream is lost.
            await asyncio.shield(sent)
        except TransferError as e:
            self._drop(endpoint, peer, str(e))
            raise TransferError(f"sending layer {layer} of {request_id!r} to {endpoint} failed: {e}") from e
        self.stats.layers_sent += 1
        self.stats.bytes_sent += nbytes

    async def send_done(self, endpoint: str, msg: KVDone) -> None:
        peer = await self._peer(endpoint)
        write_msg(peer.writer, msg)  # the receiver holds it until this pair's earlier layers are in
        await self._drain(endpoint, peer)
        self.stats.dones_sent += 1

    async def close(self) -> None:
        for endpoint, peer in list(self._peers.items()):
            self._drop(endpoint, peer, "sender closed")
        await join_all(self._workers, JOIN_S)

    # --- per layer ------------------------------------------------------------------------------------
    def _pack(self, buf: torch.Tensor, layer: int, src_block_ids: list[int], heads: HeadSlice | None) -> Any:
        """Gather layer `layer` of the source blocks (only `heads` of each, when given) into buf in wire
        order: (2, n, bs, n_kv or heads.count, hd). Returns the CUDA event that marks the gather done when
        it runs on a device stream, else None."""
        k = self.kv.k
        n = len(src_block_ids)
        if heads is not None:  # pack_heads copies synchronously to a host buffer from a CUDA cache
            bs, _, hd = k.shape[2:]
            sliced = buf[: n * 2 * slice_bytes(self.kv, heads.count)].view(k.dtype)
            sliced = sliced.view(2, n, bs, heads.count, hd)
            pack_heads(self.kv, layer, src_block_ids, heads.src_start, heads.count, out=sliced)
        else:
            staged = buf[: n * 2 * block_bytes(self.kv)].view(k.dtype).view(2, n, *k.shape[2:])
            idx = torch.tensor(src_block_ids, dtype=torch.long, device=k.device)
            if staged.device != k.device:  # a CUDA cache over gloo: a synchronous copy to host
                staged[0].copy_(self.kv.layer_k(layer)[idx])
                staged[1].copy_(self.kv.layer_v(layer)[idx])
                return None
            torch.index_select(self.kv.layer_k(layer), 0, idx, out=staged[0])
            torch.index_select(self.kv.layer_v(layer), 0, idx, out=staged[1])
        if k.device.type != "cuda" or buf.device != k.device:
            return None
        event = torch.cuda.Event()
        event.record()  # on this thread's stream; the pair's thread makes its own stream wait for it
        return event

    def _send(self, peer: _Peer, buf: torch.Tensor, packed: Any) -> None:
        if packed is not None:
            torch.cuda.current_stream(buf.device).wait_event(packed)
        p2p(peer.worker.group, "send", buf, RECEIVER_RANK)

    # --- per peer -------------------------------------------------------------------------------------
    async def _connect(self, endpoint: str) -> _Peer:
        ep = Endpoint.parse(endpoint, "torch_dist")
        offered = group_backends(self.kv)

        def check(reply: KVTorchDistHelloReply) -> None:
            if reply.ok and reply.backend not in offered:
                raise ProtocolError(f"the receiver chose backend {reply.backend!r}; we offered {offered}")

        hello = KVTorchDistHello(compat=self.compat, sender_id=self.sender_id, backends=offered)
        reader, writer, reply = await self._open_control(
            endpoint, ep.host, ep.port, hello, KVTorchDistHelloReply, check
        )
        local = writer.get_extra_info("sockname")[0]  # the address the receiver sees us at
        peer = _Peer(
            reader,
            writer,
            PairWorker(f"kv-torch-dist-tx-{endpoint}"),
            staging_device(self.kv, reply.backend),
            reply.num_blocks,
        )
        self._workers.add(peer.worker)

        def build() -> None:
            timeout = datetime.timedelta(seconds=self.connect_timeout)
            store = dist.TCPStore(ep.host, reply.store_port, None, False, timeout=timeout)
            group_store = dist.PrefixStore(reply.group, store)
            peer.worker.group = make_group(reply.backend, group_store, SENDER_RANK, local, self.op_timeout_s)

        try:
            await asyncio.shield(peer.worker.submit(build))
        except BaseException as e:  # TransferError, or cancelled: the half-built pair is useless either way
            peer.worker.stop()
            writer.close()
            if isinstance(e, TransferError):
                raise TransferError(f"cannot build the process group with {endpoint}: {e}") from e
            raise
        peer.task = asyncio.get_running_loop().create_task(self._read_loop(endpoint, peer))
        return peer

    async def _read_loop(self, endpoint: str, peer: _Peer) -> None:
        """The receiver sends nothing after its hello reply: anything else, or the end, ends the pair."""
        try:
            data = await peer.reader.read(1)
            why = "unexpected bytes from the receiver" if data else "connection closed by the receiver"
        except OSError as e:
            why = str(e)
        self._drop(endpoint, peer, why)

    def _retire(self, endpoint: str, peer: _Peer) -> None:
        self._drop(endpoint, peer, "the receiver restarted (a new incarnation at its address)")

    async def _drain(self, endpoint: str, peer: _Peer) -> None:
        await drain_control(endpoint, peer, self._drop)

    def _drop(self, endpoint: str, peer: _Peer, why: str) -> None:
        """Forget a peer: its queued sends fail, its group closes after the running one; the next call
        to this endpoint builds a new pair."""
        if peer.broken:
            return
        peer.broken = why
        if why != "sender closed":
            log.warning("kv torch_dist: dropping the pair with %s: %s", endpoint, why)
        peer.writer.close()
        peer.worker.stop()
        if peer.task is not None and peer.task is not asyncio.current_task():
            peer.task.cancel()
        if self._peers.get(endpoint) is peer:
            del self._peers[endpoint]
