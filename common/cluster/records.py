"""Request records in Redis: one hash per request, moved through a fixed state machine atomically.

    req:{id}   hash: state, t_<state> per transition, history (JSON [[state, ts], ...]), worker ids,
               token counts, finish_reason, error, model, route, the KV transfer's bytes, time and
               backend; TTL once terminal

Every check-then-write runs as one Lua script, so concurrent writers cannot interleave between the
check and the write. Transition timestamps come from the Redis server's clock (TIME): one clock for
all services, so a request's timeline is ordered even when its hops run on different machines.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

import redis.asyncio as aioredis


class RequestState(StrEnum):
    QUEUED = "queued"
    RESERVED = "reserved"  # decode service holds KV blocks for the prompt
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    MIGRATING = "migrating"  # the router moves the request to another decode service
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
    S.RESERVED: frozenset({S.PREFILLING, S.DECODING, S.MIGRATING}) | ABORT,
    # back to RESERVED: the prefill or its transfer failed and a new reservation was made (retry on
    # another prefill service, or recompute on the decode service)
    S.PREFILLING: frozenset({S.TRANSFERRING, S.RESERVED, S.MIGRATING}) | ABORT,
    # FINISHED straight from TRANSFERRING: the first token (sampled by prefill) already ended it
    S.TRANSFERRING: frozenset({S.DECODING, S.FINISHED, S.RESERVED, S.MIGRATING}) | ABORT,
    # MIGRATING: the decode service failed; a new one reserves (RESERVED) and the request goes on
    S.DECODING: TERMINAL | {S.MIGRATING},
    S.MIGRATING: frozenset({S.RESERVED}) | ABORT,
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
    "prefix_hit_blocks": int,  # leading prompt blocks the KV index said the chosen decode service held
    "prefill_prefix_hit_blocks": int,  # the same for the chosen prefill service (split path)
    "prompt_tokens": int,
    "output_tokens": int,
    "finish_reason": str,
    "error": str,
    "migrations": int,  # times the request moved to another decode service
    "migrated_from": str,  # the decode service it last left
    "migration_reason": str,  # why
    "restored": int,  # 1: Redis lost the record (restarted empty) and its end was written again
    "tenant": str,  # the API key's tenant (a key reads only its own tenant's records)
    "key_id": str,  # the API key's public id (never its secret)
    # the KV transfer, written by the prefill service once kv_done went out (the latest attempt's)
    "transfer_bytes": int,  # KV bytes it sent
    "transfer_ms": float,  # its first layer write to kv_done delivered
    "transfer_backend": str,  # nixl, tcp, torch_dist
}

# KEYS[1] record, then a router's owned set, liveness key and routers set (OwnedSet) when the write
# joins or leaves it. ARGV: new_state, ttl_s (0 = none), n, n allowed current states ("" = no record),
# k, k owned-set arguments, then field/value pairs. k = 3 (request id, router id, liveness TTL in ms):
# once the move is made, the request joins the set and the router's key is refreshed; k = 1 (request
# id): the request leaves the set, whether or not the move is made (its end is this router's to write
# either way: restored or refused, it is no longer the router's to watch). Returns {1, ts} on success,
# {0, current_state_or_""} when refused.
_TRANSITION_LUA = """
local cur = redis.call('HGET', KEYS[1], 'state') or ''
local n = tonumber(ARGV[3])
local k = tonumber(ARGV[4 + n])
if k == 1 then redis.call('SREM', KEYS[2], ARGV[5 + n]) end
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
redis.call('HSET', KEYS[1], 'state', ARGV[1], 't_' .. ARGV[1], ts, 'history', hist, unpack(ARGV, 5 + n + k))
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
if k == 3 then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[7 + n])
  redis.call('SADD', KEYS[4], ARGV[6 + n])
  redis.call('SADD', KEYS[2], ARGV[5 + n])
end
return {1, ts}
"""

# KEYS[1] record. ARGV: state, ttl_s (0 = none), then field/value pairs. Writes a record Redis lost (it
# restarted empty) again, with this state as its whole history; 0 if the record exists after all.
_RESTORE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local t = redis.call('TIME')
local ts = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local hist = '[["' .. ARGV[1] .. '",' .. ts .. ']]'
redis.call('HSET', KEYS[1], 'state', ARGV[1], 't_' .. ARGV[1], ts, 'history', hist, 'restored', 1,
           unpack(ARGV, 3))
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 1
"""

# HSET only on an existing record: an update never creates a stray one
_SET_FIELDS_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


@dataclass(frozen=True)
class OwnedSet:
    """A router's set of the live requests it accepted (common/cluster/owners.py). A request joins it in
    the script that creates its record and leaves it in the one that writes its end: no round trip
    of its own, and a write the RecordWriter retries takes the set along."""

    key: str  # owned:{router id}
    alive_key: str  # router:{router id}, refreshed whenever a request joins
    routers_key: str  # routers
    router_id: str
    ttl_ms: int  # the liveness key's

    def join(self, request_id: str) -> tuple[list[str], list[str | int]]:
        return [self.key, self.alive_key, self.routers_key], [request_id, self.router_id, self.ttl_ms]

    def leave(self, request_id: str) -> tuple[list[str], list[str | int]]:
        return [self.key], [request_id]


_NOT_OWNED: tuple[list[str], list[str | int]] = ([], [])


class IllegalTransition(ValueError):
    """A transition the table does not allow (including any move out of a terminal state)."""

    def __init__(self, request_id: str, current: RequestState, new: RequestState):
        super().__init__(f"request {request_id!r}: illegal transition {current.name} -> {new.name}")
        self.request_id, self.current, self.new = request_id, current, new


class UnknownRequest(KeyError):
    """transition() on a request id with no record (never created, or expired)."""


class DuplicateRequest(ValueError):
    """create() on a request id that already has a record."""


class RequestRecords:
    def __init__(self, client: aioredis.Redis, prefix: str, ttl_s: int = 3600) -> None:
        self.redis, self.prefix, self.ttl_s = client, prefix, ttl_s
        self._transition = client.register_script(_TRANSITION_LUA)
        self._set_fields = client.register_script(_SET_FIELDS_LUA)
        self._restore = client.register_script(_RESTORE_LUA)

    def key(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    async def create(self, request_id: str, owned_by: OwnedSet | None = None, **fields: Any) -> float:
        """New record in QUEUED; returns its timestamp. DuplicateRequest if the id exists. With
        owned_by, the request joins that router's owned set in the same script (not if refused)."""
        owned = owned_by.join(request_id) if owned_by is not None else _NOT_OWNED
        ok, ts = await self._apply(request_id, S.QUEUED, [""], fields, owned)
        if not ok:
            raise DuplicateRequest(f"request {request_id!r} already exists (state {ts})")
        return float(ts)

    async def transition(
        self, request_id: str, new_state: RequestState | str, leave: OwnedSet | None = None, **fields: Any
    ) -> float:
        """Move to new_state, recording t_<state> and a history entry, and set fields, atomically.

        Returns the transition's timestamp. IllegalTransition if the table forbids the move (the record
        is left untouched); UnknownRequest if there is no record. With leave (an end only), the request
        leaves that router's owned set in the same script, refused or not.
        """
        new = RequestState(new_state)
        assert leave is None or new in TERMINAL, f"a request leaves its router's set at its end, not {new}"
        allowed_from = [s.value for s, targets in TRANSITIONS.items() if new in targets]
        owned = leave.leave(request_id) if leave is not None else _NOT_OWNED
        return await self._move(request_id, new, allowed_from, fields, owned)

    async def _move(
        self,
        request_id: str,
        new: RequestState,
        allowed_from: list[str],
        fields: Mapping[str, Any],
        owned: tuple[list[str], list[str | int]] = _NOT_OWNED,
    ) -> float:
        """_apply, with a refusal raised as what it means."""
        ok, value = await self._apply(request_id, new, allowed_from, fields, owned)
        if ok:
            return float(value)
        if value == "":
            raise UnknownRequest(f"request {request_id!r} has no record")
        raise IllegalTransition(request_id, RequestState(value), new)

    async def _apply(
        self,
        request_id: str,
        new: RequestState,
        allowed_from: list[str],
        fields: Mapping[str, Any],
        owned: tuple[list[str], list[str | int]],
    ) -> tuple[bool, str]:
        ttl = self.ttl_s if new in TERMINAL else 0
        owned_keys, owned_args = owned
        args = [
            new.value,
            ttl,
            len(allowed_from),
            *allowed_from,
            len(owned_args),
            *owned_args,
            *_pairs(fields),
        ]
        ok, value = await self._transition(keys=[self.key(request_id), *owned_keys], args=args)
        return bool(ok), str(value)

    async def end(self, request_id: str, state: RequestState, **fields: Any) -> float:
        """Move to a terminal state from whatever live state the record is in (the writer of a
        request's end uses it when writes of the states between were lost); IllegalTransition if it
        has ended already, UnknownRequest if there is no record."""
        new = RequestState(state)
        assert new in TERMINAL, f"{new} is not an end"
        return await self._move(request_id, new, [s.value for s in RequestState if s not in TERMINAL], fields)

    async def restore(self, request_id: str, state: RequestState, **fields: Any) -> bool:
        """Write a record that no longer exists (Redis restarted empty) again, in `state`, its history
        starting there and `restored` set; False if the record exists after all."""
        ttl = self.ttl_s if state in TERMINAL else 0
        args = [RequestState(state).value, ttl, *_pairs(fields)]
        return bool(await self._restore(keys=[self.key(request_id)], args=args))

    async def set_fields(self, request_id: str, **fields: Any) -> bool:
        """Update fields of an existing record without a transition (e.g. the route changed after a
        failed prefill). Returns False if there is no record."""
        pairs = _pairs(fields)
        if not pairs:
            return True
        return bool(await self._set_fields(keys=[self.key(request_id)], args=pairs))

    async def get(self, request_id: str) -> dict[str, Any] | None:
        """The record with types restored (state as RequestState, numbers as numbers), or None."""
        raw = cast(dict[str, str], await self.redis.hgetall(self.key(request_id)))
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


def _pairs(fields: Mapping[str, Any]) -> list[str | int | float]:
    """Field/value pairs for HSET, types checked against RECORD_FIELDS; None values are left out."""
    pairs: list[str | int | float] = []
    for name, value in fields.items():
        if name not in RECORD_FIELDS:
            raise ValueError(f"unknown request field {name!r}; known: {sorted(RECORD_FIELDS)}")
        if value is not None:
            pairs += [name, RECORD_FIELDS[name](value)]
    return pairs
