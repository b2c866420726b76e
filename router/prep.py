"""Request preparation off the event loop: the CPU-heavy part of a request — its JSON body validated,
the chat template rendered, the prompt tokenized, tool schemas and structured-output guides checked
(llguidance) — runs in a small pool of worker processes, so one key's 8 MiB bodies cannot stall every
other request, /health and the Redis deadlines of the rate limits with them (issue 31, point 1).

Why processes and not threads: of that work only the `tokenizers` batch encoder releases the GIL.
Measured on the test model: a 5 MiB chat of 150,000 small messages costs 1.3 s of pydantic, Python and
jinja2 (all holding the GIL), and `Tokenizer.encode` of the longest prompt the context admits 0.3 s with
the GIL held too (a thread spinning beside it ran at 15% of its speed; beside `encode_batch` it ran at
full speed, but the template and the validation would still hold it). In a thread that work would
still take the loop's GIL for 5 ms slices at a time; in a process it takes none. The workers run at a
lower CPU priority (nice +10), so on a busy machine the router's loop is scheduled first.

Bounded: `parse_workers` processes (0: everything on the loop, as before), at most `parse_queue` more
jobs waiting, and one key at most half of all places; past them the request is refused at once (503
with Retry-After when the pool is full, 429 when the key holds its share) instead of waiting without
bound. Bodies of at most `parse_inline_bytes` are prepared on the loop itself: their work is smaller
than a trip to a worker, and they never wait behind a flood of large ones.

The workers are spawned (a fresh interpreter: no copy of the router's threads or sockets) on the first
large body, or at start (`warm`); each rebuilds the served models from their tokenizers' JSON, and
prepares each request with the model its `model` names (router/served_model.py). A worker
that dies (killed, out of memory) fails the jobs it held with 503 and the pool is started again.

A job's value crosses back pickled: a `Parsed` for an accepted request (its prompt fits the context, so
it is small; a structured-output schema is bounded by the body limit only), an error as a tuple
(APIError is rebuilt here, its status, param and code intact).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import tokenizers

from common.text.model_info import ModelInfo
from common.text.tokenizer import Tokenizer
from router.auth.keys import ApiKey
from router.config import RouterConfig
from router.errors import APIError, unavailable
from router.many import name_prompt, refusal, subrequests, wants_many
from router.metrics import RouterMetrics
from router.parse import OpenAIRequest, Parsed, parse, read
from router.served_model import ServedModels
from router.tokenize import detokenize, tokenize

log = logging.getLogger(__name__)
WORKER_NICE = 10  # the workers yield the CPU to the router's loop (and to anything else) when it is busy
# the request headers parse reads (tenant, priority, latency targets): the only ones sent to a worker
PARSE_HEADERS = (
    "x-splitserve-tenant",
    "x-splitserve-priority",
    "x-splitserve-ttft-slo-ms",
    "x-splitserve-tpot-slo-ms",
)


@dataclass(frozen=True)
class Context:
    """What a job reads: the served models and the router's settings (a worker has its own copy)."""

    models: ServedModels
    config: RouterConfig


@dataclass(frozen=True)
class Prepared:
    """A generation request, parsed: its body and the requests it is made of (one, or each choice of
    router/many.py in the order they run: prompt i, candidate j)."""

    req: OpenAIRequest
    parsed: list[tuple[int, int, Parsed]]

    @property
    def many(self) -> bool:
        return wants_many(self.req)


# ---- the jobs (run in a worker, or on the loop for small bodies) ----------------------------------


def prepare_generation(
    ctx: Context, body: bytes, chat: bool, headers: Mapping[str, str], key: ApiKey | None
) -> Prepared:
    """POST /v1/completions or /v1/chat/completions: the body read and every request in it parsed
    (router/parse.py) for the model it names; APIError(400) for the first thing wrong, in the order the
    loop used to find it: the body, its model (404), how many choices, then each choice."""
    req = read(body, chat)
    model = ctx.models.lookup(req.model)
    if not wants_many(req):
        return Prepared(req, [(0, 0, parse(req, headers, key, model, ctx.config))])
    refused = refusal(req)
    if refused is not None:
        raise refused
    out = []
    for i, j, sub in subrequests(req):
        try:
            out.append((i, j, parse(sub, headers, key, model, ctx.config)))
        except APIError as e:
            raise name_prompt(req, i, e) from None
    return Prepared(req, out)


def prepare_tokenize(ctx: Context, body: bytes) -> dict[str, Any]:
    return tokenize(ctx.models, body)


def prepare_detokenize(ctx: Context, body: bytes) -> dict[str, Any]:
    return detokenize(ctx.models, body)


# ---- the worker process -----------------------------------------------------------------------------

_context: Context | None = None  # in a worker: set once by _start_worker


@dataclass(frozen=True)
class _ModelState:
    """A ModelInfo as plain data, to rebuild it in a worker (a Tokenizer holds a compiled template)."""

    model_id: str
    context_length: int
    tokenizer_json: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, info: ModelInfo) -> _ModelState:
        t = info.tokenizer
        return cls(
            info.model_id,
            info.context_length,
            t.tok.to_str(),
            t.chat_template,
            t.bos_token_id,
            t.eos_token_ids,
        )

    def info(self) -> ModelInfo:
        tok = Tokenizer(
            tokenizers.Tokenizer.from_str(self.tokenizer_json),
            self.chat_template,
            self.bos_token_id,
            self.eos_token_ids,
        )
        return ModelInfo(self.model_id, self.context_length, tok)


def _start_worker(config: RouterConfig, states: tuple[_ModelState, ...] | None) -> None:
    assert states is not None
    global _context
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICE)
    _context = Context(ServedModels.of(config, [s.info() for s in states]), config)


def _in_worker(job: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Run `job` with the worker's context: ("ok", value) or ("error", APIError's fields)."""
    assert _context is not None, "the worker was not started"
    return _outcome(job, _context, args)


def _outcome(job: Callable[..., Any], ctx: Context, args: tuple[Any, ...]) -> tuple[Any, ...]:
    try:
        return ("ok", job(ctx, *args))
    except APIError as e:
        return ("error", e.status, e.message, e.param, e.code, e.headers, e.detail)


def _ping() -> bool:
    return _context is not None


# ---- the pool, as the router's loop sees it -------------------------------------------------------


class Preparation:
    """Runs the jobs above: inline for small bodies, else in the bounded worker pool."""

    def __init__(
        self, config: RouterConfig, models: ServedModels, metrics: RouterMetrics | None = None
    ) -> None:
        self.config, self.context, self.metrics = config, Context(models, config), metrics
        self.workers = config.parse_workers
        self.capacity = config.parse_workers + config.parse_queue  # running + waiting
        self.share = max(1, self.capacity // 2)  # of those, one key's at most
        # the models as the workers get them, made with the pool
        self._states: tuple[_ModelState, ...] | None = None
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.pending = 0
        self._owners: dict[str, int] = {}

    def inline(self, size: int) -> bool:
        """Whether a body of `size` bytes is prepared on the loop."""
        return self.workers == 0 or size <= self.config.parse_inline_bytes

    async def run(self, key: ApiKey | None, size: int, job: Callable[..., Any], *args: Any) -> Any:
        """`job(context, *args)` for a body of `size` bytes sent with `key`: its value, or its APIError."""
        if self.inline(size):
            return job(self.context, *args)
        owner = key.key_id if key is not None else None
        if self.pending >= self.capacity:
            self._count("busy")
            raise unavailable(
                "the router is busy preparing other large requests; retry later", self.config.retry_after_s
            )
        if owner is not None and self._owners.get(owner, 0) >= self.share:
            self._count("key_share")
            raise APIError(
                429,
                f"too many large requests of API key {key.key_id!r} are being prepared at once "  # type: ignore[union-attr]
                f"(at most {self.share}); retry when one has been answered",
                None,
                "rate_limit_exceeded",
                headers={"Retry-After": str(max(1, self.config.retry_after_s))},
            )
        loop = asyncio.get_running_loop()
        self._pending(+1)
        if owner is not None:
            self._owners[owner] = self._owners.get(owner, 0) + 1

        def done(_: object) -> None:  # the job is over in the worker, whether or not anyone still waits
            self._pending(-1)
            if owner is not None:
                left = self._owners[owner] - 1
                if left:
                    self._owners[owner] = left
                else:
                    del self._owners[owner]

        lost = "the router could not prepare this request; retry later"
        try:
            pool = await asyncio.to_thread(self._executor) if self._pool is None else self._pool
            cf = pool.submit(_in_worker, job, args)
        except BrokenProcessPool as e:  # a worker died since the last job: a new pool for the next
            done(None)
            self._broken(pool)
            raise unavailable(lost, self.config.retry_after_s) from e
        except BaseException:
            done(None)
            raise
        cf.add_done_callback(lambda f: loop.call_soon_threadsafe(done, f))
        try:
            outcome = await asyncio.wrap_future(cf)
        except BrokenProcessPool as e:
            self._broken(pool)
            raise unavailable(lost, self.config.retry_after_s) from e
        if outcome[0] == "ok":
            return outcome[1]
        status, message, param, code, headers, detail = outcome[1:]
        raise APIError(status, message, param, code, headers, detail)

    def _pending(self, change: int) -> None:
        self.pending += change
        if self.metrics is not None:
            self.metrics.parse_jobs.set(self.pending)

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.parse_refused.labels(reason).inc()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                if self._states is None:
                    self._states = tuple(_ModelState.of(m.info) for m in self.context.models.models)
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=functools.partial(_start_worker, self.config, self._states),
                )
            return self._pool

    def _broken(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                log.error("a request preparation worker died; starting the pool again")
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    async def warm(self) -> None:
        """Start every worker now (a router that serves), not on the first large body."""
        if not self.workers:
            return
        pool = await asyncio.to_thread(self._executor)
        futures = [asyncio.wrap_future(pool.submit(_ping)) for _ in range(self.workers)]
        await asyncio.gather(*futures, return_exceptions=True)

    async def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, True, cancel_futures=True)


def parse_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers parse reads, as a plain dict (what a worker gets)."""
    return {h: headers[h] for h in PARSE_HEADERS if h in headers}


__all__ = [
    "Context",
    "Prepared",
    "Preparation",
    "parse_headers",
    "prepare_detokenize",
    "prepare_generation",
    "prepare_tokenize",
]
