"""Everything a splitserve process keeps in Redis, on one connection pool, under one key prefix
(default "splitserve:"): request records, the worker registry and the transfer ledger."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

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
        return cls(aioredis.Redis.from_url(url, decode_responses=True), prefix, **kwargs)

    async def close(self) -> None:
        await self.redis.aclose()
