"""The transfer ledger as a service sees it: its own leases, renewed while it lives, and a watch on
the peer's lease for every transfer it takes part in.

A decode service leases each reservation (side "decode"), a prefill service each request whose
blocks it holds until the KV is written (side "prefill"). Leases live in Redis with a TTL; a process
that dies or hangs stops renewing, its leases expire, and the peer's watch notices: it frees its
own blocks and ends the request with the reason. Blocks are never held forever for a dead peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from common.state import StateStore

log = logging.getLogger(__name__)
PEER = {"decode": "prefill", "prefill": "decode"}


class LeaseKeeper:
    def __init__(
        self, state: StateStore, side: str, owner: str, ttl_s: float, on_peer_lost: Callable[[str], None]
    ) -> None:
        self.state, self.side, self.owner, self.ttl_s = state, side, owner, ttl_s
        self.on_peer_lost = on_peer_lost  # called with the request id (event-loop thread)
        self.held: dict[str, list[int]] = {}
        self._token: dict[str, int] = {}  # request id -> which holder (e.g. fence) took the lease
        self._watch_since: dict[str, float] = {}  # request id -> when the peer was last seen alive
        self._task: asyncio.Task[None] | None = None
        self.expired = 0  # peer leases found expired (a metric)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"leases-{self.owner}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for rid in list(self.held):
            await self.release(rid)

    async def acquire(self, request_id: str, blocks: list[int], token: int = 0) -> None:
        """Lease our blocks for this request and start watching the peer's side of it. `token` names
        the holder (a reservation's fence): a retry may reuse the request id while the previous
        holder is still being cleaned up, and only the holder's own release may drop the lease."""
        await self.state.acquire_lease(request_id, self.side, self.owner, self.ttl_s, blocks)
        self.held[request_id] = blocks
        self._token[request_id] = token
        self._watch_since[request_id] = time.monotonic()

    async def release(self, request_id: str, token: int | None = None) -> None:
        if token is not None and self._token.get(request_id) != token:
            return  # a newer holder of this request id owns the lease now
        self._watch_since.pop(request_id, None)
        self._token.pop(request_id, None)
        if self.held.pop(request_id, None) is not None:
            with contextlib.suppress(Exception):
                await self.state.release_lease(request_id, self.side, self.owner)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 4)
            try:
                await self._tick()
            except Exception:
                log.exception("lease upkeep failed; retrying")

    async def _tick(self) -> None:
        now = time.monotonic()
        for rid in list(self.held):
            if not await self.state.renew_lease(rid, self.side, self.owner, self.ttl_s):
                log.warning("%s lease of %s was lost; taking it again", self.side, rid)
                await self.state.acquire_lease(rid, self.side, self.owner, self.ttl_s, self.held.get(rid, []))
        for rid, since in list(self._watch_since.items()):
            if await self.state.get_lease(rid, PEER[self.side]) is not None:
                self._watch_since[rid] = now
            elif now - since > self.ttl_s and rid in self._watch_since:
                # The peer never took its lease, or stopped renewing it: it is gone or hung.
                self.expired += 1
                del self._watch_since[rid]
                log.warning("%s lease of %s expired: freeing our side", PEER[self.side], rid)
                self.on_peer_lost(rid)
