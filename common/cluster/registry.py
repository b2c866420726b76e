"""The worker registry in Redis: every prefill and decode service, its URLs, capacity and load.

    worker:{id}       hash: role, url, kv_endpoint, capacity/load (JSON), last_seen; TTL = heartbeat
    workers:{role}    set of worker ids; entries whose hash has expired are dropped lazily by alive()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.typing import EncodableT

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")

# KEYS[1] worker hash. ARGV: load JSON, last_seen, ttl_ms. 0 if the worker's key has expired.
_HEARTBEAT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'load', ARGV[1], 'last_seen', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    role: str  # "prefill" | "decode"
    url: str
    kv_endpoint: str
    capacity: dict[str, Any]
    load: dict[str, Any]  # running, waiting, free_blocks, total_blocks
    last_seen: float  # unix time of the last register/heartbeat
    incarnation: str = ""  # this start of the worker's process: a restart under the same id changes it


class WorkerRegistry:
    def __init__(self, client: aioredis.Redis, prefix: str, ttl_s: float = 5.0) -> None:
        self.redis, self.prefix, self.ttl_s = client, prefix, ttl_s
        self._heartbeat = client.register_script(_HEARTBEAT_LUA)

    def key(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    def index_key(self, role: str) -> str:
        return f"{self.prefix}workers:{role}"

    async def register(
        self,
        worker_id: str,
        role: str,
        url: str,
        kv_endpoint: str,
        capacity: Mapping[str, Any],
        load: Mapping[str, Any],
        incarnation: str = "",
    ) -> None:
        """Publish (or re-publish) a worker; it stays alive for ttl_s unless heartbeats follow."""
        if role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {role!r}")
        key = self.key(worker_id)
        mapping: dict[EncodableT, EncodableT] = {
            "role": role,
            "url": url,
            "kv_endpoint": kv_endpoint,
            "capacity": json.dumps(dict(capacity)),
            "load": json.dumps(dict(load)),
            "last_seen": repr(time.time()),
            "incarnation": incarnation,
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)  # drop fields of an earlier registration
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, int(self.ttl_s * 1000))
            pipe.sadd(self.index_key(role), worker_id)
            await pipe.execute()

    async def heartbeat(self, worker_id: str, load: Mapping[str, Any]) -> bool:
        """Refresh the worker's TTL and load. False if its key already expired: register again."""
        args: list[str | int] = [json.dumps(dict(load)), repr(time.time()), int(self.ttl_s * 1000)]
        return bool(await self._heartbeat(keys=[self.key(worker_id)], args=args))

    async def deregister(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key(worker_id))
            for role in ROLES:
                pipe.srem(self.index_key(role), worker_id)
            await pipe.execute()

    async def alive(self, role: str) -> list[WorkerInfo]:
        """Workers of `role` whose registration has not expired, sorted by id."""
        ids = sorted(cast(set[str], await self.redis.smembers(self.index_key(role))))
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in ids:
                pipe.hgetall(self.key(worker_id))
            hashes = await pipe.execute()
        workers, gone = [], []
        for worker_id, h in zip(ids, hashes, strict=True):
            if not h:
                gone.append(worker_id)
                continue
            workers.append(
                WorkerInfo(
                    id=worker_id,
                    role=h["role"],
                    url=h["url"],
                    kv_endpoint=h["kv_endpoint"],
                    capacity=json.loads(h["capacity"]),
                    load=json.loads(h["load"]),
                    last_seen=float(h["last_seen"]),
                    incarnation=h.get("incarnation", ""),
                )
            )
        if gone:
            # Expired hashes vanish on their own; their index entries are cleaned here, when seen.
            await self.redis.srem(self.index_key(role), *gone)
        return workers


class Heartbeat:
    """Registers a worker, then refreshes it every interval_s with load_fn()'s numbers.

    If the registration expired (a long stall, a Redis restart) it registers again; Redis errors are
    logged and retried on the next beat rather than killing the task.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        worker_id: str,
        role: str,
        url: str,
        kv_endpoint: str,
        capacity: Mapping[str, Any],
        load_fn: Callable[[], Mapping[str, Any]],
        interval_s: float = 1.0,
        incarnation: str = "",
    ):
        self.registry, self.worker_id = registry, worker_id
        self.load_fn, self.interval_s = load_fn, interval_s
        self._registration = (worker_id, role, url, kv_endpoint, dict(capacity))
        self.incarnation = incarnation
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register now (errors propagate: a worker that cannot register should not start)."""
        await self.registry.register(*self._registration, self.load_fn(), self.incarnation)
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.worker_id}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                load = self.load_fn()
                if not await self.registry.heartbeat(self.worker_id, load):
                    log.warning("worker %s registration had expired; registering again", self.worker_id)
                    await self.registry.register(*self._registration, load, self.incarnation)
            except Exception:
                log.exception("heartbeat for worker %s failed", self.worker_id)

    async def stop(self, deregister: bool = True) -> None:
        """Stop beating; by default also remove the worker so routers stop picking it at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if deregister:
            await self.registry.deregister(self.worker_id)
