"""Phase 4: the request's record in Redis (`req:{id}`, common/cluster/records.py).

The router writes the record's start (QUEUED, with the route, the prefix hits and the caller's tenant
and key id), a route that changed on the way, each migration, and the end (FINISHED, FAILED or
CANCELLED). The services write the states in between (RESERVED, PREFILLING, TRANSFERRING, DECODING),
keeping Redis round trips off the path to the first token. With the record the request joins this
router's owned set, and leaves it with the end: a router that dies has its live requests ended by
another (common/cluster/owners.py). Without Redis there is no record and nothing here writes; a write
Redis refuses is logged and counted (the record writer retries the router's transitions until they
land), never the request's failure."""

from __future__ import annotations

import logging
from typing import Any

from common.cluster.records import OwnedSet, RequestState
from router.orchestrator import Orchestrator
from router.placement import Route

log = logging.getLogger(__name__)
_END_STATES = {"finished": RequestState.FINISHED, "failed": RequestState.FAILED}


class RequestRecord:
    def __init__(
        self, orch: Orchestrator, request_id: str, model: str, prompt_tokens: int, owner: dict[str, str]
    ) -> None:
        """`owner`: the caller's tenant and key id (none without a key), kept in the record."""
        self.writer, self.metrics, self.router_id = orch.records, orch.metrics, orch.router_id
        self.id, self.model, self.prompt_tokens, self.owner = request_id, model, prompt_tokens, owner
        self._orch = orch
        self._created = False

    @property
    def _owned(self) -> OwnedSet | None:
        """This router's owned set (None without Redis)."""
        owners = self._orch.owners
        return owners.owned_set if owners is not None else None

    async def create(self, route: Route) -> None:
        """QUEUED, with the route. The request joins this router's owned set in the same write (one
        script, one round trip)."""
        if self.writer is None:
            return
        try:
            await self.writer.create(
                self.id, owned_by=self._owned, model=self.model, prompt_tokens=self.prompt_tokens,
                router_id=self.router_id, route=route.record, prefix_hit_blocks=route.prefix_hit,
                prefill_prefix_hit_blocks=route.prefill_hit, **self.owner,
            )  # fmt: skip
            self._created = True
        except Exception:
            self.metrics.state_errors.inc()
            log.exception("request %s: could not create its record", self.id)

    async def route_changed(self, route: Route) -> None:
        if self.writer is None or not self._created:
            return
        try:
            await self.writer.set_fields(
                self.id, route=route.record, prefix_hit_blocks=route.prefix_hit,
                prefill_prefix_hit_blocks=route.prefill_hit,
            )  # fmt: skip
        except Exception:
            log.exception("request %s: could not record the route", self.id)

    async def migrating(self, migrations: int, old: str | None, reason: str) -> None:
        await self._transition(
            RequestState.MIGRATING, migrations=migrations, migrated_from=old, migration_reason=reason
        )

    async def end(
        self, outcome: str, finish_reason: str | None, output_tokens: int, error: str | None
    ) -> None:
        """The terminal state for `outcome` ("finished", "failed" or "cancelled"); the request leaves this
        router's owned set in the same write."""
        state = _END_STATES.get(outcome, RequestState.CANCELLED)
        await self._transition(
            state, leave=self._owned, finish_reason=finish_reason, output_tokens=output_tokens, error=error
        )

    async def _transition(self, new: RequestState, leave: OwnedSet | None = None, **fields: Any) -> None:
        """A transition of the router's (`leave`: see RecordWriter.transition); one that Redis cannot take
        now is retried by the record writer until it lands."""
        if self.writer is None or not self._created:
            return
        try:
            await self.writer.transition(self.id, new, leave=leave, **fields)
        except Exception:
            self.metrics.state_errors.inc()
            log.exception("request %s: could not record %s", self.id, new.name)
