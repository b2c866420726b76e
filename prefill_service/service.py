"""The prefill service: batches prompts from many requests under a token budget (chunked), reuses cached
prefixes, samples each prompt's first token, and writes the prompt's KV into the decode service's
reserved blocks layer by layer, as soon as each layer is computed.

One /internal/prefill call is one Job. The transfer itself (destination, fence, lease, the writes in
flight) is an OutgoingKV of the KV connector, which the engine thread asks for each step's block
ranges and hands every computed layer to. The call is answered once kv_done is delivered; the request's
blocks are freed right after, in the background, once no write reads them any more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from fastapi import Response
from opentelemetry.trace import SpanKind

from common.cluster.records import RequestState
from common.config import EngineConfig, ServiceConfig
from common.connector.prefill import PrefillConnector
from common.connector.remote_kv import OutgoingKV, TransferState
from common.engine.api import AddRequest, Admission, Finish, TokenOutput
from common.engine.llm_engine import LLMEngine, fault
from common.parallel.plan import split_endpoints
from common.protocol import PrefillRequest, PrefillResult
from common.runtime.telemetry import context_from, span_ctx, tracer
from common.service.base import (
    HANDED_BACK,
    Interrupt,
    Job,
    Service,
    engine_for,
    error_response,
    msgpack_response,
)
from common.service.metrics import TransportCount
from kv_transfer import KVSender, SenderStats, TransferError, make_sender, resolve_backend
from kv_transfer.ranks import RankTransfer
from prefill_service.spans import compute_spans, fail, transfer_done

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


class Interrupted(Exception):
    def __init__(self, ev: Interrupt) -> None:
        super().__init__(ev.error)
        self.code = ev.code


class EngineFault(Exception):
    """The engine failed on this request (and goes on serving the others)."""


class PrefillService(Service):
    def __init__(self, cfg: ServiceConfig, engine_cfg: EngineConfig, reuse: LLMEngine | None = None) -> None:
        self.connector = PrefillConnector(self.sender_for, self._on_failed)
        # tensor parallelism: rank r (a worker process) sends its own KV heads (kv_transfer/ranks.py)
        self.connector.rank_transfer = RankTransfer("prefill", "", {"sender_id": cfg.worker_name})
        engine = engine_for(engine_cfg, self.connector, reuse)  # reuse: a role switch keeps the weights
        super().__init__(cfg, engine)
        self._compat = engine.kv_compat()
        self.senders: dict[str, KVSender] = {}  # by backend: a decode service's endpoint names its own
        # The tensor-parallel rank whose KV shard this process sends (the other ranks send their own).
        # Its senders carry it, and the transfer's metrics, span and record take it from them.
        self.rank = 0
        # the configured backend (auto: as a decode service here would choose): its metrics read 0 from
        # the start; those of another backend a decode service names appear with its first transfer
        self.kv_backend, _ = resolve_backend(cfg.kv_backend)
        self.metrics.init_transfer(self.kv_backend, self.rank)
        self._tasks: set[asyncio.Task[None]] = set()  # clean-ups and record writes after an answer

    async def stop(self) -> None:
        """The clean-ups still running (bounded), the base's stop, then the KV senders (bounded: their
        connections close, their memory registrations go; if that did not finish, `kv_released` says
        so)."""
        if self._stopped:
            return
        if self._tasks:
            await self.stop_part("clean-ups", asyncio.gather(*list(self._tasks), return_exceptions=True))
        await super().stop()
        for backend, sender in self.senders.items():
            self.kv_released &= await self.stop_part(f"{backend} KV sender", sender.close())

    def transfer_counters(self) -> list[TransportCount]:
        out: list[TransportCount] = []
        for backend in dict.fromkeys([self.kv_backend, *self.senders]):  # the configured one, 0 until used
            sender = self.senders.get(backend)
            s = sender.stats if sender is not None else SenderStats()
            out += _sender_counters(backend, self.rank, s)
        workers = self.engine.tp_workers  # the worker ranks' own senders, as they last reported
        for rank, stats in (workers.rank_stats if workers is not None else {}).items():
            for backend, sent in stats.sent.items():
                out += _sender_counters(backend, rank, SenderStats(**sent))
        return out

    def sender_for(self, endpoint: str) -> KVSender:
        """The sender for the backend a decode service's endpoint names ("nixl://..." or "tcp://...").
        Made on the event loop (the first call for a backend is the request's own check)."""
        backend = endpoint.split("://", 1)[0]
        if backend not in self.senders:
            self.senders[backend] = make_sender(
                backend, self.engine.kv_cache, self._compat, rank=self.rank, sender_id=self.cfg.worker_name
            )
        return self.senders[backend]

    def _on_failed(self, rkv: OutgoingKV, why: str) -> None:
        """The decode side of the transfer went away: stop the request; its clean-up frees the blocks."""
        self.interrupt(rkv.request_id, why, 502)

    # --- requests ---------------------------------------------------------------------------------
    async def prefill(self, req: PrefillRequest) -> Response:
        bs = self.engine.config.block_size
        try:
            split_endpoints(req.kv_endpoint)  # one per decode rank
            self.sender_for(req.kv_endpoint)
        except ValueError as e:
            return error_response(400, f"kv_endpoint {req.kv_endpoint!r}: {e}")
        if len(req.block_ids) != -(-len(req.token_ids) // bs):
            return error_response(
                400,
                f"{len(req.token_ids)} prompt tokens need {-(-len(req.token_ids) // bs)} "
                f"blocks of {bs}, got {len(req.block_ids)} destination blocks",
            )
        groups = self.engine.kv_cache.spec.groups.num_groups - 1  # layer groups past group 0
        if len(req.group_block_ids) != groups or any(
            len(t) != len(req.block_ids) for t in req.group_block_ids
        ):
            return error_response(
                400,
                f"{groups} more layer groups' destination blocks wanted (each as many as block_ids), got "
                f"{[len(t) for t in req.group_block_ids]}",
            )
        # One token here (after the output a migrated request already has); stop rules are the decode
        # side's. min_tokens is capped to stay valid, which keeps EOS masked for token 0 exactly when the
        # decode service would mask it; everything else the sampler reads is the request's own.
        n_out = req.num_output_tokens
        min_tokens = min(req.sampling.min_tokens, n_out + 1)
        params = req.sampling.replace(max_tokens=n_out + 1, min_tokens=min_tokens)
        refused = self.refusal()
        if refused is not None:
            self.metrics.requests.labels(role="prefill", outcome="refused").inc()
            return refused
        rid, t0 = req.request_id, time.perf_counter()
        job = Job(rid)
        self.open_job(job)
        span = _tracer.start_span(
            "prefill",
            context=context_from(req.traceparent),
            kind=SpanKind.SERVER,
            attributes={"splitserve.request_id": rid, "gen_ai.usage.input_tokens": len(req.token_ids)},
        )
        rkv = await self.connector.add(req, span_ctx(span))
        computed = False  # the engine finished computing the request by itself (token 0 sampled)
        try:
            n_out = req.num_output_tokens
            add = AddRequest(
                rid, req.token_ids, params, req.priority, "send", n_out, tenant=req.tenant,
                cache_salt=req.cache_salt,
            )  # fmt: skip
            await self.aengine.submit(add)
            await self.record(rid, RequestState.PREFILLING, prefill_id=self.cfg.worker_name)
            out, num_cached = await self._first_token(job, req.deadline)
            computed = True
            self.metrics.ttft.observe(time.perf_counter() - t0)
            compute_spans(self.metrics, rkv, num_cached)
            span.set_attribute("splitserve.num_cached_tokens", num_cached)
            await self.record(rid, RequestState.TRANSFERRING)
            await self.connector.finish_sending(rkv, out.token_ids[0], len(req.token_ids))
            sender = self.sender_for(rkv.endpoint)
            transfer_s = transfer_done(self.metrics, rkv, sender.rank)
            # the record says what the transfer cost (GET /v1/requests/{id}), written off the answer's path
            self._spawn(
                self.record_fields(
                    rid,
                    transfer_bytes=rkv.nbytes,
                    transfer_ms=round(transfer_s * 1e3, 3),
                    transfer_backend=rkv.endpoint.split("://", 1)[0],
                )
            )
            self.metrics.requests.labels(role="prefill", outcome="finished").inc()
            prefill_ms = (time.perf_counter() - t0) * 1e3
            first = out.token_ids[0]
            first_lp = out.logprobs[0] if out.logprobs else None
            return msgpack_response(
                PrefillResult(
                    rid, first, len(req.token_ids), num_cached, prefill_ms, rkv.nbytes,
                    first_logprob=first_lp, prompt_logprobs=out.prompt_logprobs,
                )
            )  # fmt: skip
        except TransferError as e:
            self.metrics.requests.labels(role="prefill", outcome="transfer_failed").inc()
            self.metrics.transfer_failures.labels(reason=type(e).__name__).inc()
            fail(rkv.span, e)
            fail(span, e)
            return error_response(502, f"KV transfer to {req.kv_endpoint} failed: {e}")
        except TimeoutError as e:
            fail(span, e)
            return error_response(504, "deadline exceeded on the prefill service")
        except EngineFault as e:
            self.metrics.requests.labels(role="prefill", outcome="failed").inc()
            fail(rkv.span, str(e))
            fail(span, str(e))
            return error_response(500, str(e))
        except Interrupted as e:
            outcome = {499: "aborted", HANDED_BACK: "handed_back"}.get(e.code, "decode_lease_expired")
            self.metrics.requests.labels(role="prefill", outcome=outcome).inc()
            if outcome == "decode_lease_expired":
                self.metrics.transfer_failures.labels(reason=outcome).inc()
            fail(rkv.span, str(e))
            fail(span, str(e))
            return error_response(e.code, str(e))
        finally:
            # The answer does not wait for the engine thread: the blocks are freed in the background.
            self._spawn(self._end(job, rkv, computed))
            rkv.span.end()  # a no-op if it ended already
            span.end()
            self.metrics.e2e.observe(time.perf_counter() - t0)

    async def _first_token(self, job: Job, deadline: float | None) -> tuple[TokenOutput, int]:
        """Token 0, and how many prompt tokens the prefix cache had."""
        num_cached = 0
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.time())
            async with asyncio.timeout(timeout):  # not wait_for: common/runtime/tasks.py
                ev = await job.events.get()
            if isinstance(ev, Interrupt):
                raise Interrupted(ev)
            if isinstance(ev, Admission):
                num_cached = ev.num_cached_tokens
            elif isinstance(ev, TokenOutput) and ev.finished:
                if (why := fault(ev.finish_reason)) is not None:
                    raise EngineFault(why)
                return ev, num_cached

    async def _end(self, job: Job, rkv: OutgoingKV, computed: bool) -> None:
        """Let go of the request in order: the engine stops computing it (its blocks stay, the
        connector holds them), every posted write ends, the lease goes, the engine frees the blocks."""
        reason = "sent" if rkv.state is TransferState.SENT else "abort"
        try:
            if not computed:
                await self.aengine.submit(Finish(job.request_id, reason))
            await self.connector.settle(rkv)
            await self.aengine.submit(Finish(job.request_id, reason))
        finally:
            self.close_job(job)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _sender_counters(backend: str, rank: int, s: SenderStats) -> list[TransportCount]:
    return [
        TransportCount("splitserve_kv_transfer_bytes", "KV bytes sent", backend, rank, s.bytes_sent),
        TransportCount("splitserve_kv_transfer_layers", "layer writes sent", backend, rank, s.layers_sent),
        TransportCount(
            "splitserve_kv_transfer_dones", "kv_done notifications sent", backend, rank, s.dones_sent
        ),
    ]
