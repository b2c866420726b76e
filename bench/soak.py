"""A soak under faults: many requests at bounded concurrency through a real stack with a spare of each
role (embedded Redis, two prefill and two decode services, the router), with clients that hang up
early, and one SIGKILL-and-restart (same ports) of a decode service and of a prefill service during the
run. What it counts is what the fault-tolerance work promises:

    completed   streamed to the end            failed     ended with an error (the client saw it)
    cancelled   the client hung up on purpose  lost       accepted, then neither finished nor failed:
                                                          timed out, or its record never reached an end
    leaked_blocks / leaked_leases   KV blocks in use and leases in Redis once everything is quiet
    rss_mb_start / rss_mb_end       each service's resident memory after warm-up and at the end
    trace                           every tenth of the run: each service's resident memory (and with
                                    --tiers the tiers' bytes and the disk folder's size)
    tiers (with --tiers)            the KV offload tiers' bytes (RAM and disk, from the services' metrics)
                                    and the disk folder's size after warm-up and at the end, their limits,
                                    and blocks written, read back, and failed to verify

plus TTFT and inter-token latency percentiles of the requests started around each fault (from 10 s
before to 20 s after), next to those of the rest. Goal: lost 0, leaked 0, failed 0, RSS flat.

With `--tiers` every service runs a RAM and a disk tier (one disk folder shared by all, a slot each) behind
a KV pool small enough to evict, and half of the requests ask again a prompt asked at least a few dozen
requests before (its blocks long evicted from the pool): the tiers are written and read under the same
faults. Goal added: 0 verify failures, tier bytes and the disk folder within their limits and flat.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from tqdm import tqdm

from bench.loadgen import make_specs, sse_chunks
from bench.serving import Stack, metric_sum, scrape
from common.cluster.redis_server import RedisServer
from common.cluster.state import ClusterState
from common.text.model_info import load_model_info

SERVICE_FLAGS = ("--threads", "1", "--kv-cache-mb", "256", "--lease-s", "2")
# --tiers: a pool that evicts within a few dozen requests (in blocks, whatever the model), and tiers
TIER_POOL_BLOCKS, TIER_RAM_GB, TIER_DISK_GB = 64, 0.04, 0.08
REPEAT_AFTER = 24  # a repeated prompt is one asked at least this many requests before
WINDOW_S = (10.0, 20.0)  # around a fault: from 10 s before to 20 s after
TERMINAL = {"finished", "failed", "cancelled"}


@dataclass
class Outcome:
    started: float
    request_id: str = ""
    accepted: bool = False  # the router answered 200: from here the request must reach an end
    status: str = "lost"  # completed | failed | cancelled | lost
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any], hang_up_after: int | None,
              timeout_s: float, t0: float) -> Outcome:  # fmt: skip
    out = Outcome(time.perf_counter() - t0)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                out.request_id = r.headers.get("x-request-id", "")
                if r.status_code != 200:
                    out.status, out.error = "failed", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return out
                out.accepted = True
                async for event in sse_chunks(r):
                    if "error" in event:
                        out.status, out.error = "failed", str(event["error"].get("message"))[:200]
                        return out
                    now = time.perf_counter()
                    if out.ttft is None:
                        out.ttft = now - start
                    else:
                        out.itls.append(now - last)
                    last, chunks = now, chunks + 1
                    if hang_up_after is not None and chunks >= hang_up_after:
                        out.status = "cancelled"
                        return out  # leaving the block closes the stream
        out.status = "completed"
    except TimeoutError:
        out.status, out.error = "lost", f"no end after {timeout_s:.0f} s"
    except httpx.HTTPError as e:
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"
    return out


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1000, 1) if xs else None


def _latency(outcomes: list[Outcome]) -> dict[str, float | None]:
    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    itl = [x for o in outcomes for x in o.itls]
    return {"ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99)}  # fmt: skip


def _rss_mb(stack: Stack, urls: dict[str, str]) -> dict[str, float]:
    out = {}
    for name, url in urls.items():
        try:
            out[name] = round(psutil.Process(stack.by_url[url].pid).memory_info().rss / 2**20, 1)
        except psutil.NoSuchProcess:
            out[name] = 0.0
    return out


def _health(url: str) -> dict[str, Any]:
    try:
        r = httpx.get(url + "/health", timeout=5)
        return dict(r.json())
    except httpx.HTTPError:
        return {}


def run(args: argparse.Namespace) -> dict[str, Any]:
    info = load_model_info(args.model)
    tok = info.tokenizer
    n, conc = args.requests, args.concurrency
    rng = random.Random(args.seed)
    model_flags = ["--model", args.model] if args.model else []
    redis = RedisServer().start()
    stack = Stack(tempfile.mkdtemp(prefix="splitserve-soak-"))
    tier_dir = Path(stack.log_dir) / "kv-tiers"
    tier_flags = (
        ["--kv-offload-ram-gb", str(TIER_RAM_GB), "--kv-offload-disk-dir", str(tier_dir),
         "--kv-offload-disk-gb", str(TIER_DISK_GB)]
        if args.tiers else []
    )  # fmt: skip
    if args.tiers:  # the services (this process's children) size their pools in blocks
        os.environ["SPLITSERVE_NUM_KV_BLOCKS"] = str(TIER_POOL_BLOCKS)
    load_before = psutil.getloadavg()
    try:
        shared = ["--redis-url", redis.url, *model_flags, *SERVICE_FLAGS, *tier_flags]
        urls = {f"prefill-{i}": stack.start("prefill", *shared) for i in range(2)}
        urls |= {f"decode-{i}": stack.start("decode", *shared) for i in range(2)}
        router = stack.start("router", "--redis-url", redis.url, *model_flags, "--decode-stall-s", "5")
        time.sleep(1.5)  # the router's registry cache sees every service
        specs = make_specs(tok, n, args.seed, prompt_median=48, prompt_sigma=0.6, prompt_cap=160,
                           out_median=12, out_sigma=0.5, out_cap=32)  # fmt: skip
        bodies = [
            {
                "model": "default",
                "prompt": s.prompt,
                "max_tokens": s.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }  # fmt: skip
            for s in specs
        ]
        if args.tiers:  # half ask again a prompt from long before (evicted to a tier by then)
            for i in range(REPEAT_AFTER, n):
                if rng.random() < 0.5:
                    bodies[i] = {**bodies[i], "prompt": bodies[rng.randrange(i - REPEAT_AFTER + 1)]["prompt"]}
        hang_ups = [rng.randint(1, 3) if rng.random() < args.disconnect_fraction else None for _ in specs]
        with httpx.Client(timeout=60) as c:
            for body in bodies[:2]:  # warm-up: the services' first requests stay out of the figures
                c.post(router + "/v1/completions", json={**body, "stream": False})
        rss_start = _rss_mb(stack, urls)
        tiers_start = _tier_sizes(urls, tier_dir) if args.tiers else {}
        faults: list[tuple[str, float]] = []
        trace: list[dict[str, Any]] = []

        def sample(i: int) -> None:
            tiers = _tier_sizes(urls, tier_dir) if args.tiers else {}
            trace.append({"request": i, "rss_mb": _rss_mb(stack, urls), **tiers})

        outcomes = asyncio.run(_load(stack, urls, router, bodies, hang_ups, conc, args, faults, sample))
        quiet = quiesce(urls, redis.url)
        rss_end = _rss_mb(stack, urls)
        tiers = {"start": tiers_start, **_tier_end(urls, tier_dir)} if args.tiers else None
        migrations = metric_sum(scrape(router), "splitserve_router_migrations_total")
        records = asyncio.run(_records(redis.url, [o.request_id for o in outcomes if o.accepted]))
    finally:
        stack.stop()
        redis.stop()
    # lost: accepted, and then no end the client saw (timeout) or no end in its record
    unended = {rid for rid, state in records.items() if state not in TERMINAL}
    lost = [o for o in outcomes if o.status == "lost" or (o.accepted and o.request_id in unended)]
    counts = {s: sum(o.status == s for o in outcomes) for s in ("completed", "failed", "cancelled")}
    errors = [o.error for o in outcomes if o.error]
    around = [
        {
            "role": role,
            "at_s": round(at, 1),
            **_latency([o for o in outcomes if at - WINDOW_S[0] <= o.started <= at + WINDOW_S[1]]),
        }  # fmt: skip
        for role, at in faults
    ]
    windows = [(at - WINDOW_S[0], at + WINDOW_S[1]) for _, at in faults]
    near = {id(o) for o in outcomes if any(a <= o.started <= b for a, b in windows)}
    calm = [o for o in outcomes if id(o) not in near]
    return {
        "requests": n,
        **counts,
        "lost": len(lost),
        "migrations": int(migrations),
        "leaked_blocks": quiet["leaked_blocks"],
        "leaked_leases": quiet["leaked_leases"],
        "rss_mb_start": rss_start,
        "rss_mb_end": rss_end,
        **({"tiers": tiers} if tiers is not None else {}),
        "trace": sorted(trace, key=lambda t: int(t["request"])),
        "faults": around,
        "calm": _latency(calm),
        "concurrency": conc,
        "disconnect_fraction": args.disconnect_fraction,
        "duration_s": round(max((o.started for o in outcomes), default=0.0), 1),
        "first_error": errors[0] if errors else None,
        "errors": [
            f"{o.request_id}: {o.status}: {o.error}" for o in outcomes if o.error and o.status != "cancelled"
        ][:10],
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in psutil.getloadavg()],
    }


async def _load(
    stack: Stack, urls: dict[str, str], router: str, bodies: list[dict[str, Any]], hang_ups: list[int | None],
    conc: int, args: argparse.Namespace, faults: list[tuple[str, float]], sample: Callable[[int], None],
) -> list[Outcome]:  # fmt: skip
    """Every request, `conc` at a time; kill and restart decode-0 at a third and prefill-0 at two thirds;
    `sample(i)` (on a thread of its own) as request i of every tenth of the run starts."""
    n = len(bodies)
    marks = {n * k // 10 for k in range(1, 10)}
    plan = {n // 3: "decode-0", 2 * n // 3: "prefill-0"}
    gate = asyncio.Semaphore(conc)
    bar = tqdm(total=n, desc="soak", unit="req", leave=False)
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:

        async def request(i: int) -> Outcome:
            async with gate:
                out = await one(client, router, bodies[i], hang_ups[i], args.request_timeout_s, t0)
            bar.update(1)
            return out

        tasks = []
        for i in range(n):
            if i in plan:
                name = plan[i]
                faults.append((name.split("-")[0], time.perf_counter() - t0))
                threading.Thread(target=_kill_and_restart, args=(stack, urls[name]), daemon=True).start()
            if i in marks:
                threading.Thread(target=sample, args=(i,), daemon=True).start()
            await gate.acquire()  # do not queue thousands of tasks at once
            gate.release()
            tasks.append(asyncio.ensure_future(request(i)))
            await asyncio.sleep(0)
        outcomes = list(await asyncio.gather(*tasks))
    bar.close()
    return outcomes


def _kill_and_restart(stack: Stack, url: str) -> None:
    proc = stack.by_url[url]
    proc.kill()
    proc.wait()
    cmd = [str(a) for a in proc.args]  # type: ignore[union-attr]
    role, flags = cmd[3], cmd[6:]  # python -m splitserve <role> --port <port> <flags...>
    stack.start(role, *flags, port=int(url.rsplit(":", 1)[1]))


def quiesce(urls: dict[str, str], redis_url: str, timeout_s: float = 30.0) -> dict[str, int]:
    """Once nothing runs any more: KV blocks still in use, leases still in Redis."""
    deadline = time.monotonic() + timeout_s
    while True:
        healths = [_health(u) for u in urls.values()]
        blocks = sum(int(h.get("total_blocks", 0)) - int(h.get("free_blocks", 0)) for h in healths)
        leases = asyncio.run(_lease_count(redis_url))
        if (blocks == 0 and leases == 0) or time.monotonic() > deadline:
            return {"leaked_blocks": blocks, "leaked_leases": leases}
        time.sleep(0.5)


async def _lease_count(redis_url: str) -> int:
    state = ClusterState.from_url(redis_url)
    try:
        return await state.leases.count()
    finally:
        await state.close()


async def _records(redis_url: str, ids: list[str]) -> dict[str, str]:
    """Each request's record state, once the writes that waited for Redis have landed."""
    state = ClusterState.from_url(redis_url)
    try:
        out: dict[str, str] = {}
        for _ in range(20):
            for rid in ids:
                if out.get(rid) not in TERMINAL:
                    rec = await state.records.get(rid)
                    out[rid] = str(rec["state"]) if rec else "missing"
            if all(s in TERMINAL for s in out.values()):
                break
            await asyncio.sleep(0.5)
        return out
    finally:
        await state.close()


def _scrape_all(urls: dict[str, str]) -> list[dict[str, float]]:
    """Every service's samples (bench.serving.scrape); none from one that does not answer (killed and
    restarting)."""
    out = []
    for u in urls.values():
        try:
            out.append(scrape(u))
        except httpx.HTTPError:
            continue
    return out


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def _tier_sizes(urls: dict[str, str], tier_dir: Path) -> dict[str, Any]:
    """Bytes each tier holds, summed over the services (their metrics), and the disk folder's size."""
    samples = _scrape_all(urls)
    return {
        "ram_bytes": int(sum(metric_sum(s, "splitserve_kv_tier_bytes", 'tier="ram"') for s in samples)),
        "disk_bytes": int(sum(metric_sum(s, "splitserve_kv_tier_bytes", 'tier="disk"') for s in samples)),
        "disk_folder_bytes": _disk_bytes(tier_dir),
    }


def _tier_end(urls: dict[str, str], tier_dir: Path) -> dict[str, Any]:
    """Sizes at the end, the limits, and what the tiers did (services' counters: a restarted service's
    count from its restart)."""
    samples = _scrape_all(urls)
    counts = {
        key: int(sum(metric_sum(s, f"splitserve_kv_tier_{key}_total") for s in samples))
        for key in ("writes", "hits", "verify_failures", "write_failures")
    }
    return {
        "end": _tier_sizes(urls, tier_dir),
        "limit": {
            "ram_bytes": int(TIER_RAM_GB * 2**30) * len(urls),
            "disk_bytes": int(TIER_DISK_GB * 2**30) * len(urls),
        },
        **counts,
    }
