"""Phase 5: one request's trip through a decode service, and a prefill service on the split path.

    split:  D /internal/generate (mode=remote) -> Reserved -> P /internal/prefill -> first token
            -> TokenFrames from D, from index 1 (token 0 reaches the router once, from P)
    local:  D /internal/generate (mode=local)  -> Reserved (no blocks to fill) -> TokenFrames

`start()` returns once the first token is known, so every failure before it (all busy, prefill failed,
deadline) is still an HTTP status, even for a streaming request. A prefill that fails goes through the
transfer-failure policy (retry on another prefill service, recompute on the decode service, or fail).
A decode service that fails (its stream breaks, ends early or stalls) is left for another: the request
is placed again with its prompt and the tokens already handed out (a migration), and `next()` goes on
as if nothing happened. Closing the generate stream is how the decode service learns to abort and free
the request's blocks (`close()`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry import trace

from common.runtime.telemetry import traceparent
from router.admission import shed_event
from router.errors import APIError, unavailable
from router.legs import Legs, cache_salt
from router.orchestrator import Orchestrator
from router.output import Output
from router.parse import Parsed
from router.placement import Placement, Placer, Route
from router.record import RequestRecord
from router.upstream import DecodeLost, PrefillFailed
from router.workers import Worker

log = logging.getLogger(__name__)


class Trip:
    """start() once, next() until it returns None, close() always (it is idempotent)."""

    def __init__(self, orch: Orchestrator, request_id: str, parsed: Parsed, record: RequestRecord) -> None:
        self.id, self.config, self.metrics, self.record = request_id, orch.config, orch.metrics, record
        self.output = Output(parsed.prompt_ids, parsed.sampling)
        salt = cache_salt(orch.config, parsed.tenant)
        self.placer = Placer(orch.pool, orch.config, self.output, salt, parsed.model)
        self.arrival = time.time()
        deadline = self.arrival + orch.config.request_timeout_s
        self.legs = Legs(orch, request_id, self.output, deadline, parsed.tenant, parsed.priority)
        self.migrations = 0
        self._pending: list[int] = []  # tokens start() got that next() has not handed out
        self._closed = False

    @property
    def route(self) -> Route | None:
        """The first placement's route (what the response header and the record say)."""
        return self.placer.route

    @property
    def decode_id(self) -> str | None:
        """The decode service of the first placement."""
        return self.legs.first.decode_id

    async def start(self, placement: Placement) -> None:
        """Place the request where `placement` says; returns once its first token is known."""
        self.legs.traceparent = traceparent()  # the request's span, for the services' spans
        self._pending = await self._place_in_time(list(placement.decodes), list(placement.prefills))
        self._count_prefix()

    async def next(self) -> list[int] | None:
        """New output tokens, or None once the decode service has finished the request. A decode
        service that fails meanwhile is replaced (`_migrate`) without the caller noticing."""
        while True:
            if self._pending:
                out, self._pending = self._pending, []
                return out
            if self.output.finish_reason is not None:
                return None
            try:
                return await self.legs.read_tokens(stall_s=self.config.decode_stall_s)
            except DecodeLost as e:
                await self._migrate(e)
                self._pending = await self._place()

    async def close(self) -> None:
        """Stop upstream work and free the workers (the record's end is the caller's)."""
        if self._closed:
            return
        self._closed = True
        await self.legs.close()

    # ---- placing -----------------------------------------------------------------------------------

    async def _place_in_time(self, decodes: list[Worker], prefills: list[Worker]) -> list[int]:
        """_place, bounded by start_timeout_s when set: a request still without its first token then
        gets a retryable 503 (close() frees what it holds) instead of a wait the client gave up on."""
        start_s = self.config.start_timeout_s
        if start_s is None:
            return await self._place(decodes, prefills)
        timeout = asyncio.timeout(start_s - (time.time() - self.arrival))
        try:
            async with timeout:
                return await self._place(decodes, prefills)
        except TimeoutError:
            if not timeout.expired():
                raise
            shed_event("start_timeout")
            self.metrics.shed.labels("start_timeout").inc()
            message = f"the request could not start within {start_s:g} s; retry later"
            raise unavailable(message, self.config.retry_after_s) from None

    async def _place(
        self, decodes: list[Worker] | None = None, prefills: list[Worker] | None = None
    ) -> list[int]:
        """Put the request — its prompt and any output already handed out — on a decode service, through
        a prefill service on the split path; its next tokens (after a migration they continue at the
        output index the client has reached). A decode service lost on the way is replaced."""
        while True:
            if decodes is None or prefills is None:
                decodes, prefills = await self.placer.candidates()
            try:
                return await self._place_on(decodes, prefills)
            except DecodeLost as e:
                await self._migrate(e)
                decodes = prefills = None

    async def _place_on(self, decodes: list[Worker], prefills: list[Worker]) -> list[int]:
        placer = self.placer
        decodes = placer.with_affinity(decodes)
        route = placer.route_for(decodes, prefills)
        if route.reason == "shared_prefix":
            try:
                return await self._place_local(decodes[:1])
            except APIError as e:
                if e.status != 503:
                    raise
            # that service is full: placed as any request (the header and the record say how)
            placer.affinity = None
            placer.route = route = placer.route_for(decodes, prefills)
            await self.record.route_changed(route)
        if route.path == "local":
            return await self._place_local(decodes)
        policy = self.config.transfer_failure_policy
        tries = prefills[:2] if policy == "retry" else prefills[:1]  # retry: once, on another prefill worker
        for attempt, prefill in enumerate(tries):
            reserved = await self.legs.open_decode(decodes, "remote")
            try:
                result = await self.legs.prefill(prefill, reserved)
            except PrefillFailed as e:
                if e.unreachable:  # gone, or going: not a candidate again until it heartbeats
                    placer.pool.suspect(prefill)
                await self.legs.drop_reservation(prefill)
                log.warning(
                    "request %s: prefill on %s failed (%s); policy %s", self.id, prefill.id, e, policy
                )
                retry = policy == "retry" and attempt < len(tries) - 1
                outcome = "retried" if retry else "failed" if policy == "fail" else "recomputed"
                trace.get_current_span().add_event(
                    "splitserve.prefill_failed",
                    {"splitserve.prefill_id": prefill.id, "splitserve.error": str(e),
                     "splitserve.policy": policy, "splitserve.outcome": outcome},
                )  # fmt: skip
                if retry:
                    self.metrics.transfer_failures.labels(policy, "retried").inc()
                    self.metrics.prefill_retries.inc()
                    continue
                if policy == "fail":  # which service and why: the log line above, not the client's
                    self.metrics.transfer_failures.labels(policy, "failed").inc()
                    message = "prefill failed; the request was not served"
                    raise APIError(502, message, code="prefill_failed", detail=f"{prefill.id}: {e}") from e
                # recompute, or retry with no other prefill service left: the decode service prefills
                self.metrics.transfer_failures.labels(policy, "recomputed").inc()
                if not self.output.ids:  # not yet answered: the header and the record say so
                    placer.route = Route("local", "prefill_failed")
                    await self.record.route_changed(placer.route)
                return await self._place_local(decodes)
            out, first = self.output, self.legs.first
            out.take_prompt_logprobs(result.prompt_logprobs)
            if not out.ids:
                out.num_cached_tokens = result.num_cached_tokens
                first.prefill_id, first.prefill_reused_tokens = prefill.id, result.num_cached_tokens
            lps = [result.first_logprob] if result.first_logprob is not None else None
            return out.accept(len(out.ids), [result.first_token], lps)
        raise AssertionError("a split route needs a prefill service")

    async def _place_local(self, decodes: list[Worker]) -> list[int]:
        reserved = await self.legs.open_decode(decodes, "local")
        if not self.output.ids:
            self.output.num_cached_tokens = reserved.num_cached_tokens
        tokens = await self.legs.read_tokens()  # no stall limit: the first tokens wait for a whole prefill
        return tokens or []

    async def _migrate(self, e: DecodeLost) -> None:
        """The decode service failed this request: leave it (it is never tried again for this request)
        and count a migration, or give up past max_migrations. The caller places the request again."""
        old = await self.legs.lose_decode(e)
        if old is not None:
            self.placer.lost.add(old.id)
        if self.migrations >= self.config.max_migrations:
            self.metrics.migrations.labels("gave_up").inc()
            message = f"{e.message}; gave up after {self.migrations} migration(s)"
            raise APIError(502, message, detail=e.detail)
        self.migrations += 1
        self.metrics.migrations.labels("stalled" if e.stalled else "lost").inc()
        log.warning("request %s: migrating off %s after %d tokens: %s", self.id, old and old.id,
                    len(self.output.ids), e.detail or e.message)  # fmt: skip
        trace.get_current_span().add_event(
            "splitserve.migration",
            {"splitserve.from": old.id if old else "", "splitserve.reason": e.detail or e.message},
        )
        # the record is the key holder's to read: the generic reason (the detail is the log's)
        await self.record.migrating(self.migrations, old.id if old else None, e.message)

    def _count_prefix(self) -> None:
        """Prefix-cache figures of the first placement, per role: the prompt's full blocks, how many of
        them the KV index said the chosen worker held, and how many it really reused."""
        route, m, first = self.route, self.metrics, self.legs.first
        for role, worker_id, predicted, reused in (
            ("decode", first.decode_id, route.prefix_hit if route else 0, first.decode_reused_tokens),
            ("prefill", first.prefill_id, route.prefill_hit if route else 0, first.prefill_reused_tokens),
        ):
            c = self.placer.scored.get((role, worker_id or ""))
            if c is None or not c.block_size:
                continue  # not placed there, or routed on load alone
            m.prefix_blocks.labels(role, "prompt").inc(len(self.output.prompt_ids) // c.block_size)
            m.prefix_blocks.labels(role, "predicted_hit").inc(predicted)
            m.prefix_blocks.labels(role, "reused").inc(reused // c.block_size)
