"""`splitserve bench fleet`: the router in front of a fleet of simulated workers (`--engine sim`).

Two parts:
1. step accuracy: a sim engine in this process at low load (1 and 16 sequences decoding, and a prefill
   chunk), each step's wall time (engine.step(), scheduling included) over the profile's time for the
   batch it ran; the median ratio and its spread per batch shape.
2. fleet: Redis, `--fleet-procs` `splitserve sim-fleet` processes holding --fleet-prefill + --fleet-decode
   services between them, --fleet-routers routers, then open-loop Poisson arrivals of short requests at
   --rate for --fleet-duration-s, spread over the routers. Reported: offered vs achieved rate, errors,
   end-to-end latency, router CPU per request (its process's user + system time over the run, and the
   system share of it), and, from a sample of the requests' records, the router's queued -> reserved
   time (placement plus the decode service's reservation round trip: an upper bound on placement
   time, which the router does not time on its own), the fleet's RSS and the load generator's own CPU.
   With --fleet-rates (a sweep) one fleet serves every rate, each through one router and through all
   --fleet-routers in turn, and the points are plotted: achieved against offered rate, and end-to-end
   p50/p99, a line per router count (<--out>/fleet.png).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import tempfile
import time
from collections import Counter, defaultdict
from typing import Any

import httpx
import numpy as np
import psutil

from bench.plots import pyplot, save
from bench.rounds import load_avg
from bench.serving import Stack, scrape
from common.cluster.redis_server import RedisServer
from common.config import EngineConfig
from common.engine.sim import SimEngine, SimRunner
from common.sampling_params import SamplingParams

PROFILE = "llama3-8b-h100"
PLOT_NAME = "fleet.png"


def step_accuracy(steps: int = 40) -> dict[str, Any]:
    """Wall time of engine.step() over the profiled time of the step it ran, at low load (module doc)."""
    engine = SimEngine(EngineConfig(engine="sim", sim_profile=PROFILE, max_num_seqs=16))
    runner = engine.runner
    assert isinstance(runner, SimRunner)
    fresh = iter(range(1000, 10**6))  # token ids never used before: no prefix-cache hit

    def measure(
        batch: int, prompt_len: int, max_tokens: int, want_prefill: bool
    ) -> tuple[list[float], float]:
        for _ in range(batch):
            ids = [next(fresh) for _ in range(prompt_len)]
            engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        ratios, profiled = [], 0.0
        while engine.has_unfinished():
            t0 = time.perf_counter()
            result = engine.step()
            wall = time.perf_counter() - t0
            if (result.num_tokens > result.num_scheduled) == want_prefill:
                ratios.append(wall / runner.last_duration)
                profiled = runner.last_duration
        return ratios, profiled

    shapes = {
        "decode_b1": lambda: measure(1, 64, steps, False),
        "decode_b16": lambda: measure(16, 64, steps, False),
        "prefill_512": lambda: measure(1, 512, 1, True),
    }
    out: dict[str, Any] = {}
    for label, run in shapes.items():
        ratios: list[float] = []
        profiled = 0.0
        while len(ratios) < (10 if label.startswith("prefill") else steps - 2):
            more, profiled = run()
            ratios += more
        out[label] = {
            "steps": len(ratios),
            "profile_ms": round(profiled * 1e3, 3),
            "wall_over_profile_median": round(float(np.median(ratios)), 4),
            "min": round(min(ratios), 4),
            "max": round(max(ratios), 4),
        }
    return out


LOAD_CLIENTS = 16  # the load generator's connection pools (_load)


def split_evenly(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def routed(url: str, decode: int, prefill: int) -> bool:
    try:
        h = httpx.get(url + "/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    return bool(h.get("decode_workers", 0) >= decode and h.get("prefill_workers", 0) >= prefill)


async def _load(
    routers: list[str], rate: float, duration_s: float, max_tokens: int, seed: int
) -> dict[str, Any]:
    """Open-loop Poisson arrivals for duration_s, round-robin over the routers; every request is waited
    for (up to 30 s). Returns the latencies, errors and request ids."""
    rng = random.Random(seed)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    ids: list[str] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with contextlib.AsyncExitStack() as stack:
        # LOAD_CLIENTS pools, request i on pool i % LOAD_CLIENTS: httpcore's per-request bookkeeping walks
        # every connection of its pool (quadratic in the requests in flight), which saturated a single
        # pool's load generator at 60-80 req/s here, before the router it measures
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(timeout=30, limits=limits))
            for _ in range(LOAD_CLIENTS)
        ]

        async def one(i: int) -> None:
            client = clients[i % LOAD_CLIENTS]
            body = {
                "model": "default",
                "prompt": f"Request {i}: say something short.",
                "max_tokens": max_tokens,
            }
            t0 = time.perf_counter()
            try:
                r = await client.post(routers[i % len(routers)] + "/v1/completions", json=body)
            except httpx.HTTPError as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                return
            if r.status_code != 200:
                errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1
                return
            latencies.append(time.perf_counter() - t0)
            ids.append(routers[i % len(routers)] + "/v1/requests/" + r.headers["x-request-id"])

        tasks = []
        start = time.perf_counter()
        next_at, i = start, 0
        while next_at < start + duration_s:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            next_at += rng.expovariate(rate)
        sent_s = time.perf_counter() - start
        await asyncio.gather(*tasks)
        done_s = time.perf_counter() - start
        sample = rng.sample(ids, min(200, len(ids)))
        placements, decodes = [], []
        for url in sample:
            rec = (await clients[0].get(url)).json()
            decodes.append(rec.get("decode_id"))
            stamps = dict((s, t) for s, t in rec.get("history", []))
            if "queued" in stamps and "reserved" in stamps:
                placements.append(stamps["reserved"] - stamps["queued"])
    return {"sent": i, "sent_s": sent_s, "done_s": done_s, "latencies": latencies, "errors": errors,
            "placements": placements, "decodes": decodes}  # fmt: skip


def _ms(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1e3, 2) if xs else None


def fleet_rates(spec: str | None, rate: float) -> list[float]:
    """--fleet-rates "30,60,120" (a sweep), or the one --rate."""
    if not spec:
        return [rate]
    try:
        rates = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"error: --fleet-rates {spec!r}: comma-separated request rates, e.g. 30,60,120"
        ) from None
    if not rates or min(rates) <= 0:
        raise SystemExit(f"error: --fleet-rates {spec!r}: every rate must be positive")
    return rates


def _cpu(pids: list[int]) -> float:
    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def _system_cpu(pids: list[int]) -> float:
    """Of _cpu, the time in the kernel (system calls: the sockets' sends and receives, the loop's polls)."""
    return sum(psutil.Process(pid).cpu_times().system for pid in pids)


def _point(
    routers: list[str], router_pids: list[int], fleet_pids: list[int], rate: float, args: argparse.Namespace
) -> dict[str, Any]:
    """One open-loop run at `rate` over `routers`: what the module doc lists."""
    load_before = load_avg()
    me = psutil.Process()
    fleet0, cpu0, me0 = _cpu(fleet_pids), _cpu(router_pids), sum(me.cpu_times()[:2])
    sys0 = _system_cpu(router_pids)
    placed0 = [_placement_buckets(url) for url in routers]
    gc0 = _gc_passes(routers)
    load = asyncio.run(_load(routers, rate, args.fleet_duration_s, args.fleet_output_tokens, args.seed))
    router_cpu = _cpu(router_pids) - cpu0
    router_sys = _system_cpu(router_pids) - sys0
    me_cpu = sum(me.cpu_times()[:2]) - me0
    placed: Counter[float] = Counter()
    for url, before in zip(routers, placed0, strict=True):
        placed.update({le: n - before.get(le, 0) for le, n in _placement_buckets(url).items()})
    fleet_cpu = _cpu(fleet_pids) - fleet0
    gc_passes = _gc_passes(routers)
    for k, v in gc0.items():
        gc_passes[k] -= v
    done = len(load["latencies"])
    return {
        "routers": len(routers),
        "offered_rps": rate,
        "sent": load["sent"],
        "sent_rps": round(load["sent"] / load["sent_s"], 1),
        "completed": done,
        "achieved_rps": round(done / load["done_s"], 1),
        "errors": load["errors"],
        "e2e_p50_ms": _ms(load["latencies"], 50),
        "e2e_p99_ms": _ms(load["latencies"], 99),
        # the router's own placement time (its histogram): the bucket edge under which the quantile falls
        "placement_p50_ms_at_most": _bucket_quantile(placed, 0.50),
        "placement_p99_ms_at_most": _bucket_quantile(placed, 0.99),
        "placement_over_2ms_share": _over(placed, 0.002),
        "queued_to_reserved_p50_ms": _ms(load["placements"], 50),
        "queued_to_reserved_p99_ms": _ms(load["placements"], 99),
        "router_cpu_ms_per_request": round(router_cpu / max(1, done) * 1e3, 3),
        # the routers' garbage-collector passes meanwhile (common/runtime/gc_pauses.py): full ones, and
        # the time every pass stopped the router for
        "router_gc_full_passes": int(gc_passes["count2"]),
        "router_gc_pause_ms": round(1e3 * sum(gc_passes[f"sum{g}"] for g in range(3)), 1),
        "router_gc_passes_by_generation": [int(gc_passes[f"count{g}"]) for g in range(3)],
        "router_gc_pause_ms_by_generation": [round(1e3 * gc_passes[f"sum{g}"], 1) for g in range(3)],
        # cyclic garbage: objects only the collector could free, per request served
        "router_gc_freed_per_request": round(sum(gc_passes[f"freed{g}"] for g in range(3)) / max(1, done), 1),
        "router_gc_full_pause_ms_max_bucket": _gc_full_max_ms(gc_passes),
        "router_cpu_cores": round(router_cpu / load["done_s"], 2),
        "router_cpu_system_share": round(router_sys / router_cpu, 3) if router_cpu > 0 else None,
        "loadgen_cpu_cores": round(me_cpu / load["done_s"], 2),
        "fleet_cpu_cores": round(fleet_cpu / load["done_s"], 2),
        # how the sampled requests spread over the decode services (router placement under this load)
        "decode_services_used": len(set(load["decodes"])),
        "busiest_decode_share": round(max(Counter(load["decodes"]).values()) / len(load["decodes"]), 3)
        if load["decodes"]
        else None,
        "load_before": load_before,
        "load_after": load_avg(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    rates = fleet_rates(args.fleet_rates, args.rate)
    sweep = len(rates) > 1
    if args.fleet_routers < 1:
        raise SystemExit("error: --fleet-routers must be at least 1")
    load_before = load_avg()
    accuracy = step_accuracy()
    prefill, decode, procs = args.fleet_prefill, args.fleet_decode, args.fleet_procs
    log_dir = tempfile.mkdtemp(prefix="splitserve-fleet-")
    redis = RedisServer().start()
    stack = Stack(log_dir)
    try:
        fleet_pids = []
        for p, d in zip(split_evenly(prefill, procs), split_evenly(decode, procs), strict=True):
            flags = [
                "--prefill",
                str(p),
                "--decode",
                str(d),
                "--redis-url",
                redis.url,
                "--sim-profile",
                PROFILE,
            ]
            stack.start_block(p + d, "sim-fleet", *flags, timeout_s=300)
            fleet_pids.append(stack.procs[-1].pid)
        routers = [stack.start("router", "--redis-url", redis.url) for _ in range(args.fleet_routers)]
        router_pids = [stack.procs[-1 - i].pid for i in reversed(range(args.fleet_routers))]
        for url in routers:
            wait_for(lambda url=url: routed(url, decode, prefill), 60, f"{url} to see the fleet")
        asyncio.run(_load(routers, min(rates[0], 20.0), 2.0, args.fleet_output_tokens, args.seed))  # warm-up
        # a sweep runs each rate through one router and through all of them, alternating which goes
        # first from one rate to the next, so drift in the box's load lands on both alike
        counts = sorted({1, args.fleet_routers}) if sweep else [args.fleet_routers]
        points = []
        for i, rate in enumerate(rates):
            for n in counts if i % 2 == 0 else counts[::-1]:
                points.append(_point(routers[:n], router_pids[:n], fleet_pids, rate, args))
        rss = sum(psutil.Process(pid).memory_info().rss for pid in fleet_pids)
    finally:
        stack.stop()
        redis.stop()
    head = {
        "profile": PROFILE,
        "step_accuracy": accuracy,
        "workers": prefill + decode,
        "prefill": prefill,
        "decode": decode,
        "fleet_processes": procs,
        "fleet_rss_mb": round(rss / 2**20),
        "duration_s": args.fleet_duration_s,
        "cores": os.cpu_count(),
    }
    if not sweep:
        return {**head, **points[0], "load_before": load_before, "load_after": load_avg()}
    points.sort(key=lambda p: (p["routers"], p["offered_rps"]))
    path = os.path.join(args.out, PLOT_NAME)
    plot(
        points,
        path,
        f"{prefill} prefill + {decode} decode sim workers ({PROFILE}), {args.fleet_duration_s:g} s a point",
    )
    return {**head, "points": points, "plot": path, "load_before": load_before, "load_after": load_avg()}


def plot(points: list[dict[str, Any]], path: str, title: str) -> None:
    """Achieved against offered rate, and end-to-end p50/p99, one line per router count."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    top = max(p["offered_rps"] for p in points)
    ax1.plot([0, top], [0, top], color="grey", linestyle="--", linewidth=1, label="offered")
    for n in sorted({p["routers"] for p in points}):
        pts = [p for p in points if p["routers"] == n]
        label = f"{n} router{'s' if n > 1 else ''}"
        x = [p["offered_rps"] for p in pts]
        line = ax1.plot(x, [p["achieved_rps"] for p in pts], "o-", label=label)[0]
        ax2.plot(x, [p["e2e_p50_ms"] or 0 for p in pts], "o-", color=line.get_color(), label=f"{label} p50")
        ax2.plot(x, [p["e2e_p99_ms"] or 0 for p in pts], "s--", color=line.get_color(), label=f"{label} p99")
    ax1.set_xlabel("offered rate (req/s, Poisson)")
    ax1.set_ylabel("achieved rate (req/s)")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set_xlabel("offered rate (req/s, Poisson)")
    ax2.set_ylabel("end-to-end latency (ms, log)")
    ax2.set_yscale("log")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save(fig, path)


def _placement_buckets(url: str) -> dict[float, float]:
    """The router's placement histogram: cumulative count per bucket edge (seconds; inf last)."""
    out = {}
    for key, value in scrape(url).items():
        if key.startswith("splitserve_router_placement_seconds_bucket{"):
            le = key.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = value
    return out


def _gc_passes(urls: list[str]) -> defaultdict[str | float, float]:
    """The routers' garbage-collector passes so far, added up: "count<g>" and "sum<g>" (seconds) per
    generation g, "freed<g>" (objects its passes freed), and per bucket edge (seconds, a float; inf last)
    the full passes' cumulative count."""
    out: defaultdict[str | float, float] = defaultdict(float)
    for url in urls:
        for key, value in scrape(url).items():
            if not key.startswith(("splitserve_gc_pause_seconds", "splitserve_gc_collected_objects_total")):
                continue
            gen = key.split('generation="', 1)[1][0]
            if key.startswith("splitserve_gc_pause_seconds_count"):
                out[f"count{gen}"] += value
            elif key.startswith("splitserve_gc_pause_seconds_sum"):
                out[f"sum{gen}"] += value
            elif key.startswith("splitserve_gc_collected_objects_total"):
                out[f"freed{gen}"] += value
            elif gen == "2":
                le = key.split('le="', 1)[1].split('"', 1)[0]
                out[float("inf") if le == "+Inf" else float(le)] += value
    return out


def _gc_full_max_ms(passes: defaultdict[str | float, float]) -> float | None:
    """The bucket edge (ms) the longest full pass falls under (None: none; inf: past the last edge)."""
    if not passes["count2"]:
        return None
    edges = sorted(k for k in passes if isinstance(k, float))
    return next((le * 1e3 for le in edges if passes[le] >= passes["count2"]), None)


def _bucket_quantile(cumulative: Counter[float], q: float) -> float | None:
    """The smallest bucket edge (ms) with at least q of the placements at or under it (an upper bound
    of the quantile; None without placements, inf past the last edge)."""
    total = cumulative.get(float("inf"), 0)
    if not total:
        return None
    edge = next(le for le in sorted(cumulative) if cumulative[le] >= q * total)
    return edge * 1e3


def _over(cumulative: Counter[float], seconds: float) -> float | None:
    """Share of placements over `seconds` (a bucket edge)."""
    total = cumulative.get(float("inf"), 0)
    return round(1 - cumulative.get(seconds, 0) / total, 4) if total else None
