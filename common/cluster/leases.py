"""The transfer ledger: a lease in Redis for every side of every KV transfer, renewed by its owner.

    lease:{id}:{fence}:{side}   hash: owner, blocks (JSON); TTL = the lease

A decode service leases each reservation (side "decode"), a prefill service each request whose blocks
it holds until their KV is written (side "prefill"). Both sides of one transfer name it by the request
id and the reservation's fence, so a retry (a new reservation, a new fence) never shares a lease with
the attempt it replaces. A process that dies or hangs stops renewing, its leases expire, and the
peer's watch notices: it frees its own blocks and ends the request with the reason. Blocks are never
held forever for a dead peer.

`LeaseLedger` is the Redis side; `LeaseKeeper` is a service's loop over the transfers it takes part in.
It keeps no list of its own: the holders (the service's remote-KV requests) carry their lease state,
and the keeper asks for them on every tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from common.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)
SIDES = ("prefill", "decode")
PEER = {"decode": "prefill", "prefill": "decode"}

# KEYS[1] lease. ARGV: op (acquire|renew|release), owner, ttl_ms, blocks JSON. 1 on success; 0 when
# another owner holds the lease, or (renew/release) when nobody does. Re-acquiring by the same owner
# is allowed, so a retried acquire is harmless.
_LEASE_LUA = """
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder and holder ~= ARGV[2] then return 0 end
if ARGV[1] == 'acquire' then
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'blocks', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
if not holder then return 0 end
if ARGV[1] == 'renew' then redis.call('PEXPIRE', KEYS[1], ARGV[3]) else redis.call('DEL', KEYS[1]) end
return 1
"""


@dataclass(frozen=True)
class Lease:
    request_id: str
    fence: int
    side: str  # "prefill" | "decode"
    owner: str
    blocks: list[int]
    ttl_s: float  # time left


class LeaseLedger:
    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.redis, self.prefix = client, prefix
        self._lease = client.register_script(_LEASE_LUA)

    def key(self, request_id: str, fence: int, side: str) -> str:
        if side not in SIDES:
            raise ValueError(f"lease side must be one of {SIDES}, got {side!r}")
        return f"{self.prefix}lease:{request_id}:{fence}:{side}"

    async def _op(
        self, op: str, rid: str, fence: int, side: str, owner: str, ttl_s: float, blocks: str
    ) -> bool:
        key = self.key(rid, fence, side)
        return bool(await self._lease(keys=[key], args=[op, owner, int(ttl_s * 1000), blocks]))

    async def acquire(
        self, request_id: str, fence: int, side: str, owner: str, ttl_s: float, blocks: list[int]
    ) -> bool:
        """Take the lease for `blocks`; False if another owner holds it."""
        return await self._op("acquire", request_id, fence, side, owner, ttl_s, json.dumps(list(blocks)))

    async def renew(self, request_id: str, fence: int, side: str, owner: str, ttl_s: float) -> bool:
        """Extend our lease to ttl_s from now; False if it expired or belongs to someone else."""
        return await self._op("renew", request_id, fence, side, owner, ttl_s, "")

    async def release(self, request_id: str, fence: int, side: str, owner: str) -> bool:
        """Drop our lease; False if it was not ours (or already gone)."""
        return await self._op("release", request_id, fence, side, owner, 0, "")

    async def get(self, request_id: str, fence: int, side: str) -> Lease | None:
        key = self.key(request_id, fence, side)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.pttl(key)
            h, pttl = await pipe.execute()
        if not h:
            return None
        return Lease(request_id, fence, side, h["owner"], json.loads(h["blocks"]), max(pttl, 0) / 1000)

    async def count(self) -> int:
        """Leases in the ledger under this prefix (a leak check: 0 once every transfer ended)."""
        return sum([1 async for _ in self.redis.scan_iter(match=f"{self.prefix}lease:*")])


@dataclass
class LeaseTerm:
    """What a holder carries about its own lease (the keeper reads and writes it)."""

    held: bool = False
    peer_seen: float = 0.0  # keeper clock: when the peer's lease was last found (or ours taken)
    peer_lost: bool = False  # reported once


class Leased(Protocol):
    """A remote-KV request as the keeper sees it."""

    request_id: str
    fence: int
    block_ids: list[int]
    lease: LeaseTerm


class LeaseKeeper:
    """Renews our side's leases and watches the peer's, every ttl/4 (or on `tick()`, in tests)."""

    def __init__(
        self,
        ledger: LeaseLedger,
        side: str,
        owner: str,
        ttl_s: float,
        holders: Callable[[], Iterable[Leased]],
        on_peer_lost: Callable[[Leased], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger, self.side, self.owner, self.ttl_s = ledger, side, owner, ttl_s
        self.holders = holders  # the service's live remote-KV requests
        self.on_peer_lost = on_peer_lost  # event-loop thread, once per holder
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._outage = False  # the last tick could not reach Redis
        self.expired = 0  # peer leases found expired (a metric)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"leases-{self.owner}")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        for h in list(self.holders()):
            await self.release(h)

    async def acquire(self, h: Leased) -> None:
        """Lease h's blocks and start watching the peer's side of the transfer (it has a TTL to show up)."""
        h.lease.held, h.lease.peer_seen = True, self.clock()
        rid, fence = h.request_id, h.fence
        try:
            if not await self.ledger.acquire(rid, fence, self.side, self.owner, self.ttl_s, h.block_ids):
                log.warning("%s lease of %s (fence %d) is held by another owner", self.side, rid, fence)
        except Exception:  # Redis unreachable: the next tick takes it (a failed renewal re-acquires)
            log.exception("could not take the %s lease of %s; retrying on the next tick", self.side, rid)

    async def release(self, h: Leased) -> None:
        if not h.lease.held:
            return
        h.lease.held = False
        with contextlib.suppress(Exception):  # it expires by itself if Redis is away
            await self.ledger.release(h.request_id, h.fence, self.side, self.owner)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 4)
            try:
                await self.tick()
            except Exception as e:
                log.warning("lease upkeep could not reach Redis (%r); retrying", e)

    async def tick(self) -> None:
        """Renew our leases (taking back one Redis lost), then look for the peers'. Time Redis was out
        of reach does not count against a peer: after an outage every peer gets a whole TTL again to
        renew (or re-take) its lease, so no transfer fails only because Redis was briefly away."""
        try:
            await self._tick()
        except Exception:
            self._outage = True
            raise

    async def _tick(self) -> None:
        for h in list(self.holders()):
            if not h.lease.held:
                continue
            rid, fence = h.request_id, h.fence
            if not await self.ledger.renew(rid, fence, self.side, self.owner, self.ttl_s) and h.lease.held:
                log.warning("%s lease of %s was lost; taking it again", self.side, rid)
                await self.ledger.acquire(rid, fence, self.side, self.owner, self.ttl_s, h.block_ids)
        if self._outage:  # Redis is back: the peers need a TTL to find it too
            self._outage = False
            for h in list(self.holders()):
                h.lease.peer_seen = self.clock()
            return
        for h in list(self.holders()):
            if not h.lease.held:
                continue
            rid, fence = h.request_id, h.fence
            now = self.clock()
            if await self.ledger.get(rid, fence, PEER[self.side]) is not None:
                h.lease.peer_seen = now
            elif now - h.lease.peer_seen > self.ttl_s and h.lease.held and not h.lease.peer_lost:
                # The peer never took its lease, or stopped renewing it: it is gone or hung.
                h.lease.peer_lost = True
                self.expired += 1
                log.warning("%s lease of %s expired: freeing our side", PEER[self.side], rid)
                self.on_peer_lost(h)
