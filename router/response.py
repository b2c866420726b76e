"""Phase 6: the answer. The trip's token ids become text as they come (incrementally, UTF-8 safe, stop
strings applied: common/text/detokenizer.py), then one JSON body (`full`) or an SSE stream of chunks
(`stream`), with logprobs and tool calls in OpenAI's shapes (router/openai_responses.py; tool calls are
parsed in the served model's format, router/tool_formats.py). `usage` is counted
in one place for both, and summed over the choices of a request that has several."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from fastapi.responses import JSONResponse, Response

from router.disconnect import ClientGone
from router.errors import APIError
from router.job import Job
from router.logprobs import CompletionLogprobs, TokenTexts, chat_content, merge
from router.metrics import RouterMetrics
from router.openai_responses import SSE_DONE, error_event
from router.outcome import path
from router.tools import parse_tool_calls


def usage(jobs: Iterable[Job]) -> dict[str, Any]:
    """A response's usage: its one choice's, or its choices' summed (best_of candidates included)."""
    prompt = completion = cached = 0
    for job in jobs:
        prompt += len(job.parsed.prompt_ids)
        completion += job.run.output_tokens
        cached += job.trip.output.num_cached_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def texts(job: Job, metrics: RouterMetrics) -> AsyncIterator[tuple[str, int, int]]:
    """(text delta, first output index, end index) until the request ends: the tokens the delta came
    from are the output's ids[first:end]. Sets run.finish_reason and run.output_tokens."""
    run, trip, detok = job.run, job.trip, job.detok
    while run.finish_reason is None:
        ids = await trip.next()
        now = time.monotonic()
        first = run.output_tokens
        if ids is None:
            run.finish_reason = trip.output.finish_reason or "stop"
            text = detok.flush()  # text held back for a stop string that never came
        elif job.parsed.score_only:  # echo with max_tokens 0: the prompt was scored, nothing is output
            run.finish_reason, text = "length", ""
        else:
            text, first_batch = "", run.output_tokens == 0
            for t in ids:
                run.output_tokens += 1
                text += detok.add(t)
                if detok.stopped:
                    run.finish_reason = "stop"
                    break
            if run.t_last is not None and not first_batch:
                metrics.itl.labels(path(trip.route)).observe(now - run.t_last)
            run.t_last = now
        if text or run.output_tokens > first:
            if run.text is not None:
                run.text.append(text)
            yield text, first, run.output_tokens


async def collect(job: Job, metrics: RouterMetrics) -> str:
    return "".join([t async for t, _, _ in texts(job, metrics)])


def full(job: Job, token_texts: TokenTexts, text: str) -> dict[str, Any]:
    """The whole (non-streamed) response of one choice."""
    parsed, run, out, b = job.parsed, job.run, job.trip.output, job.builder
    finish = run.finish_reason or "stop"
    calls: list[dict[str, Any]] | None = None
    content: str | None = text
    if parsed.tool_mode is not None:
        content, calls = parse_tool_calls(text, parsed.tool_mode, parsed.tool_names, parsed.tool_format)
        if calls:
            finish = "tool_calls"
    logprobs: Any = None
    n = run.output_tokens
    if parsed.sampling.logprobs is not None:
        ids, lps = out.ids[:n], out.logprobs[:n]
        if b.chat:
            logprobs = chat_content(token_texts, ids, lps)
        else:
            cl = CompletionLogprobs(token_texts)
            prompt_part = _echo_logprobs(job, cl) if parsed.echo is not None else None
            logprobs = merge(prompt_part, cl.part(ids, lps))
    if parsed.echo is not None:
        content = parsed.echo + (content or "")
    return b.full(content, finish, usage([job]), logprobs, calls)


async def stream(
    job: Job,
    token_texts: TokenTexts,
    metrics: RouterMetrics,
    include_usage: bool,
    end: Callable[[BaseException | None], Awaitable[None]],
) -> AsyncIterator[str]:
    """The SSE stream of one choice; `end` runs however it ends, with its error (None: finished)."""
    parsed, b = job.parsed, job.builder
    error: BaseException | None = None
    cl = None if b.chat else CompletionLogprobs(token_texts)
    try:
        if b.chat:
            yield b.chunk(None, role=True)
        if parsed.echo is not None:
            yield b.chunk(parsed.echo, logprobs=_echo_logprobs(job, cl) if cl is not None else None)
        held: list[str] = []  # tool calls: the output is parsed once whole, then sent
        async for text, i, j in texts(job, metrics):
            if parsed.tool_mode is not None:
                held.append(text)
                continue
            yield b.chunk(text, logprobs=_chunk_logprobs(job, token_texts, cl, i, j))
        finish = job.run.finish_reason
        if parsed.tool_mode is not None:
            content, calls = parse_tool_calls(
                "".join(held), parsed.tool_mode, parsed.tool_names, parsed.tool_format
            )
            if content:
                yield b.chunk(content)
            if calls:
                finish = "tool_calls"
                yield b.chunk(None, tool_calls=[{"index": k, **c} for k, c in enumerate(calls)])
        yield b.chunk(None, finish)
        if include_usage:
            yield b.usage_chunk(usage([job]))
        yield SSE_DONE
    except APIError as e:  # after the first token the status line is sent: report in-stream
        error = e
        yield error_event(e)
        yield SSE_DONE
    except BaseException as e:  # cancelled: the client went away
        error = e
        raise
    finally:
        await end(error)


def failure(e: BaseException, headers: dict[str, str]) -> Response:
    """An APIError as its response; a vanished client gets a 499 nobody reads (it keeps the access
    log honest); anything else propagates."""
    if isinstance(e, APIError):
        e.headers.update(headers)
        return e.response()
    if isinstance(e, ClientGone):
        return JSONResponse(APIError(499, "client disconnected").body(), 499, headers)
    raise e


def _chunk_logprobs(job: Job, token_texts: TokenTexts, cl: CompletionLogprobs | None, i: int, j: int) -> Any:
    """Logprobs of output tokens i..j-1 for one chunk (chat shape when cl is None)."""
    if job.parsed.sampling.logprobs is None or i == j:
        return None
    out = job.trip.output
    ids, lps = out.ids[i:j], out.logprobs[i:j]
    return chat_content(token_texts, ids, lps) if cl is None else cl.part(ids, lps)


def _echo_logprobs(job: Job, cl: CompletionLogprobs) -> dict[str, Any] | None:
    out = job.trip.output
    if out.prompt_logprobs is None:
        return None
    return cl.part(out.prompt_ids, out.prompt_logprobs)
