"""Requests whose router died are ended with a reason, not left live in Redis forever.

    routers            set of router ids: every live router, and those that owned requests
    router:{id}        "1" with a TTL, refreshed every interval: this router process is alive
    router:{id}:url    where this router is reached (its /metrics, for the planner), the same TTL
    owned:{id}         set of the ids of the live requests this router accepted

A router adds each request it accepts to its set in the script that creates the request's record
(`RequestRecords.create(owned_by=...)`, which refreshes the router's key too, so an owned set never
exists without a live key behind it, even right after Redis restarted empty), and takes it out in
the script that writes the request's end (`transition(leave=...)`): no round trips of their own, and
a record write kept for a Redis that is away (RecordWriter) takes the set along when it lands. Every
router sweeps: a router id whose key has expired belongs to a process that stopped without ending
its requests (SIGKILL, OOM, a lost node); each of its requests still live moves to FAILED with the
reason, and its set goes. The decode and prefill services free those requests' KV on their own — the
router's streams to them closed when it died. Two routers sweeping the same set is harmless: a
transition is atomic, the second refused.

The planner reads every live router's /metrics (`live_router_urls`): each router adds itself to
`routers` and writes its URL beside its liveness key at every heartbeat; a router that stops cleanly
deletes both keys, one that dies is gone from the list when its keys expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import cast

import redis.asyncio as aioredis

from common.cluster.records import IllegalTransition, OwnedSet, RequestRecords, RequestState, UnknownRequest
from common.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def url_key(prefix: str, router_id: str) -> str:
    return f"{prefix}router:{router_id}:url"


async def live_router_urls(client: aioredis.Redis, prefix: str) -> dict[str, str]:
    """Every live router that registered its URL: router id -> URL (two reads)."""
    ids = sorted(cast(set[str], await client.smembers(f"{prefix}routers")))
    if not ids:
        return {}
    urls = cast(list[str | None], await client.mget([url_key(prefix, rid) for rid in ids]))
    return {rid: url for rid, url in zip(ids, urls, strict=True) if url}


class RouterOwnership:
    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        router_id: str,
        records: RequestRecords,
        interval_s: float = 2.0,
        ttl_s: float = 10.0,
        url: str | None = None,
    ) -> None:
        self.redis, self.prefix, self.router_id, self.records = client, prefix, router_id, records
        self.url = url  # registered for the planner; None: this router is not listed
        self.interval_s, self.ttl_ms = interval_s, int(ttl_s * 1000)
        self.swept = 0  # requests this router ended for a dead one (a metric)
        self._task: asyncio.Task[None] | None = None
        # this router's set, for the record writes that join and leave it
        self.owned_set = OwnedSet(
            self._owned_key(router_id), self._alive_key(router_id), f"{prefix}routers", router_id, self.ttl_ms
        )

    def _alive_key(self, router_id: str) -> str:
        return f"{self.prefix}router:{router_id}"

    def _owned_key(self, router_id: str) -> str:
        return f"{self.prefix}owned:{router_id}"

    async def heartbeat(self) -> None:
        if self.url is None:
            await self.redis.set(self._alive_key(self.router_id), "1", px=self.ttl_ms)
            return
        async with self.redis.pipeline(transaction=True) as p:
            p.set(self._alive_key(self.router_id), "1", px=self.ttl_ms)
            p.set(url_key(self.prefix, self.router_id), self.url, px=self.ttl_ms)
            p.sadd(f"{self.prefix}routers", self.router_id)
            await p.execute()

    async def sweep(self) -> int:
        """End the live requests of every router whose key expired; returns how many."""
        ended = 0
        routers = cast(set[str], await self.redis.smembers(f"{self.prefix}routers"))
        for rid in routers:
            if rid == self.router_id or await self.redis.exists(self._alive_key(rid)):
                continue
            owned = cast(set[str], await self.redis.smembers(self._owned_key(rid)))
            for request_id in owned:
                with contextlib.suppress(IllegalTransition, UnknownRequest):  # ended, or expired
                    await self.records.transition(
                        request_id, RequestState.FAILED,
                        error=f"router {rid} stopped before the request ended (its client lost the stream)",
                    )  # fmt: skip
                    ended += 1
                    log.warning("request %s: its router %s is gone; recorded as failed", request_id, rid)
            async with self.redis.pipeline(transaction=True) as p:
                p.delete(self._owned_key(rid))
                p.srem(f"{self.prefix}routers", rid)
                await p.execute()
        self.swept += ended
        return ended

    async def run(self) -> None:
        """Heartbeat and sweep every interval; Redis being away only delays both."""
        while True:
            try:
                await self.heartbeat()
                await self.sweep()
            except Exception as e:
                log.warning("router liveness: %r (retrying in %.0f s)", e, self.interval_s)
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    async def stop(self) -> None:
        """A router that stops cleanly: its key goes at once, so what it leaves live is swept soon."""
        if self._task is not None:
            await cancel_and_wait(self._task)
        with contextlib.suppress(Exception):
            await self.redis.delete(self._alive_key(self.router_id), url_key(self.prefix, self.router_id))
