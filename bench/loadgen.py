"""An open-loop load generator for an OpenAI-compatible `/v1/completions` endpoint.

Poisson arrivals at a fixed rate, lognormal prompt and output lengths (outputs forced with
`ignore_eos`), streamed answers timed per chunk: TTFT, ITL, TPOT, end-to-end latency, goodput.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from bench.workload import QUESTIONS, lognormal_lengths
from common.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Spec:
    """One request of the workload."""

    prompt: str
    prompt_tokens: int
    max_tokens: int


@dataclass
class Result:
    """What one request measured; times in seconds, all from the moment it was sent."""

    prompt_tokens: int
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)  # gaps between token chunks
    output_tokens: int = 0
    route: str = ""
    request_id: str = ""
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.error or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def sse_chunks(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI streaming response, as they arrive (the final [DONE] left out)."""
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def make_specs(
    tok: Tokenizer,
    n: int,
    seed: int,
    salt: int = 0,
    prompt_median: float = 100,
    prompt_sigma: float = 0.5,
    prompt_cap: int = 512,
    out_median: float = 24,
    out_sigma: float = 0.6,
    out_cap: int = 64,
) -> list[Spec]:
    """`n` requests; the same seed gives the same lengths and texts. Each prompt starts with
    `[salt-i]`, so two runs with different salts share no prefix (no prefix-cache hits across runs)
    while their token counts stay equal."""
    rng = random.Random(seed)
    prompt_lens = lognormal_lengths(n, prompt_median, prompt_sigma, prompt_cap, rng)
    out_lens = lognormal_lengths(n, out_median, out_sigma, out_cap, rng)
    specs = []
    for i, (p_len, o_len) in enumerate(zip(prompt_lens, out_lens, strict=True)):
        head = f"[{salt}-{i}] "
        sentences = QUESTIONS[:]
        rng.shuffle(sentences)
        body_ids = tok.encode(" ".join(sentences * (1 + p_len // 100)), add_special_tokens=False)
        budget = max(1, p_len - len(tok.encode(head, add_special_tokens=False)))
        prompt = head + tok.decode(body_ids[:budget])
        specs.append(Spec(prompt, len(tok.encode(prompt)), o_len))
    return specs


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at `rate` requests/s; the first at 0."""
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def send(client: httpx.AsyncClient, url: str, spec: Spec, timeout_s: float) -> Result:
    """One streamed completion, timed per token chunk; failures end up in Result.error."""
    body = {
        "model": "default",
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = Result(spec.prompt_tokens)
    t0 = time.perf_counter()
    last = t0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                res.route = resp.headers.get("x-splitserve-route", "")
                res.request_id = resp.headers.get("x-request-id", "")
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                    return res
                async for chunk in sse_chunks(resp):
                    now = time.perf_counter()
                    if "error" in chunk:
                        res.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                        return res
                    if chunk.get("usage"):
                        res.output_tokens = int(chunk["usage"]["completion_tokens"])
                    if any(c.get("text") for c in chunk.get("choices", [])):
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itls.append(now - last)
                        last = now
        res.e2e = time.perf_counter() - t0
        if res.ttft is None:
            res.error = "no token in the answer"
    except TimeoutError:
        res.error = f"timeout after {timeout_s:.0f} s"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(
    url: str, specs: list[Spec], rate: float, seed: int, timeout_s: float, request_timeout_s: float, desc: str
) -> tuple[list[Result], float]:
    """Send `specs` at Poisson times; the results (in spec order) and the run's duration (s).

    Requests still running `timeout_s` after the start are cancelled and reported as errors."""
    offsets = arrival_offsets(len(specs), rate, seed)
    limits = httpx.Limits(max_connections=len(specs) + 1, max_keepalive_connections=len(specs) + 1)
    bar = tqdm(total=len(specs), desc=desc, unit="req", leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s), limits=limits) as client:
        start = time.perf_counter()

        async def one(spec: Spec, at: float) -> Result:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            res = await send(client, url, spec, request_timeout_s)
            bar.update(1)
            return res

        tasks = [asyncio.ensure_future(one(s, at)) for s, at in zip(specs, offsets, strict=True)]
        await asyncio.wait(tasks, timeout=timeout_s)
        duration = time.perf_counter() - start
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    bar.close()
    results = [
        t.result() if not t.cancelled() else Result(s.prompt_tokens, error="run timeout")
        for t, s in zip(tasks, specs, strict=True)
    ]
    return results, duration


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1000, 1) if xs else None


def summarize(
    results: list[Result], duration: float, slo_ttft_ms: float, slo_tpot_ms: float
) -> dict[str, Any]:
    """Percentiles in ms, throughputs per second of the run, goodput as the share of all requests
    that met both objectives (an error misses; a one-token answer has no TPOT and meets it)."""
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    itl = [x for r in ok for x in r.itls]
    good = sum(
        1
        for r in ok
        if r.ttft is not None
        and r.ttft * 1000 <= slo_ttft_ms
        and (r.tpot is None or r.tpot * 1000 <= slo_tpot_ms)
    )
    out: dict[str, Any] = {}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = _pct(xs, q)
    out["tok_s"] = round(sum(r.output_tokens for r in ok) / duration, 2)
    out["req_s"] = round(len(ok) / duration, 3)
    out["goodput"] = round(good / len(results), 3) if results else 0.0
    out["errors"] = len(results) - len(ok)
    out["duration_s"] = round(duration, 1)
    return out
