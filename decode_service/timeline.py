"""When one generate stream's milestones happened, and what the stream leaves behind once it ended:
its histograms and its spans, dated after the fact (nothing per token beyond a clock read)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.protocol import GenerateRequest
from common.runtime.telemetry import context_from, span_ctx, tracer
from common.service.metrics import ServiceMetrics

_tracer = tracer(__name__)


@dataclass
class Timeline:
    """Wall-clock ns of a stream's milestones."""

    arrival: int = field(default_factory=time.time_ns)
    admitted: int = 0  # blocks granted (reserved, or admitted to local prefill)
    ready: int = 0  # the prompt's KV is in place: kv_done applied (remote) or admission (local)
    first_step: int = 0  # this service's first step for the request produced its token
    last_frame: int = 0
    frames: int = 0  # token frames sent
    output_tokens: int = 0  # output tokens so far, token 0 included
    finish_reason: str | None = None

    def on_ready(self, metrics: ServiceMetrics) -> None:
        """Remote mode: token 0 (the prefill service's) is known here now."""
        self.ready = time.time_ns()
        metrics.ttft.observe((self.ready - self.arrival) / 1e9)

    def on_frame(self, metrics: ServiceMetrics, index: int, n: int, finish_reason: str | None) -> None:
        now = time.time_ns()
        if not self.first_step:
            self.first_step = now
            if not self.ready:  # local mode: the first token is this service's own
                metrics.ttft.observe((now - self.arrival) / 1e9)
        if self.frames:
            metrics.itl.observe((now - self.last_frame) / 1e9)
        self.frames += 1
        self.last_frame = now
        self.output_tokens = index + n
        self.finish_reason = finish_reason

    def close(self, metrics: ServiceMetrics, req: GenerateRequest, worker: str, error: str | None) -> None:
        """Histograms of the whole stream, and its spans, once it ended."""
        end = time.time_ns()
        remote = req.mode == "remote"
        metrics.e2e.observe((end - self.arrival) / 1e9)
        start = self.ready if remote else self.first_step
        if self.finish_reason and self.output_tokens > 1 and self.frames and start:
            metrics.tpot.observe((self.last_frame - start) / 1e9 / (self.output_tokens - 1))
        parent = context_from(req.traceparent)
        if parent is None or not trace.get_current_span(parent).get_span_context().is_valid:
            return
        span = _tracer.start_span(
            "decode",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self.arrival,
            attributes={
                "splitserve.request_id": req.request_id,
                "splitserve.mode": req.mode,
                "splitserve.worker_id": worker,
                "gen_ai.usage.input_tokens": len(req.token_ids),
                "gen_ai.usage.output_tokens": self.output_tokens,
                "gen_ai.response.finish_reasons": [self.finish_reason or ("error" if error else "aborted")],
            },
        )
        if not span.is_recording():
            return
        ctx = span_ctx(span)
        if self.admitted:
            queue = _tracer.start_span("decode.queue", context=ctx, start_time=self.arrival)
            queue.end(end_time=self.admitted)
        if remote and self.admitted:
            wait = _tracer.start_span("decode.kv_wait", context=ctx, start_time=self.admitted)
            wait.end(end_time=self.ready or end)
        ready = self.ready or (self.admitted if not remote else 0)
        if ready:
            gen = _tracer.start_span(
                "decode.generate",
                context=ctx,
                start_time=ready,
                attributes={
                    "gen_ai.usage.output_tokens": self.output_tokens,
                    "splitserve.frames": self.frames,
                },
            )
            if self.first_step:
                step = _tracer.start_span(
                    "decode.first_step",
                    context=span_ctx(gen),
                    start_time=ready,
                    attributes={"splitserve.local_prefill": not remote},
                )
                step.end(end_time=self.first_step)
            gen.end(end_time=self.last_frame or end)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end)
