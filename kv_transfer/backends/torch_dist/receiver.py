"""The decode side of the torch_dist backend: a control listener, a TCPStore for rendezvous, and per
sender a two-rank process group whose thread receives layers and scatters them into the cache. The
protocol and its guarantees are described in kv_transfer/backends/torch_dist/__init__.py."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import logging
import uuid
from collections import Counter
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
    sync,
)
from kv_transfer.base import ReceiverOwner, TransferError
from kv_transfer.control.endpoint import Endpoint
from kv_transfer.control.framing import read_msg, stream_io, write_msg
from kv_transfer.control.messages import KVLayerHeader
from kv_transfer.control.preflight import HANDSHAKE_TIMEOUT_S, PreflightReceiver
from kv_transfer.layout import check_layer_header, unpack_heads

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Pair:
    """One sender: its control connection and its process group's thread."""

    writer: asyncio.StreamWriter
    peer: str
    worker: PairWorker
    device: torch.device  # where layers are received (the staging buffer's device)
    pending: set[asyncio.Future[Any]] = dataclasses.field(default_factory=set)  # layers not landed yet
    staging: torch.Tensor | None = None  # uint8, grown to the largest layer; used by the worker only
    broken: str = ""


class TorchDistReceiver(PreflightReceiver):
    _name = "torch_dist"

    def __init__(
        self,
        kv: PagedKVCache,
        compat: KVCompat,
        owner: ReceiverOwner,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        op_timeout_s: float = 60.0,
        secret: InternalSecret | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        super().__init__(kv, compat, owner, secret, handshake_timeout_s)
        self._addr = (host, port)
        self._advertise = advertise_host
        self.op_timeout_s = op_timeout_s  # a group call (build, recv) taking longer breaks the pair
        self._store: Any = None  # the TCPStore every pair meets in (under its own key prefix)
        self._server: asyncio.Server | None = None
        self._serving: set[asyncio.Task[Any]] = set()
        self._pairs: set[_Pair] = set()
        self._workers: set[PairWorker] = set()  # every pair's thread not joined yet
        self._writing: Counter[str] = Counter()  # request_id -> accepted layers not landed yet
        self._changed = asyncio.Event()  # set (and replaced) whenever a layer lands or fails

    async def start(self) -> str:
        timeout = datetime.timedelta(seconds=self.op_timeout_s)
        # The store listens on every interface (a TCPStore cannot bind one); senders reach it at the
        # control endpoint's host.
        self._store = dist.TCPStore(self._addr[0], 0, None, True, timeout=timeout, wait_for_workers=False)
        self._server = await asyncio.start_server(self._serve, *self._addr)
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(Endpoint("torch_dist", self._advertise or host, port, self.incarnation))

    async def wait_idle(self, request_id: str) -> None:
        """Return once no accepted layer of `request_id` is still to be received or scattered. Layers
        whose header arrives after the fence went stale are received and dropped, never written."""
        while self._writing[request_id]:
            await self._changed.wait()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Connections end by closing their sockets (their readers then see EOF), not by cancelling the
        # handler tasks: asyncio.start_server logs a cancelled handler as an error.
        for pair in list(self._pairs):
            pair.writer.close()
        await asyncio.gather(*self._serving, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        await join_all(self._workers, JOIN_S)
        self._store = None

    # --- the control connection ---------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if peername else "?"
        task = asyncio.current_task()
        if task is not None:
            self._serving.add(task)
        pair: _Pair | None = None
        send, recv = stream_io(reader, writer)
        try:
            if not await self._authenticate(send, recv, peer):
                return  # before the store, the group or anything else about this side is said
            pair = await self._preflight(reader, writer, peer)
            if pair is None:
                return
            self._pairs.add(pair)
            while (msg := await read_msg(reader, KVLayerHeader | KVDone)) is not None:
                if isinstance(msg, KVLayerHeader):
                    self._on_layer(pair, msg)
                else:
                    self.stats.dones_received += 1
                    # Layers land in order on the pair's thread: once these are in, all of the request's are.
                    await asyncio.gather(*pair.pending, return_exceptions=True)
                    if pair.broken:
                        raise TransferError(f"kv_done for {msg.request_id!r} after a failed layer")
                    self._notify_done(msg)
        except ValueError as e:  # ProtocolError: garbage on the control connection
            self.stats.bad_messages += 1
            log.error("kv torch_dist: closing the connection from %s: %s", peer, e)
        except TransferError as e:  # the pair's group failed (peer gone, timeout): its stream is lost
            log.warning("kv torch_dist: pair with %s broke: %s", peer, e)
        except OSError as e:
            log.warning("kv torch_dist: connection from %s lost: %s", peer, e or type(e).__name__)
        finally:
            if task is not None:
                self._serving.discard(task)
            writer.close()
            if pair is not None:
                self._pairs.discard(pair)
                pair.worker.stop()  # queued layers fail (and stop counting as writing); the group closes

    async def _preflight(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> _Pair | None:
        try:
            async with asyncio.timeout(self.handshake_timeout_s):
                msg = await read_msg(reader, KVTorchDistHello)
            if msg is None:
                return None
            problems, sender, offered = self._compat_problems(msg.compat), msg.sender_id, msg.backends
        except ProtocolError as e:  # another protocol version, or not a hello: say so before closing
            problems, sender, offered = [str(e)], "?", []
        backend = next((b for b in group_backends(self.kv) if b in offered), None)
        if not problems and backend is None:
            problems = [f"no common process-group backend (sender {offered!r}, receiver 'gloo')"]
        if problems or backend is None:
            error = self._refusal(peer, sender, problems)
            write_msg(writer, KVTorchDistHelloReply(ok=False, error=error))
            await writer.drain()
            return None
        prefix = f"kv-{uuid.uuid4().hex}/"
        host = writer.get_extra_info("sockname")[0]  # the address this sender reached us at
        pair = _Pair(writer, peer, PairWorker(f"kv-torch-dist-rx-{peer}"), staging_device(self.kv, backend))
        self._workers.add(pair.worker)
        store = dist.PrefixStore(prefix, self._store)

        def build() -> None:
            pair.worker.group = make_group(backend, store, RECEIVER_RANK, host, self.op_timeout_s)

        built = pair.worker.submit(build)  # blocks that thread until the sender builds its side
        built.add_done_callback(functools.partial(self._built, pair))
        port = self._store.port
        reply = KVTorchDistHelloReply(
            store_port=port,
            group=prefix,
            backend=backend,
            num_blocks=self.kv.spec.num_blocks,
            incarnation=self.incarnation,
        )
        write_msg(writer, reply)
        await writer.drain()
        return pair

    def _built(self, pair: _Pair, fut: asyncio.Future[Any]) -> None:
        if fut.exception() is not None:
            self._fail(pair, f"building the process group failed: {fut.exception()}")

    # --- layers ---------------------------------------------------------------------------------------
    def _on_layer(self, pair: _Pair, h: KVLayerHeader) -> None:
        why = check_layer_header(h, self.kv)
        if why is not None:  # nothing was queued for it: the stream cannot continue, the connection closes
            raise ProtocolError(f"bad kv_layer header (request {h.request_id!r}): {why}")
        write = self._accepts(h.request_id, h.fence)
        if write:
            self._writing[h.request_id] += 1
        else:  # the blocks may have been freed and reused: receive the bytes (the stream must stay in step)
            self.stats.stale_drops += 1
        fut = pair.worker.submit(functools.partial(self._land, pair, h, write))
        pair.pending.add(fut)
        fut.add_done_callback(functools.partial(self._landed, pair, h, write))

    def _land(self, pair: _Pair, h: KVLayerHeader, write: bool) -> None:
        """On the pair's thread: receive one layer, and scatter it into the cache when `write`."""
        if pair.staging is None or pair.staging.numel() < h.nbytes:
            pair.staging = torch.empty(h.nbytes, dtype=torch.uint8, device=pair.device)
        buf = pair.staging[: h.nbytes]
        p2p(pair.worker.group, "recv", buf, SENDER_RANK)
        if not write:
            return
        k, v = self.kv.k, self.kv.v
        bs, n_kv, hd = k.shape[2:]
        if h.head_count and h.head_count < n_kv:  # some of our heads: scatter into them
            staged = buf.view(k.dtype).view(2, len(h.block_ids), bs, h.head_count, hd)
            unpack_heads(self.kv, h.layer, h.block_ids, h.head_start, staged)
        else:  # every head of our shard: the plain block layout
            staged = buf.view(k.dtype).view(2, len(h.block_ids), *k.shape[2:])  # (2, n, bs, n_kv, hd)
            idx = torch.tensor(h.block_ids, dtype=torch.long, device=k.device)
            self.kv.layer_k(h.layer).index_copy_(0, idx, staged[0].to(k.device))
            self.kv.layer_v(h.layer).index_copy_(0, idx, staged[1].to(v.device))
        sync(k.device)

    def _landed(self, pair: _Pair, h: KVLayerHeader, write: bool, fut: asyncio.Future[Any]) -> None:
        pair.pending.discard(fut)
        error = fut.exception()  # a failed group call: the rest of the stream is lost too
        if error is not None:
            self._fail(pair, f"layer {h.layer} of {h.request_id!r}: {error}")
        elif write:
            self._arrived(h.request_id, h.fence, h.layer, h.nbytes)
        if write:
            self._writing[h.request_id] -= 1
            if not self._writing[h.request_id]:
                del self._writing[h.request_id]
        self._changed.set()
        self._changed = asyncio.Event()

    def _fail(self, pair: _Pair, why: str) -> None:
        if not pair.broken:
            pair.broken = why
            log.warning("kv torch_dist: pair with %s broke: %s", pair.peer, why)
            pair.writer.close()  # the reader sees EOF; the sender drops the pair and reconnects later
