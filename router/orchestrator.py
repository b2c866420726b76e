"""One request's trip through a decode service, and a prefill service on the split path.

    split:  D /internal/generate (mode=remote) -> Reserved -> P /internal/prefill -> first token
            -> TokenFrames from D, from index 1 (token 0 reaches the router once, from P)
    local:  D /internal/generate (mode=local)  -> Reserved (no blocks to fill) -> TokenFrames

`start()` returns once the first token is known, so every failure before it (no worker, all busy,
prefill failed, deadline) is still an HTTP status, even for a streaming request. Closing the
generate stream is how the decode service learns to abort and free the request's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from opentelemetry import trace

from common.cluster.owners import RouterOwnership
from common.cluster.record_writer import RecordWriter
from common.cluster.records import OwnedSet, RequestState
from common.cluster.state import ClusterState
from common.protocol import (
    ErrorFrame,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    Reserved,
    TokenFrame,
    encode,
)
from common.runtime.telemetry import span_scope, traceparent, tracer
from common.sampling_params import SamplingParams, TokenLogprob
from router.config import RouterConfig
from router.errors import APIError
from router.metrics import RouterMetrics
from router.placement import Candidate
from router.slo import Prediction, Targets, predict_tpot_ms, predict_ttft_ms, unattainable
from router.upstream import (
    Busy,
    DecodeLost,
    DecodeStream,
    PrefillFailed,
    Unreachable,
    call_prefill,
    post_abort,
    unexpected,
)
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)
ABORT_WAIT_S = 30.0  # a service's /internal/abort answers within this once the request is gone there
_background: set[asyncio.Task[Any]] = set()
_tracer = tracer(__name__)


def _shed_event(reason: str) -> None:
    """On the request's span: it was refused for overload (503), and why."""
    trace.get_current_span().add_event("splitserve.shed", {"splitserve.reason": reason})


async def shielded(coro: Coroutine[Any, Any, None]) -> None:
    """Run cleanup to the end even when the caller is being cancelled (the client went away)."""
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    await asyncio.shield(task)


@dataclass(frozen=True)
class Route:
    path: str  # "split" | "local"
    # "long_prompt" | "short_prompt" | "cached_prefix" | "no_prefill_worker" | "prefill_failed" |
    # "shared_prefix"
    reason: str
    prefix_hit: int = 0  # leading prompt blocks the chosen decode service holds, as the KV index says
    prefill_hit: int = 0  # the same on the chosen prefill service (split path)

    @property
    def header(self) -> str:
        h = "split" if self.path == "split" else f"local; reason={self.reason}"
        if self.prefix_hit:
            h += f"; prefix_hit={self.prefix_hit} blocks"
        if self.prefill_hit:
            h += f"; prefill_prefix_hit={self.prefill_hit} blocks"
        return h

    @property
    def record(self) -> str:
        return "split" if self.path == "split" else f"local:{self.reason}"


class Orchestrator:
    """Shared by all requests of one router: worker pool, HTTP client, state store, metrics."""

    def __init__(
        self,
        config: RouterConfig,
        state: ClusterState | None,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        router_id: str,
        index: Any = None,
    ) -> None:
        """`index`: a KV index (common.cluster.kv_events.KVIndex) for prefix-aware routing; None routes on
        load alone."""
        self.config, self.state, self.client, self.metrics = config, state, client, metrics
        self.router_id = router_id
        self.pool = WorkerPool(state, config.decode_urls, config.prefill_urls, index)
        # the router writes each request's end, so it may write a record Redis lost (restart) again
        self.records = RecordWriter(state.records, restore_lost=True) if state is not None else None
        self.owners: RouterOwnership | None = None  # set by the app while it runs (with Redis)

    def route(
        self,
        prompt_tokens: int,
        prefills: list[Worker],
        shared_prefix: bool = False,
        decode_hit: Candidate | None = None,
        prefill_hit: Candidate | None = None,
    ) -> Route:
        """Split or local, and why. Conditional disaggregation weighs the prompt tokens the decode service
        would compute itself: the whole prompt, less the prefix the index says it already holds."""
        if shared_prefix:  # the decode service holds the prompt already (another choice of the request)
            return Route("local", "shared_prefix")
        hit = decode_hit.hit_blocks if decode_hit is not None else 0
        if prompt_tokens < self.config.local_prefill_threshold:
            return Route("local", "short_prompt", hit)
        if (
            decode_hit is not None
            and prompt_tokens - decode_hit.hit_tokens < self.config.local_prefill_threshold
        ):
            return Route("local", "cached_prefix", hit)
        if not prefills:
            return Route("local", "no_prefill_worker", hit)
        return Route("split", "long_prompt", hit, prefill_hit.hit_blocks if prefill_hit is not None else 0)

    def generation(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        model: str,
        owner: dict[str, str] | None = None,
    ) -> Generation:
        """`owner`: the caller's tenant and key id, kept in the request's record."""
        return Generation(self, request_id, prompt_ids, sampling, model, owner)

    def unavailable(self, message: str) -> APIError:
        return APIError(503, message, headers={"Retry-After": str(self.config.retry_after_s)})


class Generation:
    """start() once, next() until it returns None, close() always (it is idempotent)."""

    def __init__(
        self,
        orch: Orchestrator,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        model: str,
        owner: dict[str, str] | None = None,
    ) -> None:
        self.o, self.id, self.model = orch, request_id, model
        self.owner = owner or {}
        self.prompt_ids, self.sampling = prompt_ids, sampling
        self.arrival = time.time()
        self.deadline = self.arrival + orch.config.request_timeout_s
        self.route: Route | None = None  # the first placement's (what the response header says)
        self.out_ids: list[int] = []  # every output token handed out, from P or D, in order
        self.out_logprobs: list[TokenLogprob] = []  # sampling.logprobs: one per out_ids entry
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # sampling.prompt_logprobs
        self.num_cached_tokens = 0  # prompt tokens the prefilling service found in its prefix cache
        self.finish_reason: str | None = None  # D's, once its stream says finished
        self.migrations = 0
        self._lost: set[str] = set()  # decode services this request lost: never placed there again
        self._pending: list[int] = []  # tokens start() got that next() has not handed out
        self._stream: DecodeStream | None = None
        self._prefill: Worker | None = None  # set while a prefill call is in flight
        self._recorded = False
        self._closed = False
        self._traceparent: str | None = None  # the root span's, for the decode service
        # A decode service holding the prompt: another choice of the same request ran its prefill there.
        # Placed there, locally, the prompt's full blocks come from its prefix cache (shared by
        # reference); only the last partial block is computed again. If it is full, placed as any.
        self.affinity: str | None = None
        self.decode_id: str | None = None  # the decode service of the first placement
        self._scored: dict[tuple[str, str], Candidate] = {}  # (role, worker id) -> its placement figures
        # the first placement's prefix-cache reuse (tokens), as the services reported it
        self.decode_reused_tokens = self.prefill_reused_tokens = 0
        self.prefill_id: str | None = None
        self.tenant = ""  # whose request, for the services' fair-share admission
        self.targets = Targets()  # its latency targets (router/slo.py), if it has any
        self._slo_local = False  # SLO admission chose the local path: only it was predicted in time
        self.priority = 0  # its class inside the tenant (lower first)

    # ---- the flow --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Pick workers and place the request; returns once its first token is known, so that every
        failure before it (no worker, all busy, deadline) is still an HTTP status."""
        self._traceparent = traceparent()
        with span_scope(_tracer, "router.route") as span:
            decodes, prefills = await self._workers()
            decodes = self._with_affinity(decodes)
            self.route = self._route(decodes, prefills)
            if span.is_recording():
                span.set_attributes({
                    "splitserve.route": self.route.path,
                    "splitserve.route.reason": self.route.reason,
                    "splitserve.decode_candidates": len(decodes),
                    "splitserve.prefill_candidates": len(prefills),
                    "splitserve.prefix_hit_blocks": self.route.prefix_hit,
                    "splitserve.prefill_prefix_hit_blocks": self.route.prefill_hit,
                })  # fmt: skip
        decodes = self._shed_if_overloaded(decodes)
        if self.targets.any:
            decodes, prefills = self._meet_targets(decodes, prefills)
        self.o.metrics.routes.labels(self.route.path, self.route.reason).inc()
        await self._create_record()
        self._pending = await self._place_in_time(decodes, prefills)
        self._count_prefix()

    def _count_prefix(self) -> None:
        """Prefix-cache figures of the first placement, per role: the prompt's full blocks, how many of
        them the KV index said the chosen worker held, and how many it really reused."""
        route, m = self.route, self.o.metrics
        for role, worker_id, predicted, reused in (
            ("decode", self.decode_id, route.prefix_hit if route else 0, self.decode_reused_tokens),
            ("prefill", self.prefill_id, route.prefill_hit if route else 0, self.prefill_reused_tokens),
        ):
            c = self._scored.get((role, worker_id or ""))
            if c is None or not c.block_size:
                continue  # not placed there, or routed on load alone
            m.prefix_blocks.labels(role, "prompt").inc(len(self.prompt_ids) // c.block_size)
            m.prefix_blocks.labels(role, "predicted_hit").inc(predicted)
            m.prefix_blocks.labels(role, "reused").inc(reused // c.block_size)

    async def next(self) -> list[int] | None:
        """New output tokens, or None once the decode service has finished the request. A decode
        service that fails meanwhile is replaced (`_migrate`) without the caller noticing."""
        while True:
            if self._pending:
                out, self._pending = self._pending, []
                return out
            if self.finish_reason is not None:
                return None
            try:
                return await self._read_tokens(stall_s=self.o.config.decode_stall_s)
            except DecodeLost as e:
                await self._lose_decode(e)
                self._pending = await self._place()

    async def _workers(self) -> tuple[list[Worker], list[Worker]]:
        """Decode and prefill candidates, best first, without the decode services this request lost."""
        n = len(self.prompt_ids) + len(self.out_ids)
        try:
            decodes = [w for w in await self.o.pool.candidates("decode") if w.id not in self._lost]
            wants_prefill = n >= self.o.config.local_prefill_threshold and decodes
            prefills = await self.o.pool.candidates("prefill") if wants_prefill else []
        except Exception as e:  # the registry (Redis) is down: nothing can be routed
            log.exception("worker registry lookup failed")
            raise self.o.unavailable(f"worker registry unavailable: {e!r}") from e
        if not decodes:
            raise self.o.unavailable("no decode service is available")
        if self.o.config.routing == "prefix_aware":
            ids = self.prompt_ids + self.out_ids
            decodes, prefills = self._rank("decode", decodes, ids), self._rank("prefill", prefills, ids)
        return decodes, prefills

    def _rank(self, role: str, workers: list[Worker], ids: list[int]) -> list[Worker]:
        """`workers` cheapest first for this prompt (router/placement.py); remembers each one's figures."""
        cfg = self.o.config
        ranked = self.o.pool.rank(workers, ids, cfg.prefix_weight, cfg.load_weight)
        self._scored.update({(role, c.worker.id): c for c in ranked})
        return [c.worker for c in ranked]

    def _route(self, decodes: list[Worker], prefills: list[Worker]) -> Route:
        """The route for placing on decodes[0] (through prefills[0] on the split path)."""
        d = self._scored.get(("decode", decodes[0].id)) if decodes else None
        p = self._scored.get(("prefill", prefills[0].id)) if prefills else None
        n = len(self.prompt_ids) + len(self.out_ids)
        if self._slo_local and not self.out_ids:
            return Route("local", "slo", d.hit_blocks if d is not None else 0)
        return self.o.route(n, prefills, self._shared(decodes), d, p)

    def _meet_targets(
        self, decodes: list[Worker], prefills: list[Worker]
    ) -> tuple[list[Worker], list[Worker]]:
        """SLO-aware admission (router/slo.py): the first placement, in placement order, predicted to meet
        the request's targets — its decode and prefill services first in the lists, and the local path
        when only that meets them; 429 when none does."""
        best: Prediction | None = None
        for d in decodes[:3]:
            route, tpot = self._route([d], prefills), predict_tpot_ms(d.load)
            options = [
                (p, Prediction(predict_ttft_ms(p.load, self._uncached("prefill", p), False), tpot))
                for p in (prefills[:2] if route.path == "split" else [])
            ]
            local = Prediction(predict_ttft_ms(d.load, self._uncached("decode", d), True), tpot)
            for p, pred in [*options, (None, local)]:
                if pred.meets(self.targets):
                    self._slo_local = p is None and route.path == "split"  # prefill services too slow
                    first = [p] if p is not None else []
                    prefills = first + [w for w in prefills if w is not p]
                    self.route = self._route([d], prefills)
                    return [d, *(w for w in decodes if w is not d)], prefills
                if best is None or (pred.ttft_ms or 0.0) < (best.ttft_ms or 0.0):
                    best = pred
        _shed_event("slo")
        self.o.metrics.shed.labels("slo").inc()
        raise unattainable(self.targets, best or Prediction(None, None))

    def _uncached(self, role: str, w: Worker) -> int:
        """Prompt tokens `w` would compute: all of them less the prefix the index says it holds."""
        c = self._scored.get((role, w.id))
        return len(self.prompt_ids) + len(self.out_ids) - (c.hit_tokens if c is not None else 0)

    def _shed_if_overloaded(self, decodes: list[Worker]) -> list[Worker]:
        """503 before any work when every decode service is past max_decode_queue, or (start_timeout_s)
        when every one's queue has held a request longer than this one may wait to start: a queue
        that old will not reach it in time. Otherwise the decode services it may go to, best first
        (with start_timeout_s, those whose queue is younger than that)."""
        limit, start_s = self.o.config.max_decode_queue, self.o.config.start_timeout_s
        if limit is not None and all(int(w.load.get("waiting", 0)) >= limit for w in decodes):
            _shed_event("queue_depth")
            self.o.metrics.shed.labels("queue_depth").inc()
            raise self.o.unavailable(f"every decode service has {limit}+ requests waiting; retry later")
        if start_s is None:
            return decodes
        in_time = [w for w in decodes if float(w.load.get("queue_wait_s", 0)) < start_s]
        if not in_time:
            _shed_event("queue_wait")
            self.o.metrics.shed.labels("queue_wait").inc()
            raise self.o.unavailable(
                f"every decode queue has kept a request waiting {start_s:g}+ s; this one could not start "
                "in time; retry later"
            )
        return in_time

    async def _place_in_time(self, decodes: list[Worker], prefills: list[Worker]) -> list[int]:
        """_place, bounded by start_timeout_s when set: a request still without its first token then
        gets a retryable 503 (close() frees what it holds) instead of a wait the client gave up on."""
        start_s = self.o.config.start_timeout_s
        if start_s is None:
            return await self._place(decodes, prefills)
        timeout = asyncio.timeout(start_s - (time.time() - self.arrival))
        try:
            async with timeout:
                return await self._place(decodes, prefills)
        except TimeoutError:
            if not timeout.expired():
                raise
            _shed_event("start_timeout")
            self.o.metrics.shed.labels("start_timeout").inc()
            message = f"the request could not start within {start_s:g} s; retry later"
            raise self.o.unavailable(message) from None

    async def _place(
        self, decodes: list[Worker] | None = None, prefills: list[Worker] | None = None
    ) -> list[int]:
        """Put the request — its prompt and any output already handed out — on a decode service, through
        a prefill service on the split path; its next tokens (after a migration they continue at the
        output index the client has reached). A decode service lost on the way is replaced."""
        while True:
            if decodes is None or prefills is None:
                decodes, prefills = await self._workers()
            try:
                return await self._place_on(decodes, prefills)
            except DecodeLost as e:
                await self._lose_decode(e)
                decodes = prefills = None

    def _with_affinity(self, decodes: list[Worker]) -> list[Worker]:
        """The decode service holding the prompt first, if it is a candidate."""
        if self.affinity is None:
            return decodes
        return sorted(decodes, key=lambda w: w.id != self.affinity)  # stable: the rest keep their order

    def _shared(self, decodes: list[Worker]) -> bool:
        return bool(decodes) and decodes[0].id == self.affinity and not self.out_ids

    async def _place_on(self, decodes: list[Worker], prefills: list[Worker]) -> list[int]:
        decodes = self._with_affinity(decodes)
        route = self._route(decodes, prefills)
        if route.reason == "shared_prefix":
            try:
                return await self._place_local(decodes[:1])
            except APIError as e:
                if e.status != 503:
                    raise
            # that service is full: placed as any request (the header and the record say how)
            self.affinity = None
            route = self._route(decodes, prefills)
            self.route = route
            await self._record_route()
        if route.path == "local":
            return await self._place_local(decodes)
        policy = self.o.config.transfer_failure_policy
        tries = prefills[:2] if policy == "retry" else prefills[:1]  # retry: once, on another prefill worker
        for attempt, prefill in enumerate(tries):
            reserved = await self._open_decode(decodes, "remote")
            try:
                first = await self._run_prefill(prefill, reserved)
            except PrefillFailed as e:
                await self._abort(prefill)
                # Drop the reservation: a late write from the failed worker then meets a stale fence.
                # Wait until it is gone: the request (same id) is placed on a decode service again next,
                # maybe this one, which refuses an id it is still tearing down (409).
                if self._stream is not None:
                    await self._abort(self._stream.worker, until_gone=True)
                await self._close_decode()
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
                if policy == "retry" and attempt < len(tries) - 1:
                    self.o.metrics.transfer_failures.labels(policy, "retried").inc()
                    self.o.metrics.prefill_retries.inc()
                    continue
                if policy == "fail":
                    self.o.metrics.transfer_failures.labels(policy, "failed").inc()
                    raise APIError(502, f"prefill failed: {e}", code="prefill_failed") from e
                # recompute, or retry with no other prefill service left: the decode service prefills
                self.o.metrics.transfer_failures.labels(policy, "recomputed").inc()
                if not self.out_ids:  # not yet answered: the header and the record say so
                    self.route = Route("local", "prefill_failed")
                    await self._record_route()
                return await self._place_local(decodes)
            self._take_prompt_logprobs(first.prompt_logprobs)
            if not self.out_ids:
                self.num_cached_tokens = first.num_cached_tokens
                self.prefill_id, self.prefill_reused_tokens = prefill.id, first.num_cached_tokens
            lps = [first.first_logprob] if first.first_logprob is not None else None
            return self._accept(len(self.out_ids), [first.first_token], lps)
        raise AssertionError("a split route needs a prefill service")

    async def _place_local(self, decodes: list[Worker]) -> list[int]:
        reserved = await self._open_decode(decodes, "local")
        if not self.out_ids:
            self.num_cached_tokens = reserved.num_cached_tokens
        tokens = await self._read_tokens()  # no stall limit: the first tokens wait for a whole prefill
        return tokens or []

    async def _lose_decode(self, e: DecodeLost) -> None:
        """The decode service failed this request: leave it (it is never tried again for this request)
        and count a migration, or give up past max_migrations."""
        stream, prefill = self._stream, self._prefill
        old = stream.worker if stream is not None else e.worker  # lost before its Reserved frame: e's
        if old is not None:
            self._lost.add(old.id)
            self._spawn_abort(old)  # a frozen service may still come back: it frees what it held
        if stream is not None:
            await self._close_decode()
        if prefill is not None:
            # The request is placed again next, maybe through this prefill service, which refuses an
            # id it is still working on (409, then tried as a failed prefill): give it 2 s to let go.
            await self._abort(prefill)
        if self.migrations >= self.o.config.max_migrations:
            self.o.metrics.migrations.labels("gave_up").inc()
            raise APIError(502, f"{e.message}; gave up after {self.migrations} migration(s)")
        self.migrations += 1
        self.o.metrics.migrations.labels("stalled" if e.stalled else "lost").inc()
        log.warning("request %s: migrating off %s after %d tokens: %s", self.id, old and old.id,
                    len(self.out_ids), e.message)  # fmt: skip
        trace.get_current_span().add_event(
            "splitserve.migration", {"splitserve.from": old.id if old else "", "splitserve.reason": e.message}
        )
        await self._record(
            RequestState.MIGRATING, migrations=self.migrations, migrated_from=old.id if old else None,
            migration_reason=e.message,
        )  # fmt: skip

    def _spawn_abort(self, w: Worker) -> None:
        task = asyncio.ensure_future(post_abort(self.o.client, w, self.id))
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def close(
        self, outcome: str, finish_reason: str | None = None, output_tokens: int = 0, error: str | None = None
    ) -> None:
        """End the request: stop upstream work, free workers, record the terminal state.

        outcome is "finished", "failed" or "cancelled".
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._prefill is not None:
                await self._abort(self._prefill)
            await self._close_decode()
        finally:
            state = {"finished": RequestState.FINISHED, "failed": RequestState.FAILED}.get(
                outcome, RequestState.CANCELLED
            )
            # it leaves this router's owned set in the same write
            owned = self.o.owners.owned_set if self.o.owners is not None else None
            await self._record(
                state, leave=owned, finish_reason=finish_reason, output_tokens=output_tokens, error=error
            )

    # ---- decode service --------------------------------------------------------------------------

    async def _open_decode(self, decodes: list[Worker], mode: Literal["remote", "local"]) -> Reserved:
        """Open a generate stream on the least loaded D that accepts it; returns its Reserved frame."""
        ids, n_out = self.prompt_ids + self.out_ids, len(self.out_ids)
        body = encode(
            GenerateRequest(
                self.id, ids, self._sampling(), mode, self.deadline, self._traceparent, n_out,
                tenant=self.tenant, priority=self.priority,
            )
        )  # fmt: skip
        with span_scope(_tracer, "router.decode_reserve") as span:
            try:
                self._stream, reserved = await DecodeStream.open(self.o.client, decodes, body, self.deadline)
                if self.decode_id is None:
                    self.decode_id, self.decode_reused_tokens = (
                        self._stream.worker.id,
                        reserved.num_cached_tokens,
                    )
            except Busy:
                raise self.o.unavailable("every decode service is at capacity; retry later") from None
            except Unreachable as e:
                raise self.o.unavailable(f"no decode service could be reached ({e})") from None
            if span.is_recording():
                span.set_attributes({
                    "splitserve.mode": mode,
                    "splitserve.decode_id": self._stream.worker.id,
                    "splitserve.blocks": len(reserved.block_ids),
                    "splitserve.num_cached_tokens": reserved.num_cached_tokens,
                })  # fmt: skip
        self.o.pool.hold(self._stream.worker)
        return reserved

    async def _read_tokens(self, stall_s: float | None = None) -> list[int] | None:
        """Tokens from the next TokenFrame(s) that bring anything new; None when D has finished.
        DecodeLost if the stream breaks, or (with stall_s) brings nothing for that long."""
        assert self._stream is not None, "no decode stream open"
        while True:
            frame = await self._stream.next_frame(stall_s)
            if not isinstance(frame, TokenFrame):
                raise unexpected(frame, "tokens")
            self._take_prompt_logprobs(frame.prompt_logprobs)
            new = self._accept(frame.index, frame.token_ids, frame.logprobs)
            if frame.finished:
                if frame.finish_reason not in ("stop", "length"):
                    raise APIError(502, f"decode service ended the request ({frame.finish_reason})")
                self.finish_reason = frame.finish_reason
            if new:
                return new
            if frame.finished:
                return None

    def _accept(
        self, index: int, token_ids: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> list[int]:
        """Every output token arrives once, in order (token 0 from P on the split path): a frame that
        does not continue exactly where we are is the decode service's bug, never shown to a client.
        Logprobs, when the request asked, come with every token."""
        if index != len(self.out_ids):
            want = len(self.out_ids)
            raise APIError(502, f"decode stream out of order (frame index {index}, expected {want})")
        if self.sampling.logprobs is not None and token_ids:
            if logprobs is None or len(logprobs) != len(token_ids):
                raise APIError(502, "a service sent tokens without the logprobs the request asked for")
            self.out_logprobs += logprobs
        self.out_ids += token_ids
        return list(token_ids)

    def _sampling(self) -> SamplingParams:
        """The request's sampling for its next placement: the prompt is scored once (a request placed
        again after a migration or a failed prefill that already has the scores does not ask again)."""
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is not None:
            return self.sampling.replace(prompt_logprobs=None)
        return self.sampling

    def _take_prompt_logprobs(self, lps: list[TokenLogprob | None] | None) -> None:
        if lps is not None and self.prompt_logprobs is None:
            if len(lps) != len(self.prompt_ids):
                n = len(self.prompt_ids)
                raise APIError(502, f"prompt logprobs for {len(lps)} tokens; the prompt has {n}")
            self.prompt_logprobs = lps

    async def _close_decode(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                await stream.aclose()
            finally:
                self.o.pool.release(stream.worker)

    # ---- prefill service -------------------------------------------------------------------------

    async def _run_prefill(self, w: Worker, r: Reserved) -> PrefillResult:
        """Send the prompt to P, which writes its KV into r.block_ids on D; returns P's answer (the
        first token)."""
        # P records PREFILLING and TRANSFERRING itself, D records RESERVED and DECODING: the router
        # writes only QUEUED and the end, keeping Redis round trips off the path to the first token.
        self._prefill = w  # from here until it answers, a cancelled request must abort it on P
        self.o.pool.hold(w)
        try:
            with span_scope(_tracer, "router.prefill", attributes={"splitserve.prefill_id": w.id}):
                ids = self.prompt_ids + self.out_ids
                req = PrefillRequest(
                    self.id, ids, self._sampling(), r.kv_endpoint, r.block_ids, r.fence, r.num_cached_tokens,
                    self.deadline, traceparent(), len(self.out_ids),
                    tenant=self.tenant, priority=self.priority,
                )  # fmt: skip
                first = await self._prefill_or_decode_error(call_prefill(self.o.client, w, req))
        finally:
            self.o.pool.release(w)
        self._prefill = None
        return first

    async def _prefill_or_decode_error(self, call: Coroutine[Any, Any, PrefillResult]) -> PrefillResult:
        """Await the prefill call, but give up on it if the decode stream ends the reservation first
        (its lease watch saw the prefill service die or hang): that is a prefill failure too, and
        goes through the transfer-failure policy instead of waiting for the deadline."""
        assert self._stream is not None
        prefill = asyncio.ensure_future(call)
        frame: asyncio.Future[Any] | None = None
        try:
            while True:
                frame = asyncio.ensure_future(self._stream.next_frame())
                done, _ = await asyncio.wait({prefill, frame}, return_when=asyncio.FIRST_COMPLETED)
                if prefill in done:
                    if frame.done() and not frame.cancelled() and frame.exception() is None:
                        self._stream.push_back(frame.result())  # both ended at once: keep the frame
                    return prefill.result()
                got = frame.result()
                if isinstance(got, ErrorFrame):
                    raise PrefillFailed(f"the decode service ended the reservation: {got.error}")
                self._stream.push_back(got)  # D already has the KV and streams tokens: P will answer
                return await prefill
        finally:  # however this ends (cancelled too), nothing is left running behind it
            for fut in (prefill, frame):
                if fut is not None and not fut.done():
                    fut.cancel()

    async def _abort(self, w: Worker, until_gone: bool = False) -> None:
        """Abort the request on `w`; with until_gone, wait as long as the service takes to let go of it
        (a loaded engine thread needs more than the default 2 s), up to the request's deadline."""
        if w is self._prefill:
            self._prefill = None
        timeout_s = max(2.0, min(ABORT_WAIT_S, self.deadline - time.time())) if until_gone else 2.0
        await post_abort(self.o.client, w, self.id, timeout_s)

    # ---- records ---------------------------------------------------------------------------------

    async def _create_record(self) -> None:
        if self.o.records is None or self.route is None:
            return
        # with the record, the request joins this router's owned set: ended by another router if this
        # one dies first (one script, one round trip)
        owned = self.o.owners.owned_set if self.o.owners is not None else None
        try:
            await self.o.records.create(
                self.id, owned_by=owned, model=self.model, prompt_tokens=len(self.prompt_ids),
                router_id=self.o.router_id, route=self.route.record, prefix_hit_blocks=self.route.prefix_hit,
                prefill_prefix_hit_blocks=self.route.prefill_hit, **self.owner,
            )  # fmt: skip
            self._recorded = True
        except Exception:
            self.o.metrics.state_errors.inc()
            log.exception("request %s: could not create its record", self.id)

    async def _record_route(self) -> None:
        if self.o.records is None or not self._recorded or self.route is None:
            return
        try:
            route = self.route
            await self.o.records.set_fields(
                self.id, route=route.record, prefix_hit_blocks=route.prefix_hit,
                prefill_prefix_hit_blocks=route.prefill_hit,
            )  # fmt: skip
        except Exception:
            log.exception("request %s: could not record the route", self.id)

    async def _record(self, new: RequestState, leave: OwnedSet | None = None, **fields: Any) -> None:
        """A transition of the router's (MIGRATING, the end; `leave`: see RecordWriter.transition); one
        that Redis cannot take now is retried by the record writer until it lands."""
        if self.o.records is None or not self._recorded:
            return
        try:
            await self.o.records.transition(self.id, new, leave=leave, **fields)
        except Exception:
            self.o.metrics.state_errors.inc()
            log.exception("request %s: could not record %s", self.id, new.name)
