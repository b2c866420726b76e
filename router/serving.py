"""The two generation endpoints: validate and tokenize, run a Generation, turn tokens into text
(incrementally, UTF-8 safe, stop strings applied here), answer as JSON or as an SSE stream."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import re
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.background import BackgroundTask

from common.runtime.telemetry import activate, context_from_headers, tracer
from common.sampling_params import Guide
from common.text.detokenizer import IncrementalDetokenizer
from common.text.model_info import ModelInfo
from router.access import Access, Admission
from router.auth.keys import ApiKey
from router.config import RouterConfig
from router.errors import APIError, invalid
from router.logprobs import CompletionLogprobs, TokenTexts, chat_content, merge
from router.metrics import RouterMetrics
from router.openai_types import (
    MAX_PROMPTS,
    SSE_DONE,
    Builder,
    ChatCompletionRequest,
    CompletionRequest,
    error_event,
    parse,
    usage,
)
from router.orchestrator import Generation, Orchestrator, shielded
from router.slo import Targets, parse_target
from router.tools import check_tools, parse_tool_calls, render_messages, tool_guide, tool_mode

T = TypeVar("T")
_tracer = tracer(__name__)


class ClientGone(Exception):
    """The client disconnected before we answered."""


@dataclass
class _Run:
    """What one request produced and when, for usage, the terminal record and the metrics."""

    endpoint: str
    t0: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    t_last: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    outcome: str = "cancelled"  # until proven otherwise: a cancelled task never gets to say so
    counted_inflight: bool = False
    error: str | None = None
    admission: Admission | None = None  # the key's rate-limit charge, released at the end
    text: list[str] | None = None  # the completion, kept only when log_content is on
    done: bool = False  # _finish ran (it may be reached twice: the stream's end and its safety net)
    span: trace.Span = trace.INVALID_SPAN  # the request's root span (a no-op one while tracing is off)
    score_only: bool = False  # completions, max_tokens 0 with echo: the one token generated is dropped
    echo: str | None = None  # completions with echo: the prompt's text, returned before the completion
    tool_mode: str | None = None  # "auto" | "required" | "named": the output is parsed for tool calls
    tool_names: list[str] | None = None  # the functions offered: a call to another is not a call


@dataclass
class _Job:
    """One request, prepared: what answering it needs."""

    request_id: str
    run: _Run
    gen: Generation
    headers: dict[str, str]
    builder: Builder
    detok: IncrementalDetokenizer
    prompt_index: int = 0  # several choices: which prompt this one answers


class Server:
    """Holds what the endpoints share; one per app."""

    def __init__(
        self,
        config: RouterConfig,
        model_info: ModelInfo,
        orch: Orchestrator,
        metrics: RouterMetrics,
        access: Access | None = None,
    ) -> None:
        self.config, self.info, self.orch, self.metrics = config, model_info, orch, metrics
        self.access = access
        self.model_name = config.served_model_name or model_info.model_id
        self.model_aliases = {self.model_name, model_info.model_id, "default"}
        self.token_texts = TokenTexts(model_info.tokenizer)
        # what answers (model, splitserve version) — changes when either does, as OpenAI's does
        digest = hashlib.sha256(f"{model_info.model_id}/{_version()}".encode()).hexdigest()
        self.fingerprint = f"fp_{digest[:10]}"

    async def generate(self, request: Request, chat: bool, key: ApiKey | None = None) -> Response:
        """POST /v1/completions (chat=False) or /v1/chat/completions (chat=True), for `key` (None while
        auth is off). Several prompts in one completions request are each a request of their own,
        answered together (`_generate_many`)."""
        body = await request.body()
        try:
            req = parse(ChatCompletionRequest if chat else CompletionRequest, body)
        except APIError as e:
            self._refused(_Run("chat" if chat else "completions"), request, e)
            raise
        many = isinstance(req, CompletionRequest) and (req.prompts is not None or (req.best_of or 1) > 1)
        if many or req.n > 1:
            return await self._generate_many(request, req, key)
        job = await self._prepare(request, req, key)
        request.state.request_id = job.request_id  # for the x-request-id middleware
        failure = await self._start(request, job)
        if failure is not None:
            return failure
        if req.stream:
            body_iter = self._sse(job.gen, job.run, job.detok, job.builder, req.include_usage)
            # Safety net: if the client leaves before the body starts, the generator never runs its
            # finally; the background task (run after the response either way) closes the request.
            net = BackgroundTask(self._finish, job.gen, job.run, ClientGone())
            return StreamingResponse(
                body_iter, media_type="text/event-stream", headers=job.headers, background=net
            )
        try:
            text = await _until_disconnected(request, self._collect(job.gen, job.run, job.detok))
        except BaseException as e:
            await self._finish(job.gen, job.run, e)
            return _answer_failure(e, job.headers)
        await self._finish(job.gen, job.run, None)
        return JSONResponse(self._full(job.gen, job.run, job.builder, text), headers=job.headers)

    def _refused(self, run: _Run, request: Request, error: APIError | None) -> trace.Span:
        """Count a request refused before any work (4xx), ending its span."""
        self.metrics.requests.labels(run.endpoint, "rejected").inc()
        span = run.span if run.span is not trace.INVALID_SPAN else self._root_span(request, run.endpoint)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error.message))
        span.end()
        return span

    def _root_span(self, request: Request, endpoint: str) -> trace.Span:
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

    async def _prepare(
        self,
        request: Request,
        req: CompletionRequest | ChatCompletionRequest,
        key: ApiKey | None,
        request_id: str | None = None,
        index: int = 0,
    ) -> _Job:
        """Validate one request, charge it to the key and make its Generation (not started yet);
        APIError (counted as rejected) if it cannot be served."""
        chat = isinstance(req, ChatCompletionRequest)
        run = _Run("chat" if chat else "completions")
        run.span = span = self._root_span(request, run.endpoint)
        try:
            if req.model not in self.model_aliases:
                raise invalid(
                    f"The model `{req.model}` does not exist; this server serves `{self.model_name}`",
                    "model", "model_not_found",
                )  # fmt: skip
            self._check_stops(req.stop_list)
            tenant, priority, targets = _tenant(request, key), _priority(request), _targets(request, key)
            guide = self._guide(req, run)
            prompt_ids = self._tokenize(req)
            max_tokens = self._max_tokens(req, len(prompt_ids))
            sampling = req.sampling(max(max_tokens, 1), self.info.tokenizer.vocab_size, guide)
            if isinstance(req, CompletionRequest) and req.echo:
                tok = self.info.tokenizer
                run.echo = req.prompt if isinstance(req.prompt, str) else tok.decode(req.prompt)  # type: ignore[arg-type]
                if req.logprobs is not None:  # scored by the service that prefills the prompt
                    sampling = sampling.replace(prompt_logprobs=req.logprobs)
            run.score_only = max_tokens == 0
            max_tokens = sampling.max_tokens
            request_id = request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if self.access is not None:
                n_prompt = len(prompt_ids)
                run.admission = await self.access.admit(key, request_id, n_prompt + max_tokens, n_prompt)
        except APIError as e:
            self._refused(run, request, e)
            raise
        if span.is_recording():
            span.set_attributes({
                "gen_ai.request.model": req.model,
                "gen_ai.request.max_tokens": max_tokens,
                "gen_ai.usage.input_tokens": len(prompt_ids),
                "gen_ai.response.id": request_id,
                "gen_ai.response.model": self.model_name,
                "splitserve.request_id": request_id,
                "splitserve.stream": bool(req.stream),
            })  # fmt: skip
        if self.config.log_content and span.is_recording():  # opt-in: prompts are the users' data
            span.set_attribute("gen_ai.input.messages", req.model_dump_json(include={"messages", "prompt"}))
            run.text = []
        owner = {"tenant": key.tenant, "key_id": key.key_id} if key is not None else None
        gen = self.orch.generation(request_id, prompt_ids, sampling, self.model_name, owner)
        gen.tenant, gen.priority, gen.targets = tenant, priority, targets
        headers = {"x-request-id": request_id, **(run.admission.headers if run.admission else {})}
        builder = Builder(request_id, self.model_name, chat, self.fingerprint, index)
        detok = IncrementalDetokenizer(self.info.tokenizer, req.stop_list)
        return _Job(request_id, run, gen, headers, builder, detok)

    async def _start(self, request: Request, job: _Job) -> Response | None:
        """Place the request and wait for its first token; the error response if that failed."""
        gen, run, headers = job.gen, job.run, job.headers
        self.metrics.inflight.inc()
        run.counted_inflight = True
        try:
            # the task start() runs in copies this context: its spans are children of the root
            with activate(run.span):
                await _until_disconnected(request, gen.start())
        except BaseException as e:
            await self._finish(gen, run, e)
            if gen.route is not None:
                headers["x-splitserve-route"] = gen.route.header
            return _answer_failure(e, headers)
        headers["x-splitserve-route"] = gen.route.header if gen.route else ""
        self.metrics.prompt_tokens.inc(len(gen.prompt_ids))
        run.t_first = run.t_last = time.monotonic()
        self._observe_ttft(gen, run)
        return None

    # ---- several prompts in one request ------------------------------------------------------------

    async def _generate_many(
        self, request: Request, req: CompletionRequest | ChatCompletionRequest, key: ApiKey | None
    ) -> Response:
        """Several choices in one response: several prompts (completions), `n` choices per prompt, or
        `best_of` candidates of which the `n` likeliest are returned. Each is a request of its own (its
        id `<response id>-<k>`, its record, its rate-limit charge, its trace); choice j of a prompt
        draws with seed + j. All run concurrently; the response has choice i * n + j for prompt i's
        j-th, and the usage of all (best_of candidates included) summed. Anything refused (4xx) or
        failing to start refuses the whole request, and nothing of it keeps running."""
        chat = isinstance(req, ChatCompletionRequest)
        n, best_of = req.n, (req.best_of or req.n) if isinstance(req, CompletionRequest) else req.n
        prompts: list[Any] = [None] if chat else (req.prompts or [req.prompt])  # type: ignore[union-attr]
        refusal = None
        if best_of < n:
            refusal = invalid(f"best_of ({best_of}) must be at least n ({n})", "best_of")
        elif best_of > n and req.stream:
            refusal = invalid("best_of cannot be used with stream", "best_of")
        elif len(prompts) * best_of > MAX_PROMPTS * 2:
            refusal = invalid(f"at most {MAX_PROMPTS * 2} choices (prompts x best_of) per request", "n")
        if refusal is not None:
            self._refused(_Run("chat" if chat else "completions"), request, refusal)
            raise refusal
        base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        request.state.request_id = base
        jobs: list[_Job] = []
        try:
            for i, p in enumerate(prompts):
                one = req if chat else req.one(p)  # type: ignore[union-attr]
                for j in range(best_of):
                    update: dict[str, Any] = {"n": 1}
                    if one.seed is not None:  # seed + j, wrapping within int64
                        update["seed"] = (one.seed + j + 2**63) % 2**64 - 2**63
                    if best_of > n and one.logprobs is None:  # to rank candidates (dropped after)
                        update["logprobs"] = 0
                    sub = one.model_copy(update=update)
                    try:
                        job = await self._prepare(request, sub, key, f"{base}-{len(jobs)}", i * n + j)
                    except APIError as e:
                        if len(prompts) > 1 and (
                            e.param == "prompt" or (e.param or "").startswith("prompt.")
                        ):
                            e.param = f"prompt.{i}"
                        raise
                    job.prompt_index = i
                    jobs.append(job)
        except APIError:
            await asyncio.gather(*(self._finish(j.gen, j.run, ClientGone()) for j in jobs))
            raise
        groups: dict[int, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(job.prompt_index, []).append(job)

        async def start(group: list[_Job]) -> list[Response | None]:
            """A prompt's first choice, then its others on the decode service that holds the prompt."""
            first = await self._start(request, group[0])
            if first is not None or len(group) == 1:
                return [first]
            for job in group[1:]:
                job.gen.affinity = group[0].gen.decode_id
            return list(await asyncio.gather(*(self._start(request, job) for job in group[1:])))

        failures = [f for fs in await asyncio.gather(*(start(g) for g in groups.values())) for f in fs]
        headers = {"x-request-id": base, "x-splitserve-request-ids": ",".join(j.request_id for j in jobs)}
        failed = next((f for f in failures if f is not None), None)
        if failed is not None:
            await asyncio.gather(*(self._finish(j.gen, j.run, ClientGone()) for j in jobs))
            failed.headers.update(headers)
            return failed
        routes = ",".join(j.headers.get("x-splitserve-route", "") for j in jobs)
        headers["x-splitserve-route"] = routes
        head = Builder(base, self.model_name, chat, self.fingerprint)
        if req.stream:
            body = self._sse_many(jobs, head, req.include_usage)
            net = BackgroundTask(self._finish_all, jobs, ClientGone())
            return StreamingResponse(body, media_type="text/event-stream", headers=headers, background=net)

        async def collect_all() -> list[str]:
            return list(await asyncio.gather(*(self._collect(j.gen, j.run, j.detok) for j in jobs)))

        try:
            texts = await _until_disconnected(request, collect_all())
        except BaseException as e:
            await self._finish_all(jobs, e)
            return _answer_failure(e, headers)
        await self._finish_all(jobs, None)
        choices: list[tuple[_Job, dict[str, Any]]] = []
        total = usage(0, 0, 0)
        for job, text in zip(jobs, texts, strict=True):
            one = self._full(job.gen, job.run, job.builder, text)
            choices.append((job, one["choices"][0]))
            for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
                total[k] += one["usage"][k]
            total["prompt_tokens_details"]["cached_tokens"] += job.gen.num_cached_tokens
        if best_of > n:
            asked = isinstance(req, CompletionRequest) and req.logprobs is not None
            choices = self._best(choices, n, keep_logprobs=asked)
        out = [c for _, c in sorted(choices, key=lambda jc: jc[1]["index"])]
        return JSONResponse({**head.full(None, "stop", total), "choices": out}, headers=headers)

    @staticmethod
    def _best(
        choices: list[tuple[_Job, dict[str, Any]]], n: int, keep_logprobs: bool
    ) -> list[tuple[_Job, dict[str, Any]]]:
        """best_of: per prompt, the n candidates with the highest mean logprob per token (OpenAI's
        "highest log probability per token"), re-indexed i * n + rank."""
        by_prompt: dict[int, list[tuple[float, _Job, dict[str, Any]]]] = {}
        for job, c in choices:
            lps = job.gen.out_logprobs[: job.run.output_tokens]
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

    async def _finish_all(self, jobs: list[_Job], error: BaseException | None) -> None:
        await asyncio.gather(*(self._finish(j.gen, j.run, error) for j in jobs))

    async def _sse_many(self, jobs: list[_Job], head: Builder, include_usage: bool) -> AsyncIterator[str]:
        """The prompts' streams interleaved as their chunks come (each chunk's choice has its index);
        one usage chunk (summed) and one [DONE] at the end. A failure in one ends them all."""
        queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

        async def feed(i: int, j: _Job) -> None:
            try:
                async for chunk in self._sse(j.gen, j.run, j.detok, j.builder, include_usage=False):
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
                total = usage(0, 0, 0)
                for j in jobs:
                    one = self._usage(j.gen, j.run)
                    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
                        total[k] += one[k]
                    total["prompt_tokens_details"]["cached_tokens"] += j.gen.num_cached_tokens
                yield head.usage_chunk(total)
            yield SSE_DONE
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._finish_all(jobs, ClientGone())  # no-op for those that ended

    def _full(self, gen: Generation, run: _Run, b: Builder, text: str) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        finish = run.finish_reason or "stop"
        calls: list[dict[str, Any]] | None = None
        content: str | None = text
        if run.tool_mode is not None:
            content, calls = parse_tool_calls(text, run.tool_mode, run.tool_names)
            if calls:
                finish = "tool_calls"
        logprobs: Any = None
        n = run.output_tokens
        if gen.sampling.logprobs is not None:
            ids, lps = gen.out_ids[:n], gen.out_logprobs[:n]
            if b.chat:
                logprobs = chat_content(self.token_texts, ids, lps)
            else:
                cl = CompletionLogprobs(self.token_texts)
                prompt_part = self._echo_logprobs(gen, cl) if run.echo is not None else None
                logprobs = merge(prompt_part, cl.part(ids, lps))
        if run.echo is not None:
            content = run.echo + (content or "")
        return b.full(content, finish, self._usage(gen, run), logprobs, calls)

    def _echo_logprobs(self, gen: Generation, cl: CompletionLogprobs) -> dict[str, Any] | None:
        if gen.prompt_logprobs is None:
            return None
        return cl.part(gen.prompt_ids, gen.prompt_logprobs)

    def _usage(self, gen: Generation, run: _Run) -> dict[str, Any]:
        return usage(len(gen.prompt_ids), run.output_tokens, gen.num_cached_tokens)

    def _guide(self, req: CompletionRequest | ChatCompletionRequest, run: _Run) -> Guide | None:
        """The request's structured-output constraint: response_format / structured_outputs, or the
        tool-call guide that tool_choice "required" or a named function sets (not both)."""
        guide = req.guide()
        if not isinstance(req, ChatCompletionRequest):
            return guide
        check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        run.tool_mode = tool_mode(req.tools, req.tool_choice)
        if run.tool_mode is not None:
            run.tool_names = [t.function.name for t in req.tools or ()]
        calls = tool_guide(req.tools, req.tool_choice, req.parallel_tool_calls)
        if calls is not None and guide is not None:
            raise invalid("response_format cannot be combined with a forced tool call", "response_format")
        return calls or guide

    # ---- request -> prompt tokens, max_tokens ----------------------------------------------------

    def _check_stops(self, stops: tuple[str, ...]) -> None:
        limit = self.config.max_stop_chars
        if any(len(s) > limit for s in stops):
            raise invalid(f"stop sequences may be at most {limit} characters long", "stop")

    def _tokenize(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        tok = self.info.tokenizer
        if isinstance(req, ChatCompletionRequest):
            messages, kwargs = req.template_messages(), dict[str, Any]()
            if req.uses_tools:
                messages, kwargs = render_messages(messages, req.tools, tok.chat_template, req.tool_choice)
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
            except (jinja2.TemplateError, ValueError) as e:
                raise invalid(f"messages cannot be formatted for this model: {e}", "messages") from e
            return tok.encode(text, add_special_tokens=False)  # the template places special tokens
        if isinstance(req.prompt, str):
            return tok.encode(req.prompt)
        ids = list(req.prompt)
        if not all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids):
            raise invalid(f"prompt token ids must be in [0, {tok.vocab_size})", "prompt")
        return ids  # type: ignore[return-value]

    def _max_tokens(self, req: CompletionRequest | ChatCompletionRequest, n_prompt: int) -> int:
        ctx = self.info.context_length
        prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        asked = req.max_tokens
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            asked = req.max_completion_tokens
        if n_prompt >= ctx:
            raise invalid(
                f"This model's maximum context length is {ctx} tokens, but the prompt has {n_prompt} tokens "
                "and no room is left for the completion.", prompt_param, "context_length_exceeded",
            )  # fmt: skip
        if asked is None:
            return min(self.config.default_max_tokens, ctx - n_prompt)
        if asked == 0 and not (isinstance(req, CompletionRequest) and req.echo):
            raise invalid("max_tokens may be 0 only with echo (to score the prompt)", "max_tokens")
        if n_prompt + asked > ctx:
            raise invalid(
                f"This model's maximum context length is {ctx} tokens, but {n_prompt + asked} were requested "
                f"({n_prompt} in the prompt + {asked} max_tokens). Reduce the prompt or max_tokens.",
                "max_tokens", "context_length_exceeded",
            )  # fmt: skip
        return asked

    # ---- tokens -> text --------------------------------------------------------------------------

    async def _texts(
        self, gen: Generation, run: _Run, detok: IncrementalDetokenizer
    ) -> AsyncIterator[tuple[str, int, int]]:
        """(text delta, first output index, end index) until the request ends: the tokens the delta
        came from are gen.out_ids[first:end]. Sets run.finish_reason and run.output_tokens."""
        while run.finish_reason is None:
            ids = await gen.next()
            now = time.monotonic()
            first = run.output_tokens
            if ids is None:
                run.finish_reason = gen.finish_reason or "stop"
                text = detok.flush()  # text held back for a stop string that never came
            elif run.score_only:  # echo with max_tokens 0: the prompt was scored, nothing is output
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
                    self.metrics.itl.labels(_path(gen)).observe(now - run.t_last)
                run.t_last = now
            if text or run.output_tokens > first:
                if run.text is not None:
                    run.text.append(text)
                yield text, first, run.output_tokens

    async def _collect(self, gen: Generation, run: _Run, detok: IncrementalDetokenizer) -> str:
        return "".join([t async for t, _, _ in self._texts(gen, run, detok)])

    def _chunk_logprobs(self, gen: Generation, cl: CompletionLogprobs | None, i: int, j: int) -> Any:
        """Logprobs of output tokens i..j-1 for one chunk (chat shape when cl is None)."""
        if gen.sampling.logprobs is None or i == j:
            return None
        ids, lps = gen.out_ids[i:j], gen.out_logprobs[i:j]
        return chat_content(self.token_texts, ids, lps) if cl is None else cl.part(ids, lps)

    async def _sse(
        self, gen: Generation, run: _Run, detok: IncrementalDetokenizer, b: Builder, include_usage: bool
    ) -> AsyncIterator[str]:
        error: BaseException | None = None
        cl = None if b.chat else CompletionLogprobs(self.token_texts)
        try:
            if b.chat:
                yield b.chunk(None, role=True)
            if run.echo is not None:
                yield b.chunk(run.echo, logprobs=self._echo_logprobs(gen, cl) if cl is not None else None)
            held: list[str] = []  # tool calls: the output is parsed once whole, then sent
            async for text, i, j in self._texts(gen, run, detok):
                if run.tool_mode is not None:
                    held.append(text)
                    continue
                yield b.chunk(text, logprobs=self._chunk_logprobs(gen, cl, i, j))
            finish = run.finish_reason
            if run.tool_mode is not None:
                content, calls = parse_tool_calls("".join(held), run.tool_mode, run.tool_names)
                if content:
                    yield b.chunk(content)
                if calls:
                    finish = "tool_calls"
                    yield b.chunk(None, tool_calls=[{"index": k, **c} for k, c in enumerate(calls)])
            yield b.chunk(None, finish)
            if include_usage:
                yield b.usage_chunk(self._usage(gen, run))
            yield SSE_DONE
        except APIError as e:  # after the first token the status line is sent: report in-stream
            error = e
            yield error_event(e)
            yield SSE_DONE
        except BaseException as e:  # cancelled: the client went away
            error = e
            raise
        finally:
            await self._finish(gen, run, error)

    # ---- the end ---------------------------------------------------------------------------------

    async def _finish(self, gen: Generation, run: _Run, error: BaseException | None) -> None:
        """Close upstream work, record the outcome, count it. Runs to the end even if cancelled."""
        if not run.done:
            run.done = True
            await shielded(self._close_and_count(gen, run, error))

    async def _close_and_count(self, gen: Generation, run: _Run, error: BaseException | None) -> None:
        if error is None:
            run.outcome = "finished"
        elif isinstance(error, APIError):
            run.outcome, run.error = "failed", error.message
        else:
            run.outcome = "cancelled"
        try:
            await gen.close(run.outcome, run.finish_reason, run.output_tokens, run.error)
        finally:
            if self.access is not None:
                await self.access.release(run.admission, len(gen.prompt_ids) + run.output_tokens)
            self._count(gen, run, error)

    def _count(self, gen: Generation, run: _Run, error: BaseException | None) -> None:
        status = run.outcome if not isinstance(error, APIError) or error.status >= 500 else "rejected"
        self.metrics.requests.labels(run.endpoint, status).inc()
        self.metrics.output_tokens.inc(run.output_tokens)
        if run.counted_inflight:
            run.counted_inflight = False
            self.metrics.inflight.dec()
        try:
            self._judge(gen, run)
        finally:
            self._end_span(gen, run, error)

    def _judge(self, gen: Generation, run: _Run) -> None:
        if run.outcome != "finished" or run.t_first is None or run.t_last is None:
            return
        path = _path(gen)
        self.metrics.e2e.labels(path).observe(run.t_last - run.t0)
        # the request's own targets when it has them (router/slo.py), else the router's
        ttft_ms = gen.targets.ttft_ms if gen.targets.ttft_ms is not None else self.config.slo_ttft_ms
        tpot_ms = gen.targets.tpot_ms if gen.targets.tpot_ms is not None else self.config.slo_tpot_ms
        met = ttft_ms is None or (run.t_first - run.t0) * 1000 <= ttft_ms
        if run.output_tokens > 1:
            tpot = (run.t_last - run.t_first) / (run.output_tokens - 1)
            self.metrics.tpot.labels(path).observe(tpot)
            if tpot_ms is not None and tpot * 1000 > tpot_ms:
                self.metrics.slo_misses.labels("tpot").inc()
                met = False
        self.metrics.judge(met)

    def _end_span(self, gen: Generation, run: _Run, error: BaseException | None) -> None:
        span = run.span
        if span.is_recording():
            span.set_attributes({
                "gen_ai.usage.output_tokens": run.output_tokens,
                "gen_ai.response.finish_reasons": [run.finish_reason or run.outcome],
                "splitserve.outcome": run.outcome,
                "splitserve.route": gen.route.record if gen.route else "none",
            })  # fmt: skip
            if run.t_first is not None:
                span.set_attribute("splitserve.ttft_s", run.t_first - run.t0)
            if run.text is not None:
                span.set_attribute("gen_ai.output.messages", "".join(run.text))
            if run.outcome == "failed":
                span.set_status(Status(StatusCode.ERROR, run.error or ""))
        span.end()

    def _observe_ttft(self, gen: Generation, run: _Run) -> None:
        assert run.t_first is not None
        ttft = run.t_first - run.t0
        self.metrics.ttft.labels(_path(gen)).observe(ttft)
        target = gen.targets.ttft_ms if gen.targets.ttft_ms is not None else self.config.slo_ttft_ms
        if target is not None and ttft * 1000 > target:
            self.metrics.slo_misses.labels("ttft").inc()


def _answer_failure(e: BaseException, headers: dict[str, str]) -> Response:
    """An APIError as its response; a vanished client gets a 499 nobody reads (it keeps the access
    log honest); anything else propagates."""
    if isinstance(e, APIError):
        e.headers.update(headers)
        return e.response()
    if isinstance(e, ClientGone):
        return JSONResponse(APIError(499, "client disconnected").body(), 499, headers)
    raise e


_TENANT_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,64}")


def _tenant(request: Request, key: ApiKey | None) -> str:
    """Whose request, for the services' fair share: the API key's tenant; without a key (auth off), the
    `x-splitserve-tenant` header, or "" (everyone without one shares a tenant). A key's tenant always
    wins: a header cannot move a request into another tenant's share."""
    if key is not None:
        return key.tenant
    name = request.headers.get("x-splitserve-tenant")
    if name is None:
        return ""
    if not _TENANT_NAME.fullmatch(name):
        raise invalid(
            "x-splitserve-tenant must be 1-64 characters of letters, digits and . _ : @ -",
            "x-splitserve-tenant",
        )
    return name


def _targets(request: Request, key: ApiKey | None) -> Targets:
    """The request's latency targets: its headers', else its API key's defaults (router/slo.py)."""
    h = request.headers
    ttft = parse_target(h.get("x-splitserve-ttft-slo-ms"), "x-splitserve-ttft-slo-ms")
    tpot = parse_target(h.get("x-splitserve-tpot-slo-ms"), "x-splitserve-tpot-slo-ms")
    if key is not None:
        ttft = ttft if ttft is not None else key.limits.ttft_slo_ms
        tpot = tpot if tpot is not None else key.limits.tpot_slo_ms
    return Targets(ttft, tpot)


def _priority(request: Request) -> int:
    """The request's class inside its tenant (`x-splitserve-priority`, lower runs first; default 0)."""
    value = request.headers.get("x-splitserve-priority")
    if value is None:
        return 0
    try:
        priority = int(value)
    except ValueError:
        priority = None
    if priority is None or not -100 <= priority <= 100:
        raise invalid("x-splitserve-priority must be an integer from -100 to 100", "x-splitserve-priority")
    return priority


def _parent(request: Request) -> Any:
    """The current context when FastAPI's own server span is in it (it read the caller's traceparent
    header); else the header's context, if the caller sent one."""
    if trace.get_current_span().get_span_context().is_valid:
        return None
    return context_from_headers(request.headers)


def _version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def _path(gen: Generation) -> str:
    return gen.route.path if gen.route else "none"


async def _until_disconnected(request: Request, coro: Coroutine[Any, Any, T]) -> T:
    """Run coro; if the client disconnects first, cancel it and raise ClientGone.

    Starlette notices a disconnect only for streaming bodies, so before the answer starts (and for
    the whole of a non-streaming request) we listen for it ourselves.
    """
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
