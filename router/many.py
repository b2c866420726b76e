"""Several choices in one response: several prompts (completions), `n` choices per prompt, or `best_of`
candidates of which the `n` likeliest are returned. Each is a request of its own (router/request.py:
its id `<response id>-<k>`, its record, its rate-limit charge, its trace); choice j of a prompt draws
with seed + j. All run concurrently; the response has choice i * n + j for prompt i's j-th, and the
usage of all (best_of candidates included) summed. Anything refused (4xx) or failing to start refuses
the whole request, and nothing of it keeps running.

Choices of one prompt share its prefill: the first is placed as any request; the rest follow it to its
decode service (`Placer.affinity`), where the prompt's full blocks are prefix-cache hits."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from common.runtime.tasks import cancel_and_wait
from router.auth.keys import ApiKey
from router.disconnect import ClientGone, until_disconnected
from router.errors import APIError, invalid
from router.job import Job
from router.openai_responses import SSE_DONE, Builder
from router.openai_types import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest
from router.parse import OpenAIRequest, Parsed
from router.request import finish, prepare, start
from router.response import collect, failure, full, stream, usage

if TYPE_CHECKING:  # the Server calls in here
    from router.serving import Server


def wants_many(req: OpenAIRequest) -> bool:
    """Whether the request asks for more than one choice (then `handle_many` answers it)."""
    many = isinstance(req, CompletionRequest) and (req.prompts is not None or (req.best_of or 1) > 1)
    return many or req.n > 1


def refusal(req: OpenAIRequest) -> APIError | None:
    """Why the choices asked for cannot be given (400), before any is parsed; None if they can."""
    n, best_of = req.n, (req.best_of or req.n) if isinstance(req, CompletionRequest) else req.n
    if best_of < n:
        return invalid(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if best_of > n and req.stream:
        return invalid("best_of cannot be used with stream", "best_of")
    if len(_prompts(req)) * best_of > MAX_PROMPTS * 2:
        return invalid(f"at most {MAX_PROMPTS * 2} choices (prompts x best_of) per request", "n")
    return None


def subrequests(req: OpenAIRequest) -> Iterator[tuple[int, int, OpenAIRequest]]:
    """Each choice as a request of its own, in the order they run: (prompt i, candidate j, request)."""
    best_of = (req.best_of or req.n) if isinstance(req, CompletionRequest) else req.n
    for i, p in enumerate(_prompts(req)):
        one = req if isinstance(req, ChatCompletionRequest) else req.one(p)
        for j in range(best_of):
            update: dict[str, Any] = {"n": 1}
            if one.seed is not None:  # seed + j, wrapping within int64
                update["seed"] = (one.seed + j + 2**63) % 2**64 - 2**63
            if best_of > req.n and one.logprobs is None:  # to rank candidates (dropped after)
                update["logprobs"] = 0
            yield i, j, one.model_copy(update=update)


def name_prompt(req: OpenAIRequest, i: int, e: APIError) -> APIError:
    """A refusal of prompt i's choice names `prompt.i` when there are several prompts."""
    if len(_prompts(req)) > 1 and (e.param == "prompt" or (e.param or "").startswith("prompt.")):
        e.param = f"prompt.{i}"
    return e


def _prompts(req: OpenAIRequest) -> list[Any]:
    if isinstance(req, ChatCompletionRequest):
        return [None]
    return list(req.prompts or [req.prompt])


async def handle_many(
    server: Server,
    request: Request,
    req: OpenAIRequest,
    parsed: list[tuple[int, int, Parsed]],
    key: ApiKey | None,
) -> Response:
    """`req` and each of its choices, parsed (router/prep.py: `refusal`, `subrequests`), answered
    together."""
    chat = isinstance(req, ChatCompletionRequest)
    n, best_of = req.n, (req.best_of or req.n) if isinstance(req, CompletionRequest) else req.n
    base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    request.state.request_id = base
    jobs: list[Job] = []
    try:
        for i, j, one in parsed:
            job = await prepare(server, request, one, key, f"{base}-{len(jobs)}", i * n + j)
            job.prompt_index = i
            jobs.append(job)
    except APIError:
        await _finish_all(server, jobs, ClientGone())
        raise
    groups: dict[int, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.prompt_index, []).append(job)

    async def start_group(group: list[Job]) -> list[Response | None]:
        """A prompt's first choice, then its others on the decode service that holds the prompt."""
        first = await start(server, request, group[0])
        if first is not None or len(group) == 1:
            return [first]
        for job in group[1:]:
            job.trip.placer.affinity = group[0].trip.decode_id
        return list(await asyncio.gather(*(start(server, request, job) for job in group[1:])))

    failures = [f for fs in await asyncio.gather(*(start_group(g) for g in groups.values())) for f in fs]
    headers = {"x-request-id": base, "x-splitserve-request-ids": ",".join(j.request_id for j in jobs)}
    failed = next((f for f in failures if f is not None), None)
    if failed is not None:
        await _finish_all(server, jobs, ClientGone())
        failed.headers.update(headers)
        return failed
    headers["x-splitserve-route"] = ",".join(j.headers.get("x-splitserve-route", "") for j in jobs)
    head = Builder(base, server.model.name, chat, server.model.fingerprint)
    if req.stream:
        body = _stream_all(server, jobs, head, req.include_usage)
        net = BackgroundTask(_finish_all, server, jobs, ClientGone())
        return StreamingResponse(body, media_type="text/event-stream", headers=headers, background=net)

    async def collect_all() -> list[str]:
        return list(await asyncio.gather(*(collect(j, server.metrics) for j in jobs)))

    try:
        texts = await until_disconnected(request, collect_all())
    except BaseException as e:
        await _finish_all(server, jobs, e)
        return failure(e, headers)
    await _finish_all(server, jobs, None)
    answers = zip(jobs, texts, strict=True)
    choices = [(job, full(job, server.model.token_texts, text)["choices"][0]) for job, text in answers]
    if best_of > n:
        asked = isinstance(req, CompletionRequest) and req.logprobs is not None
        choices = _best(choices, n, keep_logprobs=asked)
    out = [c for _, c in sorted(choices, key=lambda jc: jc[1]["index"])]
    return JSONResponse({**head.full(None, "stop", usage(jobs)), "choices": out}, headers=headers)


def _best(
    choices: list[tuple[Job, dict[str, Any]]], n: int, keep_logprobs: bool
) -> list[tuple[Job, dict[str, Any]]]:
    """best_of: per prompt, the n candidates with the highest mean logprob per token (OpenAI's
    "highest log probability per token"), re-indexed i * n + rank."""
    by_prompt: dict[int, list[tuple[float, Job, dict[str, Any]]]] = {}
    for job, c in choices:
        lps = job.trip.output.logprobs[: job.run.output_tokens]
        score = sum(lp.logprob for lp in lps) / len(lps) if lps else float("-inf")
        by_prompt.setdefault(job.prompt_index, []).append((score, job, c))
    out = []
    for i, cands in by_prompt.items():
        cands.sort(key=lambda sc: -sc[0])
        for rank, (_, job, c) in enumerate(cands[:n]):
            c = {**c, "index": i * n + rank}
            if not keep_logprobs:
                c["logprobs"] = None
            out.append((job, c))
    return out


async def _finish_all(server: Server, jobs: list[Job], error: BaseException | None) -> None:
    await asyncio.gather(*(finish(server, j, error) for j in jobs))


async def _stream_all(
    server: Server, jobs: list[Job], head: Builder, include_usage: bool
) -> AsyncIterator[str]:
    """The prompts' streams interleaved as their chunks come (each chunk's choice has its index);
    one usage chunk (summed) and one [DONE] at the end. A failure in one ends them all."""
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def feed(i: int, job: Job) -> None:
        end = functools.partial(finish, server, job)
        try:
            async for chunk in stream(job, server.model.token_texts, server.metrics, False, end):
                await queue.put((i, chunk))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(feed(i, j)) for i, j in enumerate(jobs)]
    try:
        open_ = len(jobs)
        while open_:
            _, chunk = await queue.get()
            if chunk is None:
                open_ -= 1
            elif chunk == SSE_DONE:
                continue
            else:
                yield chunk
                if chunk.startswith('data: {"error"'):
                    break  # a failed prompt fails the request, as it would unsplit
        if include_usage:
            yield head.usage_chunk(usage(jobs))
        yield SSE_DONE
    finally:
        await asyncio.gather(*(cancel_and_wait(t) for t in tasks))  # until each has ended
        await _finish_all(server, jobs, ClientGone())  # no-op for those that ended
