"""The prefill side of the nixl backend: one control connection and one prepared descriptor list per
receiver (head slices: descriptors made per write instead), a WRITE + notification per layer. The
protocol and its guarantees are in kv_transfer/backends/nixl/__init__.py."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import numpy as np

from common.kv.kv_cache import PagedKVCache
from common.protocol import KVCompat, KVDone, encode
from common.security.secret import InternalSecret
from kv_transfer.backends.nixl.agent import (
    block_rows,
    local_rows,
    local_slice_rows,
    make_agent,
    mem_type,
    row_indices,
    slice_rows,
)
from kv_transfer.backends.nixl.messages import (
    KVNixlBegin,
    KVNixlBeginReply,
    KVNixlEnd,
    KVNixlHelloReply,
    KVNixlLayer,
    KVNixlRevoke,
)
from kv_transfer.base import HeadSlice, TransferError
from kv_transfer.control.endpoint import Endpoint
from kv_transfer.control.framing import read_msg, write_msg
from kv_transfer.control.messages import KVHello
from kv_transfer.control.preflight import PreflightSender, drain_control
from kv_transfer.layout import block_bytes, slice_bytes

log = logging.getLogger(__name__)

# Poll a posted write with short sleeps, never a bare-yield spin: the prefill service posts writes
# while its forward pass runs, and a spinning event loop takes the GIL and a core from it
# (bench overlap measured the prefill 12-40 % slower with a 2 ms spin on 2 cores).
POLL_S = 2e-4


@dataclasses.dataclass
class _Req:
    """This sender's view of one (request, fence) at one receiver."""

    allowed: asyncio.Future[bool]  # the receiver's answer to our KVNixlBegin
    revoked: bool = False  # the receiver asked us to stop: post nothing more
    inflight: int = 0  # writes posted and not yet DONE/ERR
    completed: int = 0  # writes that reached DONE (each brings one notification over there)
    ended: bool = False  # our KVNixlEnd for it is on the wire
    idle: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


@dataclasses.dataclass
class _Peer:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    agent_name: str
    remote_dlist: Any  # nixl_prepped_dlist_handle over every (K|V, layer, block) of the receiver
    num_blocks: int
    regions: list[list[int]]  # the receiver's K and V tensors: (address, nbytes, device_id)
    mem_type: str
    kv_heads: int  # KV heads per block over there (its shard's)
    reqs: dict[tuple[str, int], _Req] = dataclasses.field(default_factory=dict)
    task: asyncio.Task[None] | None = None  # reads replies and revokes
    broken: str = ""


class NixlSender(PreflightSender[_Peer]):
    def __init__(
        self,
        kv: PagedKVCache,
        compat: KVCompat,
        sender_id: str = "",
        connect_timeout: float = 10.0,
        secret: InternalSecret | None = None,
    ) -> None:
        super().__init__(kv, compat, sender_id, connect_timeout, secret)
        self._agent = make_agent("prefill")
        self._reg = self._agent.register_memory([kv.k, kv.v])
        self._local_dlist: Any = None
        self._tasks: set[asyncio.Task[None]] = set()  # revoke answers and deferred teardowns
        # endpoint (or "local") -> block descriptor lists prepared; head-sliced writes prepare none
        self.dlist_preps: Counter[str] = Counter()
        self.stale_skips = 0  # send_layer calls that wrote nothing: the receiver refused or revoked the fence

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
        s = self.kv.spec
        self._check_source(layer, src_block_ids, dst_block_ids, heads)
        peer = await self._peer(endpoint)
        # The receiver cannot check anything before the bytes land (one-sided WRITE): check for it.
        self._check_destination(peer.num_blocks, dst_block_ids)
        if heads is not None and heads.count == s.num_kv_heads == peer.kv_heads:
            heads = None  # both shards whole: the plain block layout
        self._check_heads(peer, heads)
        sliced = None if heads is None else self._slice_rows(peer, layer, src_block_ids, dst_block_ids, heads)
        req = await self._begin(endpoint, peer, request_id, fence)
        if not dst_block_ids:
            return
        if req is None or req.revoked:
            self.stale_skips += 1
            return
        # From the revoked check to inflight += 1 nothing awaits: a revoke sees every posted write.
        count = 0 if heads is None else heads.count
        notif = encode(KVNixlLayer(request_id, fence, layer, len(dst_block_ids), traceparent, count))
        if sliced is None:
            handle = self._agent.make_prepped_xfer(
                "WRITE",
                self._local(),
                row_indices(s.shape[0], s.num_blocks, self.kv.slot_of[layer], src_block_ids),
                peer.remote_dlist,
                row_indices(s.shape[0], peer.num_blocks, self.kv.slot_of[layer], dst_block_ids),
                notif_msg=notif,
            )
        else:  # every slot of every block: one descriptor each side, made for this WRITE only
            handle = self._slice_xfer(endpoint, peer, *sliced, notif)
        req.inflight += 1
        req.idle.clear()
        state = "ERR"
        try:
            state = self._agent.transfer(handle)
            while state == "PROC":
                await asyncio.sleep(POLL_S)
                state = self._agent.check_xfer_state(handle)
        finally:
            req.inflight -= 1
            if state == "DONE":
                req.completed += 1
            if not req.inflight:
                req.idle.set()
            self._release(endpoint, peer, handle, state)
        if state != "DONE":
            raise TransferError(f"NIXL WRITE of layer {layer} of {request_id!r} to {endpoint} failed")
        self.stats.layers_sent += 1
        per_block = block_bytes(self.kv) if heads is None else slice_bytes(self.kv, heads.count)
        self.stats.bytes_sent += len(dst_block_ids) * 2 * per_block

    async def send_done(self, endpoint: str, msg: KVDone) -> None:
        peer = await self._peer(endpoint)
        key = (msg.request_id, msg.fence)
        req = peer.reqs.get(key)
        if req is not None:
            await req.idle.wait()  # a concurrent send_layer of this request may still be polling
            allowed = req.allowed.done() and not req.allowed.exception() and req.allowed.result()
            if allowed and not req.ended:  # the receiver parks kv_done until `completed` layers landed
                req.ended = True
                write_msg(peer.writer, KVNixlEnd(msg.request_id, msg.fence, req.completed, req.revoked))
            if peer.reqs.get(key) is req:
                del peer.reqs[key]
        write_msg(peer.writer, msg)
        await self._drain(endpoint, peer)
        self.stats.dones_sent += 1

    async def close(self) -> None:
        for endpoint, peer in list(self._peers.items()):
            self._drop(endpoint, peer, "sender closed")
        if self._local_dlist is not None:
            self._local_dlist.release()
            self._local_dlist = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    # --- per request ----------------------------------------------------------------------------------
    async def _begin(self, endpoint: str, peer: _Peer, request_id: str, fence: int) -> _Req | None:
        """Ask once per (request, fence) whether its blocks may be written; None when the fence is stale."""
        key = (request_id, fence)
        req = peer.reqs.get(key)
        if req is None:
            req = peer.reqs[key] = _Req(asyncio.get_running_loop().create_future())
            req.idle.set()
            write_msg(peer.writer, KVNixlBegin(request_id, fence, self._agent.name))
            await self._drain(endpoint, peer)
        ok = await asyncio.shield(req.allowed)  # TransferError when the connection broke meanwhile
        return req if ok else None

    async def _revoke(self, peer: _Peer, msg: KVNixlRevoke) -> None:
        """The receiver wants (request, fence) closed: post no more, let posted writes end, say how many."""
        req = peer.reqs.get((msg.request_id, msg.fence))
        if req is None:  # we already sent its KVNixlEnd (before kv_done), which the receiver will read first
            write_msg(peer.writer, KVNixlEnd(msg.request_id, msg.fence, -1, revoked=True))
            return
        req.revoked = True
        await req.idle.wait()
        if not req.ended:  # send_done may have answered for us meanwhile
            req.ended = True
            write_msg(peer.writer, KVNixlEnd(msg.request_id, msg.fence, req.completed, revoked=True))

    # --- per peer -------------------------------------------------------------------------------------
    def _local(self) -> Any:
        if self._local_dlist is None:
            rows = local_rows(self.kv)
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem_type(self.kv.k))
            self.dlist_preps["local"] += 1
        return self._local_dlist

    def _check_heads(self, peer: _Peer, heads: HeadSlice | None) -> None:
        """The heads against the receiver's blocks (from its hello reply): nothing over there stops a
        WRITE that does not fit them."""
        ours = self.kv.spec.num_kv_heads
        if heads is None and peer.kv_heads != ours:
            raise ValueError(
                f"the receiver's blocks hold {peer.kv_heads} KV heads and ours {ours}: "
                "only head slices can be written"
            )
        if heads is not None and heads.dst_start + heads.count > peer.kv_heads:
            raise ValueError(f"{heads} does not fit the receiver's {peer.kv_heads} KV heads")

    def _slice_rows(
        self, peer: _Peer, layer: int, src_block_ids: list[int], dst_block_ids: list[int], heads: HeadSlice
    ) -> tuple[np.ndarray, np.ndarray]:
        """The slot descriptors of one head-sliced layer write, ours and the receiver's: 2 * n * block_size
        rows each (n blocks), row i of both the same heads of the same token. Only what this write moves:
        a list over every slot of the cache would be millions of rows."""
        s = self.kv.spec
        mine = local_slice_rows(self.kv, layer, src_block_ids, heads.src_start, heads.count)
        # (the KV preflight checked the receiver lays its layers out in pages as we do: s.shape[0] a page)
        shape = (s.shape[0], peer.num_blocks, s.block_size, peer.kv_heads)
        head_bytes = s.head_dim * self.kv.k.element_size()
        slot = self.kv.slot_of[layer]
        theirs = slice_rows(
            peer.regions, shape, head_bytes, slot, dst_block_ids, heads.dst_start, heads.count
        )
        return mine, theirs

    def _slice_xfer(
        self, endpoint: str, peer: _Peer, mine: np.ndarray, theirs: np.ndarray, notif: bytes
    ) -> Any:
        """A WRITE over unprepared descriptors (NIXL checks them against the registrations here)."""
        try:
            local = self._agent.get_xfer_descs(mine, mem_type(self.kv.k))
            remote = self._agent.get_xfer_descs(theirs, peer.mem_type)
            return self._agent.initialize_xfer("WRITE", local, remote, peer.agent_name, notif)
        except Exception as e:  # NIXL raises its own exception types
            raise TransferError(f"cannot make a NIXL WRITE of head slices to {endpoint}: {e}") from e

    async def _connect(self, endpoint: str) -> _Peer:
        ep = Endpoint.parse(endpoint, "nixl")
        hello = KVHello(compat=self.compat, sender_id=self.sender_id)
        reader, writer, reply = await self._open_control(endpoint, ep.host, ep.port, hello, KVNixlHelloReply)
        try:
            peer = self._add_remote(reader, writer, reply)
        except Exception as e:  # NIXL raises its own exception types
            writer.close()
            raise TransferError(f"cannot set up NIXL transfers to {endpoint}: {e}") from e
        self.dlist_preps[endpoint] += 1
        peer.task = asyncio.get_running_loop().create_task(self._read_loop(endpoint, peer))
        return peer

    def _add_remote(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: KVNixlHelloReply
    ) -> _Peer:
        s = self.kv.spec
        if reply.mem_type not in ("DRAM", "VRAM"):
            raise TransferError(f"unknown remote memory type {reply.mem_type!r}")
        if reply.kv_heads < 1:
            raise TransferError(f"the receiver says {reply.kv_heads} KV heads per block")
        regions = [list(r) for r in reply.regions]
        rows = block_rows(regions, s.shape[0], reply.num_blocks, slice_bytes(self.kv, reply.kv_heads))
        name = self._agent.add_remote_agent(reply.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            dlist = self._agent.prep_xfer_dlist(name, rows, reply.mem_type)
        except Exception:
            self._agent.remove_remote_agent(name)
            raise
        return _Peer(reader, writer, name, dlist, reply.num_blocks, regions, reply.mem_type, reply.kv_heads)

    async def _read_loop(self, endpoint: str, peer: _Peer) -> None:
        why = "connection closed by the receiver"
        try:
            while (msg := await read_msg(peer.reader, KVNixlBeginReply | KVNixlRevoke)) is not None:
                if isinstance(msg, KVNixlBeginReply):
                    req = peer.reqs.get((msg.request_id, msg.fence))
                    if req is not None and not req.allowed.done():
                        req.allowed.set_result(bool(msg.ok))
                else:
                    self._spawn(self._revoke(peer, msg))
        except (OSError, ValueError) as e:
            why = str(e)
        self._drop(endpoint, peer, why)

    def _retire(self, endpoint: str, peer: _Peer) -> None:
        self._drop(endpoint, peer, "the receiver restarted (a new incarnation at its address)")

    async def _drain(self, endpoint: str, peer: _Peer) -> None:
        await drain_control(endpoint, peer, self._drop)

    def _release(self, endpoint: str, peer: _Peer, handle: Any, state: str) -> None:
        try:
            handle.release()  # a write still in flight (we were cancelled) is aborted, or this raises
        except Exception as e:
            log.error("kv nixl: cannot release a write to %s (%s): dropping the peer", endpoint, e)
            state = "ERR"
        if state != "DONE":  # a failed or abandoned write: the receiver cannot trust this connection
            self._drop(endpoint, peer, f"a WRITE ended in state {state}")

    def _drop(self, endpoint: str, peer: _Peer, why: str) -> None:
        """Forget a peer; the receiver sees its control connection close and waits out its writes."""
        if peer.broken:
            return
        peer.broken = why
        err = TransferError(f"KV control connection to {endpoint} is gone: {why}")
        for req in peer.reqs.values():
            if not req.allowed.done():
                req.allowed.set_exception(err)
                req.allowed.exception()  # retrieved here: nobody else may be waiting for it
        peer.writer.close()
        if peer.task is not None and peer.task is not asyncio.current_task():
            peer.task.cancel()
        if self._peers.get(endpoint) is peer:
            del self._peers[endpoint]
        busy = [req for req in peer.reqs.values() if req.inflight]
        if busy:  # writes still polling use the remote descriptors: tear down after them
            self._spawn(self._teardown(endpoint, peer, busy))
        else:
            self._teardown_now(endpoint, peer)

    async def _teardown(self, endpoint: str, peer: _Peer, busy: list[_Req]) -> None:
        for req in busy:
            await req.idle.wait()
        self._teardown_now(endpoint, peer)

    def _teardown_now(self, endpoint: str, peer: _Peer) -> None:
        try:
            peer.remote_dlist.release()
            self._agent.remove_remote_agent(peer.agent_name)
        except Exception as e:  # NIXL's own exception types; a half-torn-down peer is still dropped
            log.warning("kv nixl: tearing down %s: %s", endpoint, e)
