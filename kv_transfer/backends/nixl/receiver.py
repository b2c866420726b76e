"""The decode side of the nixl backend: registers the KV tensors, answers the control connection, polls
notifications. The protocol and its guarantees are described in kv_transfer/backends/nixl/__init__.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Coroutine
from typing import Any

from common.kv.kv_cache import PagedKVCache
from common.protocol import KVCompat, KVDone, ProtocolError, decode
from common.runtime.tasks import cancel_and_wait
from common.security.secret import InternalSecret
from kv_transfer.backends.nixl.agent import make_agent, mem_type, regions
from kv_transfer.backends.nixl.messages import (
    KVNixlBegin,
    KVNixlBeginReply,
    KVNixlEnd,
    KVNixlHelloReply,
    KVNixlLayer,
    KVNixlRevoke,
)
from kv_transfer.base import ReceiverOwner
from kv_transfer.control.endpoint import Endpoint
from kv_transfer.control.framing import read_msg, stream_io, write_msg
from kv_transfer.control.messages import KVHello
from kv_transfer.control.preflight import HANDSHAKE_TIMEOUT_S, PreflightReceiver
from kv_transfer.layout import block_bytes, slice_bytes

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Conn:
    """One sender's control connection."""

    writer: asyncio.StreamWriter
    peer: str
    lost: bool = False
    agent: str = ""  # the sender's NIXL agent, named in its first KVNixlBegin: whose notifications are its


# An open write: (request_id, fence, the sender's agent). Several senders may write one request (tensor-
# parallel prefill ranks, each its heads): each counts its own layers and says its own KVNixlEnd.
_Key = tuple[str, int, str]


@dataclasses.dataclass
class _Open:
    """A (request, fence) the receiver allowed one sender to write: open until settled."""

    conn: _Conn
    landed: int = 0  # layer notifications received: those writes' bytes are in place
    expected: int | None = None  # writes the sender completed, from its KVNixlEnd
    done: KVDone | None = None  # parked until landed == expected
    revoking: bool = False
    lost: bool = False  # the control connection broke before the sender said how many writes it made

    @property
    def settled(self) -> bool:
        return self.lost or (self.expected is not None and self.landed >= self.expected)


class NixlReceiver(PreflightReceiver):
    _name = "nixl"
    _on_accept_error = "refusing"  # a failing owner callback must not open blocks it could not vouch for

    def __init__(
        self,
        kv: PagedKVCache,
        compat: KVCompat,
        owner: ReceiverOwner,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        poll_active_s: float = 0.001,
        poll_idle_s: float = 0.05,
        lost_peer_grace_s: float = 2.0,
        secret: InternalSecret | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        super().__init__(kv, compat, owner, secret, handshake_timeout_s)
        self._addr = (host, port)
        self._advertise = advertise_host
        self.poll_active_s = poll_active_s
        self.poll_idle_s = poll_idle_s
        self.lost_peer_grace_s = lost_peer_grace_s
        self._agent = make_agent("decode")
        self._reg = self._agent.register_memory([kv.k, kv.v])
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # the poller and grace timers
        self._serving: set[asyncio.Task[Any]] = set()  # control connection handlers
        self._conns: set[_Conn] = set()
        self._open: dict[_Key, _Open] = {}
        self._settled = asyncio.Event()  # set (and replaced) whenever an _Open settles and goes away
        self._wake = asyncio.Event()  # a request opened, a sender ended one, or we revoked one: poll now
        self._block_bytes = block_bytes(kv)
        self._closing = False

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, *self._addr)
        self._spawn(self._poll_loop())
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(Endpoint("nixl", self._advertise or host, port, self.incarnation))

    async def wait_idle(self, request_id: str) -> None:
        """Revoke every open (request_id, fence) whose fence `may_write` now refuses (at every sender
        writing it), and return once each is settled: no byte of it lands any more. A pair whose fence
        is still current (a retry reusing the id) is left writing: its blocks are still its own."""
        stale = [key for key in self._open if key[0] == request_id and not self._accepts(key[0], key[1])]
        for key in stale:
            op = self._open[key]
            if op.expected is None and not op.revoking and not op.conn.lost:
                op.revoking = True
                write_msg(op.conn.writer, KVNixlRevoke(key[0], key[1]))
                self._wake.set()
        while any(key in self._open for key in stale):
            await self._settled.wait()

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        # Connections end by closing their sockets (their readers then see EOF), not by cancelling the
        # handler tasks: asyncio.start_server logs a cancelled handler as an error.
        for conn in list(self._conns):
            conn.writer.close()
        await asyncio.gather(*self._serving, return_exceptions=True)
        # stopped as every loop task is (common/runtime/tasks.py): neither the poller nor a grace timer has
        # anything to clean up once cancelled
        await asyncio.gather(*(cancel_and_wait(t) for t in list(self._tasks)))
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
        self._open.clear()  # nothing lands any more: the memory is deregistered
        self._settled.set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- the control connection ---------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        conn = _Conn(writer, f"{peername[0]}:{peername[1]}" if peername else "?")
        task = asyncio.current_task()
        if task is not None:
            self._serving.add(task)
        self._conns.add(conn)
        send, recv = stream_io(reader, writer)
        try:
            if not await self._authenticate(send, recv, conn.peer) or not await self._preflight(reader, conn):
                return
            while (msg := await read_msg(reader, KVNixlBegin | KVNixlEnd | KVDone)) is not None:
                self._handle(conn, msg)
                await writer.drain()
        except ValueError as e:  # ProtocolError: garbage on the control connection
            self.stats.bad_messages += 1
            log.error("kv nixl: closing the connection from %s: %s", conn.peer, e)
        except OSError as e:
            log.warning("kv nixl: connection from %s lost: %s", conn.peer, e or type(e).__name__)
        finally:
            if task is not None:
                self._serving.discard(task)
            self._conns.discard(conn)
            writer.close()
            conn.lost = True
            if not self._closing:
                self._spawn(self._lost(conn))

    async def _preflight(self, reader: asyncio.StreamReader, conn: _Conn) -> bool:
        try:
            async with asyncio.timeout(self.handshake_timeout_s):
                msg = await read_msg(reader, KVHello)
            if msg is None:
                return False
            problems, sender = self._compat_problems(msg.compat), msg.sender_id
        except ProtocolError as e:  # another protocol version, or not a hello: say so before closing
            problems, sender = [str(e)], "?"
        if problems:
            error = self._refusal(conn.peer, sender, problems)
            write_msg(conn.writer, KVNixlHelloReply(ok=False, error=error))
        else:
            reply = KVNixlHelloReply(
                agent_metadata=self._agent.get_agent_metadata(),
                regions=[(a, n, d) for a, n, d in regions(self.kv)],
                mem_type=mem_type(self.kv.k),
                num_blocks=self.kv.spec.num_blocks,
                kv_heads=self.kv.spec.num_kv_heads,
                incarnation=self.incarnation,
            )
            write_msg(conn.writer, reply)
        await conn.writer.drain()
        return not problems

    def _handle(self, conn: _Conn, msg: KVNixlBegin | KVNixlEnd | KVDone) -> None:
        if isinstance(msg, KVNixlBegin):
            if not msg.agent or conn.agent not in ("", msg.agent):
                why = f"kv_nixl_begin names agent {msg.agent!r} (the connection's: {conn.agent!r})"
                raise ProtocolError(why)
            conn.agent = msg.agent
            key = (msg.request_id, msg.fence, conn.agent)
            # a second begin of an open request is a no-op
            ok = key in self._open or self._accepts(msg.request_id, msg.fence)
            if ok and key not in self._open:
                self._open[key] = _Open(conn)
                self._wake.set()
            elif not ok:
                self.stats.stale_drops += 1
            write_msg(conn.writer, KVNixlBeginReply(msg.request_id, msg.fence, ok))
        elif isinstance(msg, KVNixlEnd):
            key = (msg.request_id, msg.fence, conn.agent)
            op = self._open.get(key)
            if op is not None and op.expected is None:
                if msg.layers < 0:
                    raise ProtocolError(f"the sender lost track of open request {msg.request_id!r}")
                op.expected = msg.layers
                self._settle(key)
                self._wake.set()  # its last notifications are due: poll fast until they are in
        else:
            self.stats.dones_received += 1
            key = (msg.request_id, msg.fence, conn.agent)
            op = self._open.get(key)
            if op is None:  # nothing was written (no layers, or a stale fence): pass it on at once
                self._notify_done(msg)
            elif op.expected is None:
                raise ProtocolError(f"kv_done for {msg.request_id!r} before its kv_nixl_end")
            else:
                op.done = msg
                self._settle(key)

    async def _lost(self, conn: _Conn) -> None:
        """A sender's control connection is gone. Its open requests get no KVNixlEnd any more, so nothing
        says when their last write has landed: wait out a grace period, then call them settled."""
        mine = [key for key, op in self._open.items() if op.conn is conn and not op.settled]
        if not mine:
            return
        log.warning("kv nixl: %s left with %d open request(s)", conn.peer, len(mine))
        await asyncio.sleep(self.lost_peer_grace_s)
        for key in mine:
            op = self._open.get(key)
            if op is not None and op.conn is conn:
                op.lost = True
                op.done = None  # its layers may be missing: decode must not run it; the lease expires
                self._settle(key)

    # --- notifications ------------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        """Poll notifications every poll_active_s while one is due (a sender said how many writes it made,
        or we revoked one) or one just came; otherwise back off, doubling the wait up to poll_idle_s. A
        begin, an end or a revoke wakes the loop at once. A long prefill posts one layer every few hundred
        ms on a CPU: polling every 1 ms through it cost ~0.4 s of CPU per 9 s prefill, taken from the cores
        the prefill ran on (bench overlap), and in a decode service the GIL from its engine thread. (Each
        poll is ~1 us of NIXL and ~100 us of asyncio.) Transports whose writes need this side's progress
        (UCX's tcp between hosts) keep a fast poll while layers keep arriving."""
        # With the progress thread off, polling is also what progresses this agent's UCX worker.
        delay = self.poll_active_s
        while True:
            self._wake.clear()
            heard = False
            for agent, msgs in self._agent.get_new_notifs().items():
                for raw in msgs:
                    heard = True
                    self._on_notif(agent, raw)
            if heard or any(op.expected is not None or op.revoking for op in self._open.values()):
                delay = timeout = self.poll_active_s
            else:
                timeout = delay
                delay = min(delay * 2, self.poll_idle_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # not wait_for: common/runtime/tasks.py
                    await self._wake.wait()
            if self._wake.is_set():  # something changed: start over from the fast poll
                delay = self.poll_active_s

    def _on_notif(self, agent: str, raw: bytes) -> None:
        try:
            n = decode(raw, KVNixlLayer)
        except ValueError as e:
            self.stats.bad_messages += 1
            log.error("kv nixl: bad notification: %s", e)
            return
        key = (n.request_id, n.fence, agent)
        op = self._open.get(key)
        if op is None:
            # Bytes landed without a begin we allowed: a sender bug. Nothing can be undone here.
            self.stats.bad_messages += 1
            log.error("kv nixl: layer %r of %r (fence %r) was never allowed", n.layer, n.request_id, n.fence)
            return
        op.landed += 1
        per_block = slice_bytes(self.kv, n.head_count) if n.head_count else self._block_bytes
        self._arrived(n.request_id, n.fence, n.layer, n.num_blocks * 2 * per_block)
        self._settle(key)

    def _settle(self, key: _Key) -> None:
        """Close an open write once none of it can land any more; deliver its parked kv_done."""
        op = self._open.get(key)
        if op is None or not op.settled:
            return
        del self._open[key]
        if op.done is not None:
            self._notify_done(op.done)
        self._settled.set()
        self._settled = asyncio.Event()
