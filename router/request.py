"""One generation request, phase by phase. Read `handle`, then the phases in the order it calls them:

    1 parse       router/parse.py      body and headers -> Parsed (400); run before `handle`, by
                                       router/prep.py (off the loop for large bodies)
    2 admission   router/admission.py  the key's limits (429); later, overload and latency targets (503, 429)
    3 placement   router/placement.py  decode and prefill candidates, best first; the route, split or local
    4 the record  router/record.py     req:{id} in Redis: QUEUED, then the end
    5 the trip    router/trip.py       the decode stream, the prefill call, the first token, then the rest,
                                       migrating off a decode service that fails
    6 response    router/response.py   token ids -> text; one JSON body or an SSE stream

The end (`finish`) runs once however the request ends: the services' work stopped, the record's end,
the rate-limit charge given back, the request counted and its span ended (router/outcome.py). Several
choices in one request (n, best_of, several prompts) are each a request of their own, run together by
router/many.py through `prepare`, `start` and `finish` here.
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from common.runtime.telemetry import activate
from common.text.detokenizer import IncrementalDetokenizer
from router.admission import admit, shed
from router.auth.keys import ApiKey
from router.disconnect import ClientGone, until_disconnected
from router.errors import APIError
from router.job import Job
from router.openai_responses import Builder
from router.outcome import Run
from router.parse import Parsed, endpoint
from router.placement import place
from router.record import RequestRecord
from router.response import collect, failure, full, stream
from router.tasks import shielded
from router.trip import Trip

if TYPE_CHECKING:  # the Server calls in here
    from router.serving import Server


async def handle(server: Server, request: Request, parsed: Parsed, key: ApiKey | None) -> Response:
    """One request (`parsed`: phase 1, done by router/prep.py) for `key` (None while auth is off), start
    to end."""
    req = parsed.req
    job = await prepare(server, request, parsed, key)  # 2 admission: the key's limits
    request.state.request_id = job.request_id  # for the x-request-id middleware
    failed = await start(server, request, job)  # 3 placement, 2 shedding, 4 the record, 5 the first token
    if failed is not None:
        return failed
    if req.stream:  # 6 the response, as the rest of the trip comes in; then the end
        end = functools.partial(finish, server, job)
        body = stream(job, server.model.token_texts, server.metrics, req.include_usage, end)
        # Safety net: if the client leaves before the body starts, the generator never runs its
        # finally; the background task (run after the response either way) closes the request.
        net = BackgroundTask(finish, server, job, ClientGone())
        return StreamingResponse(body, media_type="text/event-stream", headers=job.headers, background=net)
    try:
        text = await until_disconnected(request, collect(job, server.metrics))
    except BaseException as e:
        await finish(server, job, e)
        return failure(e, job.headers)
    await finish(server, job, None)
    return JSONResponse(full(job, server.model.token_texts, text), headers=job.headers)


async def prepare(
    server: Server,
    request: Request,
    parsed: Parsed,
    key: ApiKey | None,
    request_id: str | None = None,
    index: int = 0,
) -> Job:
    """Phase 2 for a request phase 1 validated (`parsed`, router/parse.py, run by router/prep.py): charge
    it to the key; APIError (counted as rejected) if it cannot be served. Nothing has reached a service
    yet."""
    req = parsed.req
    run = Run(endpoint(parsed.chat))
    run.span = server.outcomes.root_span(request, run.endpoint)
    try:
        request_id = request_id or f"{'chatcmpl' if parsed.chat else 'cmpl'}-{uuid.uuid4().hex}"
        admission = await admit(server.access, key, request_id, parsed)
    except APIError as e:
        server.outcomes.refused(run, request, e)
        raise
    server.outcomes.admitted(run, parsed, request_id)
    owner = {"tenant": key.tenant, "key_id": key.key_id} if key is not None else {}
    record = RequestRecord(server.orch, request_id, server.model.name, len(parsed.prompt_ids), owner)
    trip = Trip(server.orch, request_id, parsed, record)
    headers = {"x-request-id": request_id, **(admission.headers if admission else {})}
    builder = Builder(request_id, server.model.name, parsed.chat, server.model.fingerprint, index)
    detok = IncrementalDetokenizer(server.model.info.tokenizer, req.stop_list)
    return Job(request_id, parsed, admission, trip, record, run, headers, builder, detok)


async def start(server: Server, request: Request, job: Job) -> Response | None:
    """Phases 3 to 5, up to the first token (given up if the client leaves first); the error response
    if that failed (the request has then ended)."""
    server.outcomes.starting(job.run)
    try:
        # the task until_disconnected runs copies this context: its spans are children of the root
        with activate(job.run.span):
            await until_disconnected(request, _first_token(server, job))
    except BaseException as e:
        await finish(server, job, e)
        if job.trip.route is not None:
            job.headers["x-splitserve-route"] = job.trip.route.header
        return failure(e, job.headers)
    route = job.trip.route
    job.headers["x-splitserve-route"] = route.header if route else ""
    server.outcomes.first_token(job.run, route, job.parsed.targets, len(job.parsed.prompt_ids))
    return None


async def _first_token(server: Server, job: Job) -> None:
    """Where the request runs, whether it may, its record, and the trip up to its first token."""
    trip, targets = job.trip, job.parsed.targets
    t0 = time.perf_counter()
    placement = await place(trip.placer)  # 3 placement: the candidates, best first, and the route
    placement = shed(placement, trip.placer, targets, server.config, server.metrics)  # 2 overload, SLO
    server.metrics.placement.observe(time.perf_counter() - t0)
    server.metrics.routes.labels(placement.route.path, placement.route.reason).inc()
    await job.record.create(placement.route)  # 4 the record: QUEUED
    await trip.start(placement)  # 5 the trip, to its first token


async def finish(server: Server, job: Job, error: BaseException | None) -> None:
    """The end: stop upstream work, record the outcome, give back the charge, count it. Runs to the end
    even if cancelled, and once (the stream's end and its safety net may both get here)."""
    if not job.run.done:
        job.run.done = True
        await shielded(_close_and_count(server, job, error))


async def _close_and_count(server: Server, job: Job, error: BaseException | None) -> None:
    run = job.run
    if error is None:
        run.outcome = "finished"
    elif isinstance(error, APIError):
        run.outcome, run.error = "failed", error.message
    else:
        run.outcome = "cancelled"
    try:
        try:
            await job.trip.close()
        finally:
            await job.record.end(run.outcome, run.finish_reason, run.output_tokens, run.error)
    finally:
        if server.access is not None:
            await server.access.release(job.admission, len(job.parsed.prompt_ids) + run.output_tokens)
        server.outcomes.ended(run, job.trip.route, job.parsed.targets, error)
