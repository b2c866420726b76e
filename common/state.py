"""Redis: request records, worker registry, transfer-ledger leases.

Keys (all under a configurable prefix, default "splitserve:"):
  req:{id}            hash: state, t_<state> per transition, history (JSON [[state, ts], ...]),
                      worker ids, token counts, finish_reason, error, model, route; TTL once terminal
  worker:{id}         hash: role, url, kv_endpoint, capacity/load (JSON), last_seen; TTL = heartbeat
  workers:{role}      set of worker ids; entries whose hash has expired are dropped lazily by alive()
  lease:{id}:{side}   hash: owner, blocks (JSON); TTL = lease

Every check-then-write runs as one Lua script, so concurrent writers cannot interleave between the
check and the write. Transition timestamps come from the Redis server's clock (TIME): one clock for
all services, so a request's timeline is ordered even when its hops run on different machines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

import redis.asyncio as aioredis
from redis.typing import EncodableT

log = logging.getLogger(__name__)


class RequestState(StrEnum):
    QUEUED = "queued"
    RESERVED = "reserved"  # decode service holds KV blocks for the prompt
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = RequestState
TERMINAL = frozenset({S.FINISHED, S.FAILED, S.CANCELLED})
ABORT = frozenset({S.FAILED, S.CANCELLED})
# Allowed moves. The local-prefill path goes RESERVED -> DECODING (the decode service prefills).
# Any live state may fail or be cancelled; terminal states are final.
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.QUEUED: frozenset({S.RESERVED}) | ABORT,
    S.RESERVED: frozenset({S.PREFILLING, S.DECODING}) | ABORT,
    # back to RESERVED: the prefill or its transfer failed and a new reservation was made (retry on
    # another prefill service, or recompute on the decode service)
    S.PREFILLING: frozenset({S.TRANSFERRING, S.RESERVED}) | ABORT,
    # FINISHED straight from TRANSFERRING: the first token (sampled by prefill) already ended it
    S.TRANSFERRING: frozenset({S.DECODING, S.FINISHED, S.RESERVED}) | ABORT,
    S.DECODING: TERMINAL,
    S.FINISHED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}

# Fields a record may carry besides state/timestamps/history, with the type get() restores.
RECORD_FIELDS: dict[str, type] = {
    "router_id": str,
    "prefill_id": str,
    "decode_id": str,
    "model": str,
    "route": str,  # "split" or "local:<reason>"
    "prompt_tokens": int,
    "output_tokens": int,
    "finish_reason": str,
    "error": str,
}

# KEYS[1] record. ARGV: new_state, ttl_s (0 = none), n, n allowed current states ("" = no record),
# then field/value pairs. Returns {1, ts} on success, {0, current_state_or_""} when refused.
_TRANSITION_LUA = """
local cur = redis.call('HGET', KEYS[1], 'state') or ''
local n = tonumber(ARGV[3])
local ok = false
for i = 4, 3 + n do if ARGV[i] == cur then ok = true end end
if not ok then return {0, cur} end
local t = redis.call('TIME')
local ts = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
-- history is appended as text so the timestamp keeps all its digits (cjson would round it)
local entry = '["' .. ARGV[1] .. '",' .. ts .. ']'
local hist = redis.call('HGET', KEYS[1], 'history')
if hist and hist ~= '[]' then hist = string.sub(hist, 1, -2) .. ',' .. entry .. ']'
else hist = '[' .. entry .. ']' end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 't_' .. ARGV[1], ts, 'history', hist, unpack(ARGV, 4 + n))
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return {1, ts}
"""

# KEYS[1] worker hash. ARGV: load JSON, last_seen, ttl_ms. 0 if the worker's key has expired.
_HEARTBEAT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'load', ARGV[1], 'last_seen', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

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


class IllegalTransition(ValueError):
    """A transition the table does not allow (including any move out of a terminal state)."""

    def __init__(self, request_id: str, current: RequestState, new: RequestState):
        super().__init__(f"request {request_id!r}: illegal transition {current.name} -> {new.name}")
        self.request_id, self.current, self.new = request_id, current, new


class UnknownRequest(KeyError):
    """transition() on a request id with no record (never created, or expired)."""


class DuplicateRequest(ValueError):
    """create() on a request id that already has a record."""


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    role: str  # "prefill" | "decode"
    url: str
    kv_endpoint: str
    capacity: dict[str, Any]
    load: dict[str, Any]  # running, waiting, free_blocks, total_blocks
    last_seen: float  # unix time of the last register/heartbeat


@dataclass(frozen=True)
class Lease:
    request_id: str
    side: str  # "prefill" | "decode"
    owner: str
    blocks: list[int]
    ttl_s: float  # time left


ROLES = ("prefill", "decode")


class StateStore:
    """Request records, worker registry and leases on one Redis connection pool."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "splitserve:",
        request_ttl_s: int = 3600,
        worker_ttl_s: float = 5.0,
    ):
        # Values are handled as str throughout; bytes replies would break every comparison.
        assert client.connection_pool.connection_kwargs.get("decode_responses"), "need decode_responses=True"
        self.redis = client
        self.prefix = prefix
        self.request_ttl_s = request_ttl_s
        self.worker_ttl_s = worker_ttl_s
        self._transition = client.register_script(_TRANSITION_LUA)
        self._heartbeat = client.register_script(_HEARTBEAT_LUA)
        self._lease = client.register_script(_LEASE_LUA)
        # HSET only on an existing record: an update never creates a stray one
        self._set_fields = client.register_script(
            "if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end "
            "redis.call('HSET', KEYS[1], unpack(ARGV)) return 1"
        )

    @classmethod
    def from_url(cls, url: str, prefix: str = "splitserve:", **kwargs: Any) -> StateStore:
        return cls(aioredis.Redis.from_url(url, decode_responses=True), prefix, **kwargs)

    async def close(self) -> None:
        await self.redis.aclose()

    # ---- request records ----

    def _req_key(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    async def create(self, request_id: str, **fields: Any) -> float:
        """New record in QUEUED; returns its timestamp. DuplicateRequest if the id exists."""
        ok, ts = await self._apply(request_id, S.QUEUED, [""], fields)
        if not ok:
            raise DuplicateRequest(f"request {request_id!r} already exists (state {ts})")
        return float(ts)

    async def transition(self, request_id: str, new_state: RequestState | str, **fields: Any) -> float:
        """Move to new_state, recording t_<state> and a history entry, and set fields, atomically.

        Returns the transition's timestamp. IllegalTransition if the table forbids the move (the record
        is left untouched); UnknownRequest if there is no record.
        """
        new = RequestState(new_state)
        allowed_from = [s.value for s, targets in TRANSITIONS.items() if new in targets]
        ok, value = await self._apply(request_id, new, allowed_from, fields)
        if ok:
            return float(value)
        if value == "":
            raise UnknownRequest(f"request {request_id!r} has no record")
        raise IllegalTransition(request_id, RequestState(value), new)

    async def _apply(
        self, request_id: str, new: RequestState, allowed_from: list[str], fields: Mapping[str, Any]
    ) -> tuple[bool, str]:
        pairs: list[str | int] = []
        for name, value in fields.items():
            if name not in RECORD_FIELDS:
                raise ValueError(f"unknown request field {name!r}; known: {sorted(RECORD_FIELDS)}")
            if value is not None:
                pairs += [name, RECORD_FIELDS[name](value)]
        ttl = self.request_ttl_s if new in TERMINAL else 0
        args = [new.value, ttl, len(allowed_from), *allowed_from, *pairs]
        ok, value = await self._transition(keys=[self._req_key(request_id)], args=args)
        return bool(ok), str(value)

    async def set_fields(self, request_id: str, **fields: Any) -> bool:
        """Update fields of an existing record without a transition (e.g. the route changed after a
        failed prefill). Returns False if there is no record."""
        pairs: list[Any] = []
        for name, value in fields.items():
            if name not in RECORD_FIELDS:
                raise ValueError(f"unknown request field {name!r}; known: {sorted(RECORD_FIELDS)}")
            if value is not None:
                pairs += [name, RECORD_FIELDS[name](value)]
        if not pairs:
            return True
        return bool(await self._set_fields(keys=[self._req_key(request_id)], args=pairs))

    async def get(self, request_id: str) -> dict[str, Any] | None:
        """The record with types restored (state as RequestState, numbers as numbers), or None."""
        raw = cast(dict[str, str], await self.redis.hgetall(self._req_key(request_id)))
        if not raw:
            return None
        record: dict[str, Any] = {}
        for name, value in raw.items():
            if name == "state":
                record[name] = RequestState(value)
            elif name == "history":
                record[name] = [(RequestState(s), float(t)) for s, t in json.loads(value)]
            elif name.startswith("t_"):
                record[name] = float(value)
            else:
                record[name] = RECORD_FIELDS.get(name, str)(value)
        return record

    # ---- worker registry ----

    def _worker_key(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    def _index_key(self, role: str) -> str:
        return f"{self.prefix}workers:{role}"

    async def register(
        self,
        worker_id: str,
        role: str,
        url: str,
        kv_endpoint: str,
        capacity: Mapping[str, Any],
        load: Mapping[str, Any],
    ) -> None:
        """Publish (or re-publish) a worker; it stays alive for worker_ttl_s unless heartbeats follow."""
        if role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {role!r}")
        key = self._worker_key(worker_id)
        mapping: dict[EncodableT, EncodableT] = {
            "role": role,
            "url": url,
            "kv_endpoint": kv_endpoint,
            "capacity": json.dumps(dict(capacity)),
            "load": json.dumps(dict(load)),
            "last_seen": repr(time.time()),
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)  # drop fields of an earlier registration
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, int(self.worker_ttl_s * 1000))
            pipe.sadd(self._index_key(role), worker_id)
            await pipe.execute()

    async def heartbeat(self, worker_id: str, load: Mapping[str, Any]) -> bool:
        """Refresh the worker's TTL and load. False if its key already expired: register again."""
        args: list[str | int] = [json.dumps(dict(load)), repr(time.time()), int(self.worker_ttl_s * 1000)]
        return bool(await self._heartbeat(keys=[self._worker_key(worker_id)], args=args))

    async def deregister(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._worker_key(worker_id))
            for role in ROLES:
                pipe.srem(self._index_key(role), worker_id)
            await pipe.execute()

    async def alive(self, role: str) -> list[WorkerInfo]:
        """Workers of `role` whose registration has not expired, sorted by id."""
        ids = sorted(cast(set[str], await self.redis.smembers(self._index_key(role))))
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in ids:
                pipe.hgetall(self._worker_key(worker_id))
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
                )
            )
        if gone:
            # Expired hashes vanish on their own; their index entries are cleaned here, when seen.
            await self.redis.srem(self._index_key(role), *gone)
        return workers

    # ---- transfer-ledger leases ----

    def _lease_key(self, request_id: str, side: str) -> str:
        if side not in ROLES:
            raise ValueError(f"lease side must be one of {ROLES}, got {side!r}")
        return f"{self.prefix}lease:{request_id}:{side}"

    async def _lease_op(
        self, op: str, request_id: str, side: str, owner: str, ttl_s: float, blocks: str
    ) -> bool:
        key = self._lease_key(request_id, side)
        return bool(await self._lease(keys=[key], args=[op, owner, int(ttl_s * 1000), blocks]))

    async def acquire_lease(
        self, request_id: str, side: str, owner: str, ttl_s: float, blocks: list[int]
    ) -> bool:
        """Take the lease for `blocks`; False if another owner holds it."""
        return await self._lease_op("acquire", request_id, side, owner, ttl_s, json.dumps(list(blocks)))

    async def renew_lease(self, request_id: str, side: str, owner: str, ttl_s: float) -> bool:
        """Extend our lease to ttl_s from now; False if it expired or belongs to someone else."""
        return await self._lease_op("renew", request_id, side, owner, ttl_s, "")

    async def release_lease(self, request_id: str, side: str, owner: str) -> bool:
        """Drop our lease; False if it was not ours (or already gone)."""
        return await self._lease_op("release", request_id, side, owner, 0, "")

    async def get_lease(self, request_id: str, side: str) -> Lease | None:
        key = self._lease_key(request_id, side)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.pttl(key)
            h, pttl = await pipe.execute()
        if not h:
            return None
        return Lease(request_id, side, h["owner"], json.loads(h["blocks"]), max(pttl, 0) / 1000)


class Heartbeat:
    """Registers a worker, then refreshes it every interval_s with load_fn()'s numbers.

    If the registration expired (a long stall, a Redis restart) it registers again; Redis errors are
    logged and retried on the next beat rather than killing the task.
    """

    def __init__(
        self,
        store: StateStore,
        worker_id: str,
        role: str,
        url: str,
        kv_endpoint: str,
        capacity: Mapping[str, Any],
        load_fn: Callable[[], Mapping[str, Any]],
        interval_s: float = 1.0,
    ):
        self.store, self.worker_id, self.load_fn, self.interval_s = store, worker_id, load_fn, interval_s
        self._registration = (worker_id, role, url, kv_endpoint, dict(capacity))
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register now (errors propagate: a worker that cannot register should not start)."""
        await self.store.register(*self._registration, self.load_fn())
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.worker_id}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                load = self.load_fn()
                if not await self.store.heartbeat(self.worker_id, load):
                    log.warning("worker %s registration had expired; registering again", self.worker_id)
                    await self.store.register(*self._registration, load)
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
            await self.store.deregister(self.worker_id)
