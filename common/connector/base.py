"""What both roles' connectors share: their remote-KV requests by id, the lease keeper that renews
their leases, and the end of a request whose peer stopped renewing its own."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Generic, TypeVar

from common.cluster.leases import Leased, LeaseKeeper
from common.connector.remote_kv import RemoteKV, TransferState
from common.engine.kv_connector import KVConnector
from common.protocol import KVCompat

if TYPE_CHECKING:
    from common.engine.tp_workers import TPWorkers

R = TypeVar("R", bound=RemoteKV)


class RemoteKVConnector(KVConnector, Generic[R]):
    peer_gone = ""  # the reason a request fails when the peer's lease expired

    def __init__(self, on_failed: Callable[[R, str], None]) -> None:
        self.on_failed = on_failed  # the transfer cannot complete: the service ends the request
        self.requests: dict[str, R] = {}
        self.leases: LeaseKeeper | None = None  # set by the service once Redis is there
        # tensor parallelism (bind_ranks): the worker ranks' transfer agents, and rank 0's record
        self.ranks: TPWorkers | None = None
        self.compat: KVCompat | None = None

    def bind_ranks(self, ranks: TPWorkers | None, compat: KVCompat) -> None:
        """This engine's preflight record (rank 0's), and its worker ranks when it has several: each
        moves its own KV shard, driven from here."""
        self.ranks, self.compat = ranks, compat

    def holders(self) -> Iterable[Leased]:
        """The requests whose leases the keeper renews and whose peers it watches."""
        return self.requests.values()

    def peer_lost(self, h: Leased) -> None:
        """The other side of an open transfer stopped renewing its lease (died or hung)."""
        rkv = self.requests.get(h.request_id)
        if rkv is h and rkv.open:
            rkv.state = TransferState.ENDED
            self.on_failed(rkv, self.peer_gone)

    async def _forget(self, rkv: R) -> None:
        """Drop rkv's lease, and rkv itself unless the id names a newer request by now."""
        if self.leases is not None:
            await self.leases.release(rkv)
        if self.requests.get(rkv.request_id) is rkv:
            del self.requests[rkv.request_id]
