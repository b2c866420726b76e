"""The worker registry in Redis: every prefill and decode service, its URLs, capacity and load.

    worker:{id}       hash: role, url, kv_endpoint, capacity/load (JSON), last_seen, incarnation, sig;
                      TTL = heartbeat
    workers:{role}    set of worker ids; entries whose hash has expired are dropped lazily by alive()

Redis is not trusted with where prompts go: `sig` signs the entry's id, role, url, kv_endpoint,
incarnation and capacity with the internal secret (common/security/identity.py), and alive() leaves out
(counts in `untrusted`, logs once per worker) an entry whose signature is missing or does not verify —
one written straight into Redis. Load and last_seen are not signed (heartbeats rewrite them): a forger
can make a real service look busier or idler, not send a request anywhere else. Without a configured
secret (loopback development) nothing is checked: there is nothing to sign with.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.typing import EncodableT

from common.runtime.tasks import cancel_and_wait
from common.security.identity import WorkerIdentity
from common.security.secret import InternalSecret

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")

# KEYS[1] worker hash. ARGV: load JSON, last_seen, ttl_ms. 0 if the worker's key has expired.
_HEARTBEAT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'load', ARGV[1], 'last_seen', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1] a role's index set. ARGV[1] the worker hash prefix. Every listed worker's hash in one round
# trip, as one JSON text: [[id, [field, value, ...]], ...] (parsed by json in C: the same hashes read as
# RESP replies were ~200 Python parser calls per read of 12 workers, ~1 ms of a router's CPU, several
# times a second). Index entries whose hash has expired are dropped here (SREM), as alive() did.
_ALIVE_LUA = """
local ids = redis.call('SMEMBERS', KEYS[1])
local out = {}
for _, id in ipairs(ids) do
  local h = redis.call('HGETALL', ARGV[1] .. id)
  if #h == 0 then redis.call('SREM', KEYS[1], id) else out[#out + 1] = {id, h} end
end
if #out == 0 then return '[]' end
return cjson.encode(out)
"""
_VERIFIED_MAX = 10_000  # signature checks remembered (WorkerRegistry._check)


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
    def __init__(
        self, client: aioredis.Redis, prefix: str, ttl_s: float = 5.0, secret: InternalSecret | None = None
    ) -> None:
        self.redis, self.prefix, self.ttl_s = client, prefix, ttl_s
        # signs what register() writes and checks what alive() reads (default: SPLITSERVE_INTERNAL_SECRET)
        self.secret = InternalSecret.from_env() if secret is None else secret
        self._heartbeat = client.register_script(_HEARTBEAT_LUA)
        self._alive = client.register_script(_ALIVE_LUA)
        # (secret, the entry's signed fields as read, sig) -> _check's answer: an entry is re-read several
        # times a second and changes only when its worker registers again
        self._verified: dict[tuple[Any, ...], str] = {}
        self.untrusted: Counter[str] = Counter()  # entries left out by alive(), by reason: unsigned, forged
        self._reported: set[tuple[str, str]] = set()  # (worker id, reason) logged already

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
            "sig": WorkerIdentity(worker_id, role, url, kv_endpoint, incarnation, capacity).sign(self.secret),
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
        """Workers of `role` whose registration has not expired and is signed with the internal secret,
        sorted by id. One round trip (_ALIVE_LUA), which also drops the index entries of expired ones."""
        raw = await self._alive(keys=[self.index_key(role)], args=[self.key("")])
        entries = sorted(json.loads(raw))
        workers = []
        for worker_id, flat in entries:
            h = dict(zip(flat[::2], flat[1::2], strict=True))
            try:
                info = WorkerInfo(
                    id=worker_id,
                    role=h["role"],
                    url=h["url"],
                    kv_endpoint=h["kv_endpoint"],
                    capacity=json.loads(h["capacity"]),
                    load=json.loads(h["load"]),
                    last_seen=float(h["last_seen"]),
                    incarnation=h.get("incarnation", ""),
                )
            except (KeyError, ValueError, TypeError):
                self._distrust(worker_id, "malformed", h.get("url", "?"))
                continue
            signed = (self.secret, worker_id, info.role, info.url, info.kv_endpoint, info.incarnation,
                      h["capacity"], h.get("sig", ""))  # fmt: skip
            why = self._verified.get(signed)
            if why is None:
                why = self._check(info, h.get("sig", ""))
                if len(self._verified) >= _VERIFIED_MAX:
                    self._verified.clear()
                self._verified[signed] = why
            if why:
                self._distrust(worker_id, why, info.url)
                continue
            workers.append(info)
        return workers

    def _check(self, w: WorkerInfo, sig: str) -> str:
        """Why the entry is not to be trusted ("" when it is): unsigned, forged (or signed with another
        secret). Everything passes without a configured secret."""
        if not self.secret.configured:
            return ""
        if not sig:
            return "unsigned"
        ident = WorkerIdentity(w.id, w.role, w.url, w.kv_endpoint, w.incarnation, w.capacity)
        return "" if ident.verify(self.secret, sig) else "forged"

    def _distrust(self, worker_id: str, why: str, url: str) -> None:
        self.untrusted[why] += 1
        if (worker_id, why) not in self._reported:
            if len(self._reported) > 10_000:
                self._reported.clear()
            self._reported.add((worker_id, why))
            log.warning(
                "registry entry %r (url %s) ignored: %s — not written by a service holding the internal "
                "secret (or by one with another secret)",
                worker_id, url, why,
            )  # fmt: skip


class Heartbeat:
    """Registers a worker, then refreshes it every interval_s with load_fn()'s numbers.

    If the registration expired (a long stall, a Redis restart) it registers again; Redis errors are
    logged (once per outage) and retried RETRY_S later rather than killing the task, so a Redis that
    comes back empty has the worker again within RETRY_S, not a whole interval later.
    """

    RETRY_S = 0.2

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
        failing = False
        while True:
            await asyncio.sleep(min(self.interval_s, self.RETRY_S) if failing else self.interval_s)
            try:
                load = self.load_fn()
                if not await self.registry.heartbeat(self.worker_id, load):
                    log.warning("worker %s registration had expired; registering again", self.worker_id)
                    await self.registry.register(*self._registration, load, self.incarnation)
                if failing:
                    log.info("heartbeat for worker %s works again", self.worker_id)
                failing = False
            except Exception:
                if not failing:
                    retry_s = min(self.interval_s, self.RETRY_S)
                    log.exception(
                        "heartbeat for worker %s failed; retrying every %g s", self.worker_id, retry_s
                    )
                failing = True

    async def stop(self, deregister: bool = True) -> None:
        """Stop beating; by default also remove the worker so routers stop picking it at once."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if deregister:
            await self.registry.deregister(self.worker_id)
