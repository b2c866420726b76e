"""Tenant fair share against FCFS on one decode service (issue: tenant fair share).

One real stack: two decode services that differ only in `--policy` (fcfs, fair; and `--fair-bulk`, if
given), each with a router of its own in front (every prompt prefilled on the decode service: admission
there is what is compared). Requests name their tenant with `x-splitserve-tenant` (auth off; with API
keys, the key's tenant). Per policy, in rounds that alternate the two (A B, B A, ...):

1. **victim alone**: tenant B sends at `--victim-rate` (Poisson) for `--phase-s` seconds: B's TTFT p99;
2. **flood**: tenant A sends at 10x B's rate while B sends the same requests at the same offsets as
   in 1 (same seed: only A's presence differs): B's TTFT p99 again, and
   `victim_ttft_p99_ratio` = flood / alone (goal <= 1.5 under fair share);
3. **both backlogged**: closed loops, A with 3x B's clients, both more than their share of the batch:
   output tokens each tenant received in the window where both had requests waiting, and Jain's
   fairness index of the two (equal weights; goal >= 0.95 under fair share), and what fair share
   costs: `throughput_ratio`, the tokens both received under fair share over those under FCFS.

`--fair-bulk N` runs the fair-share service with `--fair-bulk-prefill-tokens N` (default: unbounded):
other prefill work per step kept short, so that B's request arriving during a step soon starts.
`--fair-burst-s S` runs it with `--fair-burst-s S` (0: no burst allowance; default: the service's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from bench.loadgen import arrival_offsets, sse_chunks
from bench.plots import pyplot, save
from bench.rounds import alternate, load_avg, spread
from bench.serving import Stack
from bench.workload import QUESTIONS
from common.security.secret import ensure_for_children

POLICIES = ("fair", "fcfs")
PLOT = os.path.join("docs", "img", "fairness.png")
FLOOD = 10  # A's rate over B's


@dataclass
class Req:
    tenant: str
    sent: float = 0.0  # perf_counter
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter of every text chunk
    error: str | None = None


def prompt(rng: random.Random, tenant: str) -> str:
    q = " ".join(rng.choice(QUESTIONS) for _ in range(3))
    return f"Tenant {tenant}, ticket {rng.randrange(10**6)}: {q}"


async def send(client: httpx.AsyncClient, url: str, tenant: str, text: str, max_tokens: int) -> Req:
    body = {
        "model": "default",
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    r = Req(tenant, time.perf_counter())
    try:
        headers = {"x-splitserve-tenant": tenant}
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return r
            async for chunk in sse_chunks(resp):
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    r.ttft = r.ttft if r.ttft is not None else now - r.sent
                    r.token_times.append(now)
    except (httpx.HTTPError, asyncio.CancelledError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


async def open_loop(
    url: str, streams: dict[str, float], seconds: float, seed: int, max_tokens: int
) -> list[Req]:
    """Poisson arrivals per tenant (tenant -> rate) for `seconds`; waits for every answer."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()

        async def one(tenant: str, at: float, text: str) -> Req:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await send(client, url, tenant, text, max_tokens)

        tasks = []
        for tenant, rate in streams.items():
            # seeded by tenant name, not by position: with the same seed, a tenant sends the same
            # prompts at the same offsets whoever else is sending (the victim's alone and flood phases)
            tenant_seed = seed * 100 + zlib.crc32(tenant.encode()) % 100
            rng = random.Random(tenant_seed)
            n = max(1, int(rate * seconds * 1.5) + 5)
            offsets = [t for t in arrival_offsets(n, rate, tenant_seed) if t < seconds]
            tasks += [one(tenant, at, prompt(rng, tenant)) for at in offsets]
        return list(await asyncio.gather(*tasks))


async def closed_loop(
    url: str, clients: dict[str, int], seconds: float, seed: int, max_tokens: int
) -> dict[str, Any]:
    """`clients[t]` clients of tenant t each send one request after another for `seconds`; the tokens
    each tenant got while both were backlogged (the window after a warm-up, before the first stop)."""
    reqs: list[Req] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        stop = start + seconds

        async def loop(tenant: str, i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.perf_counter() < stop:
                reqs.append(await send(client, url, tenant, prompt(rng, tenant), max_tokens))

        await asyncio.gather(*(loop(t, i) for t, n in clients.items() for i in range(n)))
    lo, hi = start + seconds * 0.2, stop  # the first fifth fills the queues
    tokens = {t: sum(lo <= x < hi for r in reqs if r.tenant == t for x in r.token_times) for t in clients}
    xs = list(tokens.values())
    jain = sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0
    errors = [r.error for r in reqs if r.error]
    return {
        "tokens": tokens,
        "jain": jain,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def ttfts_ms(reqs: list[Req], tenant: str) -> list[float | None]:
    mine = sorted((r for r in reqs if r.tenant == tenant), key=lambda r: r.sent)
    return [None if r.ttft is None else round(r.ttft * 1000) for r in mine]


def p99_ms(reqs: list[Req], tenant: str) -> float:
    xs = [r.ttft for r in reqs if r.tenant == tenant and r.ttft is not None]
    return round(float(np.percentile(xs, 99)) * 1000, 1) if xs else float("nan")


def plot(results: dict[str, list[dict[str, Any]]], path: str) -> None:
    """B's TTFT p99 alone and under A's flood, and the tokens each tenant got while both were
    backlogged, per policy (medians over rounds)."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x, w = np.arange(len(POLICIES)), 0.35
    alone = [np.median([r["b_ttft_p99_alone_ms"] for r in results[p]]) for p in POLICIES]
    flood = [np.median([r["b_ttft_p99_flood_ms"] for r in results[p]]) for p in POLICIES]
    ax1.bar(x - w / 2, alone, w, label="B alone")
    ax1.bar(x + w / 2, flood, w, label="B while A sends 10x")
    ax1.set(
        xticks=x, xticklabels=POLICIES, ylabel="B's TTFT p99 (ms)", yscale="log", title="The light tenant"
    )
    for k, tenant in enumerate(("A", "B")):
        toks = [np.median([r["tokens"][tenant] for r in results[p]]) for p in POLICIES]
        ax2.bar(x + (k - 0.5) * w, toks, w, label=f"tenant {tenant}")
    ax2.set(xticks=x, xticklabels=POLICIES, ylabel="output tokens in the window", title="Both backlogged")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
    save(fig, path, dpi=110)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rate, seconds, max_tokens = args.victim_rate, args.phase_s, args.answer_tokens
    model_flags = ["--model", args.model] if args.model else []
    ensure_for_children()
    stack = Stack(tempfile.mkdtemp(prefix="splitserve-bench-fairness-"))
    load_before = load_avg()
    seeds = iter(range(1, 10_000))
    try:
        urls = {}
        for policy in POLICIES:
            decode = stack.start(
                "decode", *model_flags, "--threads", str(args.threads), "--policy", policy,
                "--max-num-seqs", str(args.fair_seqs),
                *(["--max-num-batched-tokens", str(args.fair_budget)] if args.fair_budget else []),
                *(["--fair-bulk-prefill-tokens", str(args.fair_bulk)] if policy == "fair" and args.fair_bulk
                  else []),
                *(["--fair-burst-s", str(args.fair_burst_s)]
                  if policy == "fair" and args.fair_burst_s is not None else []),
            )  # fmt: skip
            urls[policy] = stack.start(
                "router", *model_flags, "--decode-urls", decode, "--local-prefill-threshold", "100000"
            )
        for url in urls.values():  # first-request costs stay out
            asyncio.run(open_loop(url, {"warm": 2.0}, 2.0, 0, 4))

        def side(policy: str) -> dict[str, Any]:
            url = urls[policy]
            # B sends the same prompts at the same times in both phases: only A's flood differs
            seed = next(seeds)
            alone = asyncio.run(open_loop(url, {"B": rate}, seconds, seed, max_tokens))
            flood = asyncio.run(open_loop(url, {"A": rate * FLOOD, "B": rate}, seconds, seed, max_tokens))
            backlog = asyncio.run(
                closed_loop(
                    url, {"A": 3 * args.fair_seqs, "B": args.fair_seqs}, seconds, next(seeds), max_tokens
                )
            )
            errors = sum(r.error is not None for r in alone + flood) + backlog["errors"]
            first_error = next((r.error for r in alone + flood if r.error), backlog["first_error"])
            b_alone, b_flood = p99_ms(alone, "B"), p99_ms(flood, "B")
            print(f"  {policy}: B p99 alone {b_alone} ms, flooded {b_flood} ms; {backlog}", flush=True)
            print(f"    B's TTFTs (ms, in send order): alone {ttfts_ms(alone, 'B')}", flush=True)
            print(f"                                   flooded {ttfts_ms(flood, 'B')}", flush=True)
            return {
                "b_ttft_p99_alone_ms": b_alone,
                "b_ttft_p99_flood_ms": b_flood,
                "a_ttft_p99_flood_ms": p99_ms(flood, "A"),
                "ratio": b_flood / b_alone,
                "jain": backlog["jain"],
                "tokens": backlog["tokens"],
                "errors": errors,
                "first_error": first_error,
            }

        results = alternate({p: (lambda p=p: side(p)) for p in POLICIES}, args.rounds)  # type: ignore[misc]
    finally:
        stack.stop()
    plot(results, PLOT)
    out: dict[str, Any] = {
        "plot": PLOT,
        "rate_b": rate,
        "rate_a": rate * FLOOD,
        "phase_s": seconds,
        "max_num_seqs": args.fair_seqs,
        "max_num_batched_tokens": args.fair_budget or "default",
        "fair_bulk_prefill_tokens": args.fair_bulk or "default",
        "fair_burst_s": "default" if args.fair_burst_s is None else args.fair_burst_s,
        "rounds": args.rounds,
        "load_before": load_before,
        "load_after": load_avg(),
    }
    for policy, rs in results.items():
        prefix = "" if policy == "fair" else "fcfs_"
        ratio, jain = spread([r["ratio"] for r in rs]), spread([r["jain"] for r in rs])
        out[f"{prefix}victim_ttft_p99_ratio"] = ratio["median"]
        out[f"{prefix}victim_ttft_p99_ratio_spread"] = [ratio["min"], ratio["max"]]
        out[f"{prefix}jain_index"] = jain["median"]
        out[f"{prefix}jain_index_spread"] = [jain["min"], jain["max"]]
        for k in ("b_ttft_p99_alone_ms", "b_ttft_p99_flood_ms", "a_ttft_p99_flood_ms", "tokens"):
            out[f"{policy}_{k}"] = [r[k] for r in rs]
        out[f"{policy}_errors"] = sum(r["errors"] for r in rs)
        out[f"{policy}_first_error"] = next((r["first_error"] for r in rs if r["first_error"]), None)
    # what fair share costs: tokens served while both tenants are backlogged, fair over fcfs, per round
    pairs = zip(results["fair"], results["fcfs"], strict=True)
    served = spread([sum(f["tokens"].values()) / max(1, sum(c["tokens"].values())) for f, c in pairs])
    out["throughput_ratio"], out["throughput_ratio_spread"] = served["median"], [served["min"], served["max"]]
    return out
