"""Phase 2: may the request run now? Asked twice.

- `admit`, before any work: its API key's limits (router/access.py; the key itself was authenticated
  before the endpoint ran) charge the request and its tokens, or refuse it (429 with Retry-After).
- `shed`, once placement has found where it could run: overload (503 with Retry-After when every
  decode queue is too deep, `max_decode_queue`, or has kept a request waiting too long to start,
  `start_timeout_s`) and its latency targets (429 when no placement is predicted to meet them,
  router/slo.py). Each refusal is counted (`shed{reason}`) and is an event on the request's span.
"""

from __future__ import annotations

from dataclasses import replace

from opentelemetry import trace

from router.access import Access, Admission
from router.auth.keys import ApiKey
from router.config import RouterConfig
from router.errors import unavailable
from router.metrics import RouterMetrics
from router.parse import Parsed
from router.placement import Placement, Placer
from router.slo import Prediction, Targets, predict_tpot_ms, predict_ttft_ms, unattainable
from router.workers import Worker


async def admit(
    access: Access | None, key: ApiKey | None, request_id: str, parsed: Parsed
) -> Admission | None:
    """Charge the request (prompt + max output tokens) to `key`'s limits; None while there is no
    access control at all. Released at the request's end (Access.release)."""
    if access is None:
        return None
    n_prompt = len(parsed.prompt_ids)
    return await access.admit(key, request_id, n_prompt + parsed.sampling.max_tokens, n_prompt)


def shed(
    placement: Placement, placer: Placer, targets: Targets, config: RouterConfig, metrics: RouterMetrics
) -> Placement:
    """The placement the request may have: without the decode services too busy to start it in time,
    and meeting its latency targets (which may reorder it, or make it local); 503 or 429 if none."""
    placement = replace(placement, decodes=_in_time(list(placement.decodes), config, metrics))
    if targets.any:
        placement = _meet_targets(placement, placer, targets, metrics)
    return placement


def shed_event(reason: str) -> None:
    """On the request's span: it was refused for overload, and why."""
    trace.get_current_span().add_event("splitserve.shed", {"splitserve.reason": reason})


def _in_time(decodes: list[Worker], config: RouterConfig, metrics: RouterMetrics) -> tuple[Worker, ...]:
    """503 before any work when every decode service is past max_decode_queue, or (start_timeout_s)
    when every one's queue has held a request longer than this one may wait to start: a queue
    that old will not reach it in time. Otherwise the decode services it may go to, best first
    (with start_timeout_s, those whose queue is younger than that)."""
    limit, start_s = config.max_decode_queue, config.start_timeout_s
    if limit is not None and all(int(w.load.get("waiting", 0)) >= limit for w in decodes):
        shed_event("queue_depth")
        metrics.shed.labels("queue_depth").inc()
        message = f"every decode service has {limit}+ requests waiting; retry later"
        raise unavailable(message, config.retry_after_s)
    if start_s is None:
        return tuple(decodes)
    in_time = [w for w in decodes if float(w.load.get("queue_wait_s", 0)) < start_s]
    if not in_time:
        shed_event("queue_wait")
        metrics.shed.labels("queue_wait").inc()
        raise unavailable(
            f"every decode queue has kept a request waiting {start_s:g}+ s; this one could not start "
            "in time; retry later", config.retry_after_s,
        )  # fmt: skip
    return tuple(in_time)


def _meet_targets(
    placement: Placement, placer: Placer, targets: Targets, metrics: RouterMetrics
) -> Placement:
    """SLO-aware admission (router/slo.py): the first placement, in placement order, predicted to meet
    the request's targets — its decode and prefill services first in the lists, and the local path
    when only that meets them; 429 when none does."""
    decodes, prefills = list(placement.decodes), list(placement.prefills)
    best: Prediction | None = None
    for d in decodes[:3]:
        route, tpot = placer.route_for([d], prefills), predict_tpot_ms(d.load)
        options = [
            (p, Prediction(predict_ttft_ms(p.load, placer.uncached("prefill", p), False), tpot))
            for p in (prefills[:2] if route.path == "split" else [])
        ]
        local = Prediction(predict_ttft_ms(d.load, placer.uncached("decode", d), True), tpot)
        for p, pred in [*options, (None, local)]:
            if pred.meets(targets):
                placer.slo_local = p is None and route.path == "split"  # prefill services too slow
                first = [p] if p is not None else []
                prefills = first + [w for w in prefills if w is not p]
                placer.route = route = placer.route_for([d], prefills)
                return Placement((d, *(w for w in decodes if w is not d)), tuple(prefills), route)
            if best is None or (pred.ttft_ms or 0.0) < (best.ttft_ms or 0.0):
                best = pred
    shed_event("slo")
    metrics.shed.labels("slo").inc()
    raise unattainable(targets, best or Prediction(None, None))
