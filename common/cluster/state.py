"""Everything a splitserve process keeps in Redis, on one connection pool, under one key prefix
(default "splitserve:"): request records, the worker registry and the transfer ledger."""

from __future__ import annotations

import urllib.parse
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

from common.cluster.leases import LeaseLedger
from common.cluster.records import RequestRecords
from common.cluster.registry import WorkerRegistry


class ClusterState:
    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "splitserve:",
        request_ttl_s: int = 3600,
        worker_ttl_s: float = 5.0,
    ):
        # Values are handled as str throughout; bytes replies would break every comparison.
        assert client.connection_pool.connection_kwargs.get("decode_responses"), "need decode_responses=True"
        self.redis, self.prefix = client, prefix
        self.records = RequestRecords(client, prefix, request_ttl_s)
        self.registry = WorkerRegistry(client, prefix, worker_ttl_s)
        self.leases = LeaseLedger(client, prefix)

    @classmethod
    def from_url(cls, url: str, prefix: str = "splitserve:", **kwargs: Any) -> ClusterState:
        return cls(connect(url), prefix, **kwargs)

    async def close(self) -> None:
        await self.redis.aclose()


POOL_CONNECTIONS = 100  # Redis connections a process opens at most (a URL's ?max_connections= wins)
POOL_WAIT_S = 5.0  # a command waits this long for one of them, then fails as if Redis were away


def connect(url: str) -> aioredis.Redis:
    """A client for `url`, whose commands wait for a free connection when all POOL_CONNECTIONS are busy
    (redis-py's BlockingConnectionPool): redis-py's default pool raises MaxConnectionsError at once
    instead, which every caller takes for Redis being away. In `bench fleet` at 330 req/s a router with
    ~1,000 requests in flight hit it 144 times in 15 s: record writes were parked for a Redis that was
    there, and the router's liveness heartbeat failed (a router whose key expires is swept by the
    others: common/cluster/owners.py). The URLs:

    - `redis://[[user]:password@]host:port/db`, `rediss://...` (TLS), `unix:///path.sock?db=0`: one
      server, as redis-py reads them;
    - `redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]` (or
      `rediss+sentinel://` for TLS): Redis Sentinel; the client asks the sentinels for the master of
      `service` and follows it across failovers. The password is the master's; sentinels that need one
      too take the same. (This one keeps redis-py's sentinel pool, which raises when it is full.)
    """
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme.endswith("+sentinel"):
        pool = aioredis.BlockingConnectionPool.from_url(
            url, decode_responses=True, max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_S
        )
        return aioredis.Redis.from_pool(pool)  # the client owns it: aclose() closes it
    hosts = parts.netloc.rpartition("@")[2]
    path = [p for p in parts.path.split("/") if p]
    if not hosts or not path:
        raise ValueError(f"a sentinel URL names its sentinels and the service: {url!r}")
    sentinels = []
    for hostport in hosts.split(","):
        host, _, port = hostport.rpartition(":")
        sentinels.append((host.strip("[]") or hostport, int(port) if port.isdigit() else 26379))
    auth = {
        k: urllib.parse.unquote(v)
        for k, v in (("username", parts.username), ("password", parts.password))
        if v
    }
    ssl = parts.scheme.startswith("rediss")
    sentinel = Sentinel(sentinels, sentinel_kwargs={**auth, "ssl": ssl}, ssl=ssl, **auth)
    db = int(path[1]) if len(path) > 1 else 0
    return sentinel.master_for(path[0], db=db, decode_responses=True)
