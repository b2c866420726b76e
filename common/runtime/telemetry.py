"""OpenTelemetry tracing for every splitserve process, configured by the standard `OTEL_*` variables.

    OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT)   where spans go; unset: tracing is off
    OTEL_EXPORTER_OTLP_PROTOCOL (or ..._TRACES_PROTOCOL)   grpc | http/protobuf (the spec's default)
    OTEL_SERVICE_NAME                                      default "splitserve-<role>"
    OTEL_BSP_SCHEDULE_DELAY, OTEL_RESOURCE_ATTRIBUTES, ... read by the SDK itself

With no endpoint no provider is installed: `tracer()` hands out the API's no-op tracer, whose spans
record nothing and never propagate (`traceparent()` returns None, so no bytes go on the wire).

One request is one trace. The W3C `traceparent` crosses processes two ways: as an HTTP header on
every router -> service call, and as the `traceparent` field of the msgpack messages (GenerateRequest,
PrefillRequest, KVLayerHeader, KVDone), which is what the services read, because a KV transfer is
not an HTTP call.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Mapping, MutableMapping
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)
_W3C = TraceContextTextMapPropagator()
_enabled = False


def setup_tracing(role: str) -> bool:
    """Install an OTLP-exporting tracer provider if an endpoint is configured; True if tracing is on.
    Call once per process, before the first span (what `splitserve.cli` does for every role)."""
    global _enabled
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if _enabled or not endpoint or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return _enabled
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": f"splitserve-{role}"}
    provider = TracerProvider(resource=Resource.create(attrs))  # flushes at interpreter exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint etc. from the env
    trace.set_tracer_provider(provider)
    _enabled = True
    log.warning("tracing on: OTLP %s to %s", protocol, endpoint)
    return True


def tracing_enabled() -> bool:
    return _enabled


def tracer(name: str) -> trace.Tracer:
    """The tracer for a module; a no-op one while no provider is installed."""
    return trace.get_tracer(name)


_NOOP: AbstractContextManager[trace.Span] = contextlib.nullcontext(trace.INVALID_SPAN)  # reusable


def span_scope(
    t: trace.Tracer, name: str, context: Context | None = None, attributes: dict[str, Any] | None = None
) -> AbstractContextManager[trace.Span]:
    """`t.start_as_current_span(...)`, or a shared do-nothing scope while tracing is off: the API's
    no-op path still attaches and detaches a context (microseconds), this costs a function call."""
    if not _enabled:
        return _NOOP
    return t.start_as_current_span(name, context=context, attributes=attributes)


def activate(span: trace.Span) -> AbstractContextManager[trace.Span]:
    """Make `span` current for a block without ending it (nothing while tracing is off)."""
    if not _enabled:
        return _NOOP
    return trace.use_span(span, record_exception=False, set_status_on_exception=False)


def traceparent(ctx: Context | None = None) -> str | None:
    """The W3C traceparent of the current span (or of `ctx`'s) for a message field; None if no span
    is recording (tracing off), so nothing is sent."""
    if not _enabled:
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=ctx)
    return carrier.get("traceparent")


def context_from(tp: str | None) -> Context | None:
    """The parent context a message's traceparent names; None (a new root) if it names none."""
    if not tp:
        return None
    return _W3C.extract({"traceparent": tp})


def inject_headers(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current span's traceparent to outgoing HTTP headers (nothing while tracing is off)."""
    if _enabled:
        _W3C.inject(headers)
    return headers


def context_from_headers(headers: Mapping[str, str]) -> Context | None:
    """The caller's trace context from incoming HTTP headers, if it sent one."""
    return context_from(headers.get("traceparent"))


def span_ctx(span: trace.Span) -> Context:
    return trace.set_span_in_context(span)


_UNTRACED_PATHS = frozenset({"/health", "/metrics"})


def _untraced(scope: MutableMapping[str, Any]) -> bool:
    return scope.get("path") in _UNTRACED_PATHS


def fastapi_telemetry() -> dict[str, Any]:
    """Keyword arguments for `FastAPI(...)`. FastAPI (0.16x) traces each HTTP request itself once a
    provider is installed, extracting the caller's traceparent header: keep its server span (the
    hop's HTTP view), drop its per-operation spans and the scrape and probe traffic. Older FastAPI
    has no such option: nothing to pass."""
    from fastapi import FastAPI

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"operation_spans": False, "exclude": _untraced}}
