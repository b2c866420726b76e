"""The decode service's KV connector: its reservations, and what its KV receiver asks and tells.

Scheduler side (event loop, driven by the engine's admissions): `reserve` turns an admitted remote
request into an IncomingKV with a new fence and a lease; `end` makes the fence stale, waits until no
write lands any more and drops the lease, before the engine frees the blocks.
Worker side (the receiver's callbacks, event loop): `may_write` checks the fence before any byte
lands, `layer_arrived` counts the writes in place, `kv_done` lets the request decode only when every
layer write the sender made has landed; otherwise the request ends with the reason.
Engine thread: `holds_blocks` keeps a finished request's blocks while a transfer may still write them.

With tensor parallelism each rank receives its own KV heads: the worker ranks' agents
(kv_transfer/ranks.py) open and close each reservation with rank 0's, count their own writes and
kv_dones, and report; the request decodes once every rank's KV is complete. Several prefill ranks may
write into one rank (heterogeneous TP): each rank waits for all of their kv_dones (`Tally`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable

from common.connector.base import RemoteKVConnector
from common.connector.remote_kv import IncomingKV, TransferState
from common.engine.api import Admission
from common.engine.sequence import Sequence
from common.parallel.messages import Close, Open, RankArrived, RankReport
from common.protocol import KVDone

log = logging.getLogger(__name__)
S = TransferState


class DecodeConnector(RemoteKVConnector[IncomingKV]):
    peer_gone = "prefill service lease expired before the KV arrived"

    def __init__(
        self,
        on_arrived: Callable[[IncomingKV, KVDone], None],
        on_failed: Callable[[IncomingKV, str], None],
    ) -> None:
        super().__init__(on_failed)  # incomplete KV, a lost peer: the service ends the request
        self.on_arrived = on_arrived  # every layer and kv_done are in: resume the request
        self._fences = itertools.count(1)

    # --- scheduler side -------------------------------------------------------------------------------
    async def reserve(self, a: Admission) -> IncomingKV:
        """The engine reserved blocks for a remote request: a new fence, a lease, and the request is
        open for writes under that fence."""
        rkv = IncomingKV(
            a.request_id, next(self._fences), a.block_ids, S.RESERVED, group_block_ids=a.group_block_ids
        )
        rkv.num_cached_tokens = a.num_cached_tokens
        self.requests[a.request_id] = rkv
        if self.ranks is not None:  # every rank accepts the writes before the prefill can know where
            self.ranks.attach(self._on_report)
            errors = [e for e in await self.ranks.call(Open(rkv.request_id, rkv.fence)) if e]
            if errors and rkv.open:
                rkv.state = S.ENDED
                self.on_failed(rkv, "; ".join(errors))
        if self.leases is not None:
            await self.leases.acquire(rkv)
        return rkv

    async def release_lease(self, rkv: IncomingKV) -> None:
        """The KV arrived: the transfer is over and the blocks are the request's own."""
        if self.leases is not None:
            await self.leases.release(rkv)

    async def end(self, rkv: IncomingKV, wait_idle: Callable[[str], Awaitable[None]]) -> None:
        """The request is over here (finished, failed or abandoned): refuse its writes from now on, wait
        until none is landing (`wait_idle`, the receiver's), drop the lease. Only then may the engine
        free its blocks."""
        if rkv.open:
            rkv.state = S.ENDED
            with contextlib.suppress(Exception):  # a broken transport has nothing left landing
                await wait_idle(rkv.request_id)
        if self.ranks is not None:  # the same on every rank (a rank that is gone writes nothing)
            await self.ranks.call(Close(rkv.request_id, rkv.fence))
        await self._forget(rkv)

    # --- engine thread --------------------------------------------------------------------------------
    def holds_blocks(self, seq: Sequence) -> bool:
        rkv = self.requests.get(seq.seq_id)
        return rkv is not None and rkv.open

    # --- worker side: the receiver ------------------------------------------------------------------
    def _current(self, request_id: str, fence: int) -> IncomingKV | None:
        rkv = self.requests.get(request_id)
        if rkv is None or rkv.fence != fence or rkv.state not in (S.RESERVED, S.RECEIVING):
            return None
        return rkv

    def may_write(self, request_id: str, fence: int) -> bool:
        rkv = self._current(request_id, fence)
        if rkv is None:
            return False
        rkv.state = S.RECEIVING
        return True

    def layer_arrived(self, request_id: str, fence: int, layer: int) -> None:
        rkv = self._current(request_id, fence)
        if rkv is not None:
            rkv.tally.layers += 1

    def kv_done(self, msg: KVDone) -> None:
        rkv = self._current(msg.request_id, msg.fence)
        if rkv is None:
            log.warning("dropping kv_done for %s with stale fence %d", msg.request_id, msg.fence)
            return
        why = rkv.tally.hear_done(msg.layer_writes, msg.senders)
        if why is None:
            return  # another prefill rank's kv_done is due
        rkv.done = msg
        self._rank_verdict(rkv, 0, why)

    def _on_report(self, rank: int, msg: RankReport) -> None:
        """A worker rank's agent: RankArrived, or RankGone when it exited."""
        if isinstance(msg, RankArrived):
            rkv = self._current(msg.request_id, msg.fence)
            if rkv is not None:
                self._rank_verdict(rkv, rank, msg.why)
            return
        for rkv in [r for r in self.requests.values() if r.open]:
            rkv.state = S.ENDED
            self.on_failed(rkv, f"tensor-parallel rank {rank} is gone")

    def _rank_verdict(self, rkv: IncomingKV, rank: int, why: str) -> None:
        """Rank `rank` heard every kv_done due to it: why ("") its KV is (not) complete."""
        if why:
            # Decoding now would read blocks some layer never reached: end it, never serve it.
            rkv.state = S.ENDED
            self.on_failed(rkv, why if rank == 0 else f"rank {rank}: {why}")
            return
        rkv.ranks_done.add(rank)
        world = self.ranks.world_size if self.ranks is not None else 1
        if len(rkv.ranks_done) == world and rkv.done is not None:
            rkv.state = S.ARRIVED  # any later write under this fence is stale
            self.on_arrived(rkv, rkv.done)
