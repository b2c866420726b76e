"""How each request is counted and traced: its root span (OpenTelemetry GenAI conventions), what it
produced and when (`Run`), and at its end the request metrics, TTFT / ITL / TPOT / end-to-end
histograms and the SLO judgement (the request's own targets, else the router's). An error's `detail` (the
worker, the upstream's answer, the exception: never in the client's body) is logged here with the request
id, and put on the request's span."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.runtime.telemetry import context_from_headers, tracer
from router.config import RouterConfig
from router.errors import APIError
from router.metrics import RouterMetrics
from router.parse import Parsed
from router.placement import Route
from router.slo import Targets

_tracer = tracer(__name__)
log = logging.getLogger(__name__)


@dataclass
class Run:
    """What one request produced for its client and when: the response counts it, the end reads it."""

    endpoint: str  # "completions" | "chat"
    span: trace.Span = trace.INVALID_SPAN  # the request's root span (a no-op one while tracing is off)
    t0: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    t_last: float | None = None
    output_tokens: int = 0  # as the client got them: a stop string may end the text early
    finish_reason: str | None = None
    outcome: str = "cancelled"  # until proven otherwise: a cancelled task never gets to say so
    counted_inflight: bool = False
    error: str | None = None
    text: list[str] | None = None  # the completion, kept only when log_content is on
    done: bool = False  # the end ran (it may be reached twice: the stream's end and its safety net)
    request_id: str | None = None  # once admitted: the id the client has (x-request-id)


def path(route: Route | None) -> str:
    """The `path` label of the latency histograms."""
    return route.path if route else "none"


class Outcomes:
    """Counts and traces the requests of one router."""

    def __init__(self, metrics: RouterMetrics, config: RouterConfig, model_name: str) -> None:
        self.metrics, self.config, self.model_name = metrics, config, model_name

    def root_span(self, request: Request, endpoint: str) -> trace.Span:
        op = "chat" if endpoint == "chat" else "text_completion"  # gen_ai.operation.name values
        return _tracer.start_span(
            f"{op} {self.model_name}",
            context=_parent(request),
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": op,
                "gen_ai.provider.name": "splitserve",
                "http.route": request.url.path,
            },
        )

    def refused(self, run: Run, request: Request, error: APIError | None) -> trace.Span:
        """Count a request refused before any work (4xx), ending its span."""
        self.metrics.requests.labels(run.endpoint, "rejected", self.model_name).inc()
        span = run.span if run.span is not trace.INVALID_SPAN else self.root_span(request, run.endpoint)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error.message))
        span.end()
        return span

    def admitted(self, run: Run, parsed: Parsed, request_id: str) -> None:
        """The request's attributes on its span, once it is let in; its content only when opted in."""
        span, req = run.span, parsed.req
        run.request_id = request_id
        self.metrics.arrivals.inc()
        if span.is_recording():
            span.set_attributes({
                "gen_ai.request.model": req.model,
                "gen_ai.request.max_tokens": parsed.sampling.max_tokens,
                "gen_ai.usage.input_tokens": len(parsed.prompt_ids),
                "gen_ai.response.id": request_id,
                "gen_ai.response.model": self.model_name,
                "splitserve.request_id": request_id,
                "splitserve.stream": bool(req.stream),
            })  # fmt: skip
        if self.config.log_content and span.is_recording():  # opt-in: prompts are the users' data
            span.set_attribute("gen_ai.input.messages", req.model_dump_json(include={"messages", "prompt"}))
            run.text = []

    def starting(self, run: Run) -> None:
        self.metrics.inflight.inc()
        run.counted_inflight = True

    def first_token(self, run: Run, route: Route | None, targets: Targets, prompt_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        run.t_first = run.t_last = time.monotonic()
        ttft = run.t_first - run.t0
        self.metrics.ttft.labels(path(route)).observe(ttft)
        target = targets.ttft_ms if targets.ttft_ms is not None else self.config.slo_ttft_ms
        if target is not None and ttft * 1000 > target:
            self.metrics.slo_misses.labels("ttft").inc()

    def ended(self, run: Run, route: Route | None, targets: Targets, error: BaseException | None) -> None:
        """Count the request's end and end its span."""
        status = run.outcome if not isinstance(error, APIError) or error.status >= 500 else "rejected"
        if isinstance(error, APIError) and error.detail:
            _log_detail(run, error)
        self.metrics.requests.labels(run.endpoint, status, self.model_name).inc()
        self.metrics.output_tokens.inc(run.output_tokens)
        if run.counted_inflight:
            run.counted_inflight = False
            self.metrics.inflight.dec()
        try:
            self._judge(run, route, targets)
        finally:
            _end_span(run, route)

    def _judge(self, run: Run, route: Route | None, targets: Targets) -> None:
        if run.outcome != "finished" or run.t_first is None or run.t_last is None:
            return
        label = path(route)
        self.metrics.e2e.labels(label).observe(run.t_last - run.t0)
        # the request's own targets when it has them (router/slo.py), else the router's
        ttft_ms = targets.ttft_ms if targets.ttft_ms is not None else self.config.slo_ttft_ms
        tpot_ms = targets.tpot_ms if targets.tpot_ms is not None else self.config.slo_tpot_ms
        met = ttft_ms is None or (run.t_first - run.t0) * 1000 <= ttft_ms
        if run.output_tokens > 1:
            tpot = (run.t_last - run.t_first) / (run.output_tokens - 1)
            self.metrics.tpot.labels(label).observe(tpot)
            if tpot_ms is not None and tpot * 1000 > tpot_ms:
                self.metrics.slo_misses.labels("tpot").inc()
                met = False
        self.metrics.judge(met)


def _log_detail(run: Run, error: APIError) -> None:
    """What the client was not told (the error's detail): in the log with the request id, and on the
    request's span."""
    log.warning(
        "request %s failed: %d %s: %s", run.request_id or "-", error.status, error.message, error.detail
    )
    if run.span.is_recording():
        run.span.add_event(
            "splitserve.error",
            {"splitserve.status": error.status, "splitserve.detail": error.detail or ""},
        )


def _end_span(run: Run, route: Route | None) -> None:
    span = run.span
    if span.is_recording():
        span.set_attributes({
            "gen_ai.usage.output_tokens": run.output_tokens,
            "gen_ai.response.finish_reasons": [run.finish_reason or run.outcome],
            "splitserve.outcome": run.outcome,
            "splitserve.route": route.record if route else "none",
        })  # fmt: skip
        if run.t_first is not None:
            span.set_attribute("splitserve.ttft_s", run.t_first - run.t0)
        if run.text is not None:
            span.set_attribute("gen_ai.output.messages", "".join(run.text))
        if run.outcome == "failed":
            span.set_status(Status(StatusCode.ERROR, run.error or ""))
    span.end()


def _parent(request: Request) -> Any:
    """The current context when FastAPI's own server span is in it (it read the caller's traceparent
    header); else the header's context, if the caller sent one."""
    if trace.get_current_span().get_span_context().is_valid:
        return None
    return context_from_headers(request.headers)
