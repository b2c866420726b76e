"""KV transfer on a tensor-parallel worker rank: each rank sends, or receives, its own KV shard.

A service with `--tensor-parallel-size N` runs ranks 1..N-1 as worker processes
(common/engine/tp_workers.py); each holds only its KV heads of every block. Rank 0 (the service
process) keeps the requests, fences and leases; a worker rank runs a `RankAgent`: an event loop on a
thread of its own with this backend's sender (prefill) or receiver (decode) over the rank's shard, so
its bytes go straight between the ranks that hold them, never through rank 0.

Rank 0 drives it over a control pipe with calls (common/parallel/messages.py: Open and Close on a
decode rank, Finish and Settle on a prefill rank), each answered once; the agent reports its counters
(RankStats) and, on a decode rank, each request whose kv_dones it heard (RankArrived) — rank 0 lets
the request decode once every rank said its KV is complete. A prefill agent's writes are posted by
the worker's engine thread in the forward pass (`save_layer`), exactly as rank 0's connector posts
its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import multiprocessing.connection
import threading
from typing import Any, assert_never

from common.kv.kv_cache import PagedKVCache
from common.parallel.messages import (
    AgentMessage,
    Close,
    Finish,
    Open,
    RankArrived,
    RankCall,
    RankReply,
    RankStats,
    Settle,
    call_id_of,
)
from common.parallel.plan import SaveItem, Tally, layer_pairs, shard_dones, shard_writes, split_endpoints
from common.protocol import KVCompat, KVDone, ProtocolError, decode, encode
from kv_transfer import KVReceiver, KVSender, make_receiver, make_sender

log = logging.getLogger("splitserve.tp.transfer")

START_TIMEOUT_S = 60.0
STATS_EVERY_S = 1.0  # how often an agent's changed counters go to rank 0


@dataclasses.dataclass(frozen=True)
class RankTransfer:
    """What a worker rank's agent is (picklable: it goes to the worker at spawn). role "prefill" or
    "decode"; `options` go to make_sender / make_receiver (a receiver's `port` is rank 0's: rank r
    listens on port + r, or any free port when it is 0)."""

    role: str
    backend: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def start(
        self, kv: PagedKVCache, compat: KVCompat, conn: multiprocessing.connection.Connection
    ) -> RankAgent:
        return RankAgent(self, kv, compat, conn)


class RankAgent:
    """A worker rank's transfer side (see the module docstring)."""

    def __init__(
        self,
        spec: RankTransfer,
        kv: PagedKVCache,
        compat: KVCompat,
        conn: multiprocessing.connection.Connection,
    ) -> None:
        self.spec, self.kv, self.compat, self.conn = spec, kv, compat, conn
        self.rank = compat.tp_rank
        self.loop = asyncio.new_event_loop()
        self._send_lock = threading.Lock()
        self._thread = threading.Thread(target=self.loop.run_forever, name="splitserve-tp-kv", daemon=True)
        self._thread.start()
        self.senders: dict[str, KVSender] = {}  # by backend: a decode service's endpoint names its own
        self.receiver: KVReceiver | None = None
        self.endpoint = ""
        # prefill: every posted write of a request (with the endpoint it went to), until it is settled
        self._writes: dict[str, list[tuple[str, concurrent.futures.Future[None]]]] = {}
        self._stopped: set[str] = set()
        # decode: the open (request -> fence) and their tallies
        self._open: dict[str, int] = {}
        self._tally: dict[tuple[str, int], Tally] = {}
        fut = asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        fut.result(START_TIMEOUT_S)
        self._reported: RankStats | None = None
        self._stats_task = asyncio.run_coroutine_threadsafe(self._report_stats(), self.loop)
        threading.Thread(target=self._read_control, name="splitserve-tp-ctl", daemon=True).start()

    async def _start(self) -> None:
        opts = dict(self.spec.options)
        if self.spec.role == "prefill":
            return  # senders are made per backend, as decode services name them
        if opts.get("port"):
            opts["port"] = int(opts["port"]) + self.rank
        self.receiver = make_receiver(self.spec.backend, self.kv, self.compat, self, rank=self.rank, **opts)
        self.endpoint = await self.receiver.start()

    async def _report_stats(self) -> None:
        while True:
            stats = RankStats(
                sent={b: dataclasses.asdict(x.stats) for b, x in self.senders.items()},
                received=dataclasses.asdict(self.receiver.stats) if self.receiver is not None else None,
            )
            if stats != self._reported:
                self._reported = stats
                self._tell(stats)
            await asyncio.sleep(STATS_EVERY_S)

    # --- the control pipe ---------------------------------------------------------------------------
    def _read_control(self) -> None:
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                return  # rank 0 is gone: the worker's step loop ends the process
            try:
                call = decode(data, RankCall)
            except ProtocolError as e:  # refused here, and the caller hears why
                log.error("rank %d: refusing a control message: %s", self.rank, e)
                call_id = call_id_of(data)
                if call_id is not None:
                    self._tell(RankReply(call_id=call_id, error=f"rank {self.rank}: {e}"))
                continue
            self.loop.call_soon_threadsafe(self._dispatch, call)

    def _dispatch(self, call: RankCall) -> None:
        self.loop.create_task(self._answer(call))

    async def _answer(self, call: RankCall) -> None:
        op = call.op
        try:
            match op:
                case Open():
                    await self._op_open(op)
                case Close():
                    await self._op_close(op)
                case Finish():
                    await self._op_finish(op)
                case Settle():
                    await self._op_settle(op)
                case _:
                    assert_never(op)
            error = ""
        except Exception as e:  # the answer carries it to rank 0
            error = f"rank {self.rank}: {e or type(e).__name__}"
        self._tell(RankReply(call_id=call.call_id, error=error))

    def _tell(self, msg: AgentMessage) -> None:
        data = encode(msg)
        with self._send_lock, contextlib.suppress(OSError):  # rank 0 gone: nobody to tell
            self.conn.send_bytes(data)

    # --- prefill ------------------------------------------------------------------------------------
    def save_layer(self, layer: int, items: list[SaveItem]) -> None:
        """Engine thread, inside the forward pass: layer `layer` of this step is in the shard; post
        its writes to every decode rank this rank feeds."""
        for it in items:
            if it.request_id in self._stopped:
                continue
            src, dst = layer_pairs(
                it.src, it.dst, it.skip, layer, self.kv.group_of[layer], it.group_src, it.group_dst
            )
            if not dst:
                continue  # out of this layer's sliding window: rank 0 skips it alike
            writes = self._writes.setdefault(it.request_id, [])
            sender = self._sender_for(it.endpoint)
            c = self.compat
            for endpoint, heads in _routes(c.num_kv_heads, c.tp_size, self.rank, it.endpoint):
                coro = sender.send_layer(
                    endpoint, it.request_id, it.fence, layer, src, dst, it.traceparent, heads=heads
                )
                writes.append((endpoint, asyncio.run_coroutine_threadsafe(coro, self.loop)))

    def _sender_for(self, endpoint: str) -> KVSender:
        """The sender for the backend the endpoint names, made on the agent's loop (from the engine
        thread: handed over and waited for; on the loop itself, a finish with no write before it)."""
        backend = endpoint.split("://", 1)[0]
        if backend not in self.senders:
            opts = {
                **self.spec.options,
                "sender_id": f"{self.spec.options.get('sender_id', '')}/tp{self.rank}",
            }

            async def make() -> KVSender:
                return make_sender(backend, self.kv, self.compat, rank=self.rank, **opts)

            if threading.current_thread() is self._thread:
                self.senders[backend] = make_sender(backend, self.kv, self.compat, rank=self.rank, **opts)
            else:
                fut = asyncio.run_coroutine_threadsafe(make(), self.loop)
                self.senders[backend] = fut.result(START_TIMEOUT_S)
        return self.senders[backend]

    async def _op_finish(self, op: Finish) -> None:
        writes = list(self._writes.get(op.request_id, []))
        for _, w in writes:
            await asyncio.wrap_future(w)  # a failed write fails the finish: rank 0 hears why
        c = self.compat
        for msg, ep in shard_dones(
            c.num_kv_heads, c.tp_size, self.rank, op.endpoint, op.done, [e for e, _ in writes]
        ):
            await self._sender_for(op.endpoint).send_done(ep, msg)

    async def _op_settle(self, op: Settle) -> None:
        rid = op.request_id
        self._stopped.add(rid)
        for _, w in self._writes.pop(rid, []):
            with contextlib.suppress(Exception):  # a failed write reads nothing any more
                await asyncio.wrap_future(w)
        self._stopped.discard(rid)

    # --- decode: rank 0's calls, and the receiver's owner ----------------------------------------
    async def _op_open(self, op: Open) -> None:
        self._open[op.request_id] = op.fence
        self._tally[(op.request_id, op.fence)] = Tally()

    async def _op_close(self, op: Close) -> None:
        rid, fence = op.request_id, op.fence
        if self._open.get(rid) == fence:
            del self._open[rid]
        self._tally.pop((rid, fence), None)
        assert self.receiver is not None
        await self.receiver.wait_idle(rid)

    def may_write(self, request_id: str, fence: int) -> bool:
        return self._open.get(request_id) == fence

    def layer_arrived(self, request_id: str, fence: int, layer: int) -> None:
        t = self._tally.get((request_id, fence))
        if t is not None and self.may_write(request_id, fence):
            t.layers += 1

    def kv_done(self, msg: KVDone) -> None:
        key = (msg.request_id, msg.fence)
        t = self._tally.get(key)
        if t is None or not self.may_write(*key):
            log.warning("rank %d: dropping kv_done for %s with stale fence %d", self.rank, *key)
            return
        why = t.hear_done(msg.layer_writes, msg.senders)
        if why is None:
            return
        del self._open[msg.request_id]  # complete or not, nothing more may land under this fence
        self._tell(RankArrived(request_id=msg.request_id, fence=msg.fence, why=why))

    def close(self) -> None:
        async def stop() -> None:
            self._stats_task.cancel()
            for sender in self.senders.values():
                await sender.close()
            if self.receiver is not None:
                await self.receiver.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)


@functools.lru_cache(maxsize=64)
def _routes(num_kv_heads: int, tp_size: int, rank: int, endpoint: str) -> list[tuple[str, Any]]:
    """Where a rank's writes for a decode service's endpoint list go: worked out once per list, not per
    layer write (bounded: a restarted decode service advertises a new list)."""
    return shard_writes(num_kv_heads, tp_size, rank, split_endpoints(endpoint))
