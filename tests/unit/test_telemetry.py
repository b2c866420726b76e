"""common/runtime/telemetry.py: off by default (nothing propagates), W3C traceparent round trips when on;
the KV transfer's active time is the union of its writes' intervals."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from common.runtime import telemetry


def test_off_by_default_sends_nothing() -> None:
    assert not telemetry.tracing_enabled()
    assert telemetry.traceparent() is None
    assert telemetry.inject_headers({}) == {}
    assert telemetry.context_from(None) is None
    with telemetry.span_scope(telemetry.tracer("t"), "x") as span:
        assert not span.is_recording()
    assert telemetry.setup_tracing("router") is False  # no OTEL_EXPORTER_OTLP_ENDPOINT in tests


def test_traceparent_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "_enabled", True)
    tracer = TracerProvider().get_tracer("t")  # a local provider: the global one stays unset
    span = tracer.start_span("root")
    tp = telemetry.traceparent(trace.set_span_in_context(span))
    assert tp is not None and tp.startswith("00-")
    ctx = telemetry.context_from(tp)
    assert ctx is not None
    parent = trace.get_current_span(ctx).get_span_context()
    assert parent.trace_id == span.get_span_context().trace_id
    assert parent.span_id == span.get_span_context().span_id
    child = tracer.start_span("child", context=ctx)
    assert child.parent is not None and child.parent.span_id == span.get_span_context().span_id
    with trace.use_span(span):
        headers = telemetry.inject_headers({"content-type": "application/msgpack"})
    assert headers["traceparent"] == tp
    assert telemetry.context_from_headers(headers) is not None


def test_active_transfer_time_is_the_union_of_writes() -> None:
    from common.connector.remote_kv import OutgoingKV, TransferState

    job = OutgoingKV("r", 1, [0], TransferState.HELD)
    job.active = [(3.0, 4.0), (0.0, 1.0), (0.5, 2.0), (0.6, 0.7)]
    assert job.active_s() == pytest.approx(3.0)  # [0, 2] and [3, 4]; the gap is compute, not link
