"""A process's writes to request records that ride out a Redis that is away.

Writes of one request land in the order they were made. A write that cannot reach Redis is kept and
retried in the background (backoff from 0.2 to 5 s) until it lands, and the request's later writes
queue behind it, so records converge once Redis is back. A transition the state machine refuses, or a
record that does not exist, is not retried: another process moved the record on first (logged). With
`restore_lost` (the router, which writes each request's end), an end whose record Redis lost — it
restarted empty — writes the record again with what this process knows of it (`RequestRecords.restore`),
and an end the state machine refuses from a live state (the states between were lost) is written from
that state (`RequestRecords.end`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.cluster.records import (
    TERMINAL,
    IllegalTransition,
    OwnedSet,
    RequestRecords,
    RequestState,
    UnknownRequest,
)
from common.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)
BACKOFF_S = (0.2, 5.0)
Write = Callable[[], Awaitable[Any]]


class RecordWriter:
    def __init__(
        self, records: RequestRecords, restore_lost: bool = False, max_pending: int = 10_000
    ) -> None:
        self.records, self.restore_lost, self.max_pending = records, restore_lost, max_pending
        self._pending: dict[str, deque[tuple[str, Write]]] = {}  # request id -> writes not landed yet
        self._created: dict[str, dict[str, Any]] = {}  # request id -> its create() fields, until its end
        self._task: asyncio.Task[None] | None = None
        self.retried = 0  # writes that waited for Redis (a metric)
        self.dropped = 0  # writes given up because too many were pending

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._pending.values())

    async def create(self, request_id: str, owned_by: OwnedSet | None = None, **fields: Any) -> None:
        """`owned_by`: the router's set the request joins with its record (RequestRecords.create)."""
        if self.restore_lost:
            self._created[request_id] = fields
        await self._write(
            request_id, "create", lambda: self.records.create(request_id, owned_by=owned_by, **fields)
        )

    async def transition(
        self, request_id: str, state: RequestState, leave: OwnedSet | None = None, **fields: Any
    ) -> None:
        """`leave`: at the end, the router's set the request leaves (RequestRecords.transition), even
        when the end is refused, restored or written from a live state."""
        end = state in TERMINAL

        async def write() -> None:
            try:
                await self.records.transition(request_id, state, leave=leave, **fields)
            except UnknownRequest:
                created = self._created.get(request_id)
                if created is None or not end:
                    raise
                log.warning("record %s was lost (Redis restarted?): writing its end again", request_id)
                await self.records.restore(request_id, state, **{**created, **fields})
            except IllegalTransition as e:
                if not (end and self.restore_lost and e.current not in TERMINAL):
                    if end:
                        self._created.pop(request_id, None)
                    raise
                # the states between were lost with Redis, or land out of order: the end is ours
                await self.records.end(request_id, state, **fields)
            if end:
                self._created.pop(request_id, None)

        await self._write(request_id, state.value, write)

    async def set_fields(self, request_id: str, **fields: Any) -> None:
        await self._write(request_id, "set_fields", lambda: self.records.set_fields(request_id, **fields))

    async def close(self, timeout_s: float = 2.0) -> None:
        """Give pending writes a last chance, then stop the retries and wait until they have stopped
        (cancel_and_wait: the retry loop cleans nothing up once cancelled, and a cancel that lands while it
        sends a command can be lost under Python 3.11; common/runtime/tasks.py)."""
        if self._task is None:
            return
        done, _ = await asyncio.wait({self._task}, timeout=timeout_s)  # waits; cancels nothing
        if not done:
            log.warning("%d record write(s) never reached Redis", self.pending)
            await cancel_and_wait(self._task)

    # --- the writing ------------------------------------------------------------------------------
    async def _write(self, request_id: str, what: str, write: Write) -> None:
        queue = self._pending.get(request_id)
        if queue is None:  # nothing of this request waits: try at once
            try:
                await self._land(request_id, what, write)
                return
            except UNREACHABLE as e:
                log.warning("record %s -> %s waits for Redis: %r", request_id, what, e)
                queue = self._pending[request_id] = deque()
        if self.pending >= self.max_pending:
            self.dropped += 1
            log.error("record %s -> %s dropped: %d writes wait already", request_id, what, self.pending)
            return
        queue.append((what, write))
        self.retried += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._retry(), name="record-writes")

    async def _land(self, request_id: str, what: str, write: Write) -> None:
        """One write; UNREACHABLE propagates (try again later), a refused one is logged and done."""
        try:
            await write()
        except (IllegalTransition, UnknownRequest) as e:
            log.debug("record %s -> %s skipped: %s", request_id, what, e)

    async def _retry(self) -> None:
        wait = BACKOFF_S[0]
        while self._pending:
            for request_id in list(self._pending):
                queue = self._pending[request_id]
                try:
                    while queue:
                        what, write = queue[0]
                        await self._land(request_id, what, write)
                        queue.popleft()
                except UNREACHABLE:
                    break
                finally:
                    if not queue:
                        del self._pending[request_id]
            if self._pending:
                await asyncio.sleep(wait)
                wait = min(2 * wait, BACKOFF_S[1])
            else:
                log.warning("record writes caught up with Redis")
