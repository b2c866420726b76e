"""What a prefilled request leaves behind for operators: its queue/compute/transfer spans, dated after
the fact (the chunks ran on the engine thread), and the matching histograms."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from common.connector.remote_kv import OutgoingKV
from common.runtime.telemetry import span_ctx, tracer
from common.service.metrics import ServiceMetrics

_tracer = tracer(__name__)


def compute_spans(metrics: ServiceMetrics, rkv: OutgoingKV, num_cached_tokens: int) -> None:
    """The queue wait and per-chunk compute of a prefilled request."""
    chunks = [c for c in rkv.chunks if c[1]]
    if not chunks:
        return
    first, last = chunks[0][0], chunks[-1][1]
    metrics.queue_wait.observe(max(0, first - rkv.arrival_ns) / 1e9)
    metrics.prefill_compute.observe((last - first) / 1e9)
    if not trace.get_current_span(rkv.trace_ctx).is_recording():
        return
    _tracer.start_span("prefill.queue", context=rkv.trace_ctx, start_time=rkv.arrival_ns).end(end_time=first)
    compute = _tracer.start_span(
        "prefill.compute",
        context=rkv.trace_ctx,
        start_time=first,
        attributes={
            "splitserve.chunks": len(chunks),
            "splitserve.tokens": sum(c[2] for c in chunks),
            "splitserve.num_cached_tokens": num_cached_tokens,
        },
    )
    for i, (a, b, n) in enumerate(chunks):
        chunk = _tracer.start_span(
            "prefill.chunk",
            context=span_ctx(compute),
            start_time=a,
            attributes={"splitserve.chunk": i, "splitserve.tokens": n},
        )
        chunk.end(end_time=b)
    compute.end(end_time=last)


def transfer_done(metrics: ServiceMetrics, rkv: OutgoingKV, rank: int) -> float:
    """The kv.transfer span's figures and the transfer histograms, once kv_done went out; returns the
    transfer's time in seconds (0 when nothing was written: the decode service held every block)."""
    if not rkv.writes:
        return 0.0
    backend = rkv.endpoint.split("://", 1)[0]
    # first write out to kv_done delivered: the transfer's wall time (compute gaps included)
    duration = time.perf_counter() - min((a for a, _ in rkv.active), default=time.perf_counter())
    active = rkv.active_s()
    metrics.observe_transfer(backend, rank, duration, active)
    span = rkv.span
    if span.is_recording():
        span.set_attributes({
            "splitserve.kv.rank": rank,
            "splitserve.kv.backend": backend,
            "splitserve.kv.bytes": rkv.nbytes,
            "splitserve.kv.blocks": len(rkv.dst_blocks),
            "splitserve.kv.layers": len(rkv.layers),
            "splitserve.kv.writes": len(rkv.writes),
            "splitserve.kv.duration_s": duration,
            "splitserve.kv.active_s": active,
            "splitserve.kv.endpoint": rkv.endpoint,
        })  # fmt: skip
        if active > 0:  # gigabits per second, as link speeds are quoted; over the time a write was in flight
            span.set_attribute("splitserve.kv.bandwidth_gbps", rkv.nbytes * 8 / active / 1e9)
    span.end()
    return duration


def fail(span: trace.Span, e: BaseException | str) -> None:
    if span.is_recording():
        if isinstance(e, BaseException):
            span.record_exception(e)
        span.set_status(Status(StatusCode.ERROR, str(e)))
