"""`splitserve bench chaos-fleet`: the chaos scenarios at fleet scale, on simulated workers (issue 33,
point 7).

Redis, --chaos-prefill + --chaos-decode simulated services (`--engine sim`, llama3-8b-h100) in
`splitserve sim-fleet` processes (prefill services in --chaos-prefill-procs of them, decode services in
--chaos-decode-procs), and two routers sharing the Redis. Streaming requests run closed-loop,
--concurrency at a time, spread over the routers, for --chaos-duration-s, and three faults land under
that load, each with a real signal:

    at 20 %   SIGKILL of --chaos-kill-procs decode processes (10 % or more of the decode services:
              their streams must migrate to the others)
    at 45 %   Redis killed (SIGKILL) and restarted empty on the same port
    at 70 %   SIGKILL of the second router

A client does what a client of several routers does: a request whose router connection breaks (the
killed router) is sent again, once, to the other router. Counted:

    completed   the last try streamed to its end        failed   the last try ended with an error
    lost        a try the router accepted that neither reached an end the client saw (timed out) nor,
                when it ended 2 s or more after Redis came back, an end in its record (a try ended by the
                killed router must be recorded FAILED by the surviving one once the dead router's key
                expires; one in flight across the restart must have its record written again)
    leaked_blocks / leaked_leases   KV blocks in use on the surviving services and leases in Redis once
                                    nothing runs

Goal: lost 0, failed 0, leaked 0. Records of tries that ended before the Redis restart went with the
empty Redis and are not looked for (nor those of the 2 s after, whose end may have landed just before).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psutil
from tqdm import tqdm

from bench.fleet import PROFILE, routed, split_evenly, wait_for
from bench.rounds import load_avg
from bench.serving import Stack, metric_sum, scrape
from bench.soak import TERMINAL, Outcome, one, quiesce
from common.cluster.redis_server import RedisServer
from common.cluster.state import ClusterState

FAULTS = ((0.20, "decode"), (0.45, "redis"), (0.70, "router"))
RECORD_MARGIN_S = 2.0
# what a broken router connection looks like to the client (the try may be sent again)
BROKEN = ("RemoteProtocolError", "ReadError", "ConnectError", "WriteError", "ConnectTimeout")


def _start_fleet(stack: Stack, redis_url: str, prefill: int, decode: int) -> tuple[int, list[str]]:
    """One sim-fleet process holding `prefill` + `decode` services; its pid and its services' URLs."""
    flags = ["--prefill", str(prefill), "--decode", str(decode), "--redis-url", redis_url]
    base = stack.start_block(prefill + decode, "sim-fleet", *flags, "--sim-profile", PROFILE, timeout_s=300)
    pid = stack.procs[-1].pid
    return pid, [f"http://127.0.0.1:{p}" for p in range(base, base + prefill + decode)]


def _kill(pid: int) -> None:
    proc = psutil.Process(pid)
    proc.kill()
    proc.wait(30)


async def _drive(
    routers: list[str], args: argparse.Namespace, faults: dict[str, Any], fire: Any, pool: ThreadPoolExecutor
) -> list[list[tuple[Outcome, float]]]:
    """Closed-loop streams for the duration; each entry: the tries of one request (module doc), each
    with when it ended (seconds from the start, the clock of the faults' `at_s`)."""
    duration, conc = args.chaos_duration_s, args.concurrency
    alive = list(routers)
    results: list[list[tuple[Outcome, float]]] = []
    t0 = time.perf_counter()
    plan = list(FAULTS)
    fired: list[asyncio.Future[None]] = []
    limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8)
    bar = tqdm(total=round(duration), desc="chaos-fleet", unit="s", leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s), limits=limits) as client:

        async def request(i: int) -> None:
            body = {
                "model": "default",
                "prompt": f"Request {i}: tell me about the fleet.",
                "max_tokens": args.chaos_output_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            tries: list[tuple[Outcome, float]] = []
            for _ in range(2):
                url = alive[i % len(alive)]
                out = await one(client, url, body, None, args.request_timeout_s, t0)
                out.itls = []  # not needed; keeps the result small
                tries.append((out, time.perf_counter() - t0))
                broken = out.status == "failed" and (out.error or "").startswith(BROKEN)
                if not broken:
                    break
                if url in alive and len(alive) > 1 and not _answers(url):
                    alive.remove(url)  # that router is gone: the client stops sending to it
            results.append(tries)

        async def worker(k: int) -> None:
            i = k
            while time.perf_counter() - t0 < duration:
                await request(i)
                i += conc

        async def faults_on_time() -> None:
            while plan:
                at, what = plan[0]
                wait = t0 + at * duration - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(min(wait, 1.0))
                    bar.n = round(time.perf_counter() - t0)
                    bar.refresh()
                    continue
                plan.pop(0)
                faults[what] = {"at_s": round(time.perf_counter() - t0, 1)}
                # blocking work (kill, restart) on `pool`'s one thread, which outlives the run: Redis
                # dies with the thread that started it (its parent-death signal is per thread)
                fired.append(asyncio.get_running_loop().run_in_executor(pool, fire, what))

        await asyncio.gather(faults_on_time(), *(worker(k) for k in range(conc)))
        await asyncio.gather(*fired)  # a fault that could not be injected fails the run
    bar.close()
    return results


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


async def _record_states(redis_url: str, ids: list[str], timeout_s: float) -> dict[str, str]:
    """Each request's record state, waiting up to timeout_s for every one to reach an end."""
    state = ClusterState.from_url(redis_url)
    out: dict[str, str] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            for rid in ids:
                if out.get(rid) not in TERMINAL:
                    rec = await state.records.get(rid)
                    out[rid] = str(rec["state"]) if rec else "missing"
            if all(s in TERMINAL for s in out.values()) or time.monotonic() > deadline:
                return out
            await asyncio.sleep(1.0)
    finally:
        await state.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load_avg()
    prefill, decode = args.chaos_prefill, args.chaos_decode
    if args.chaos_kill_procs >= args.chaos_decode_procs:
        raise SystemExit("--chaos-kill-procs must leave at least one decode process alive")
    redis = RedisServer().start()
    pool = ThreadPoolExecutor(1, thread_name_prefix="faults")
    stack = Stack(tempfile.mkdtemp(prefix="splitserve-chaos-fleet-"))
    faults: dict[str, Any] = {}
    try:
        services: list[str] = []
        decode_pids: list[tuple[int, int]] = []  # (pid, decode services it holds)
        for p in split_evenly(prefill, args.chaos_prefill_procs):
            services += _start_fleet(stack, redis.url, p, 0)[1]
        for d in split_evenly(decode, args.chaos_decode_procs):
            pid, urls = _start_fleet(stack, redis.url, 0, d)
            decode_pids.append((pid, d))
            services += urls
        routers = [stack.start("router", "--redis-url", redis.url) for _ in range(2)]
        router_pids = [stack.by_url[url].pid for url in routers]
        for url in routers:
            wait_for(lambda url=url: routed(url, decode, prefill), 60, f"{url} to see the fleet")

        def fire(what: str) -> None:
            t = time.perf_counter()
            if what == "decode":
                killed = decode_pids[: args.chaos_kill_procs]
                for pid, _ in killed:
                    _kill(pid)
                faults[what]["decode_services_killed"] = sum(d for _, d in killed)
            elif what == "redis":
                redis.restart(kill=True)
            else:  # its figures first: they go with it
                faults[what]["migrations_before"] = metric_sum(
                    scrape(routers[1]), "splitserve_router_migrations_total"
                )
                _kill(router_pids[1])
            faults[what]["took_s"] = round(time.perf_counter() - t, 2)

        results = asyncio.run(_drive(routers, args, faults, fire, pool))
        restart = faults.get("redis", {})
        back_s = restart.get("at_s", 0.0) + restart.get("took_s", 0.0)  # Redis answered again by then
        tries = [t for r in results for t in r]
        accepted = [(t, end) for t, end in tries if t.accepted and t.request_id]
        # a try that ended before Redis was killed may have taken its record with the empty Redis, and so
        # may one the client saw end just after it came back (the router writes the end, then the last
        # frame reaches the client: under load that can take longer than the restart did); one that ended
        # RECORD_MARGIN_S after it was back must have an end in its record (restored, if it was in flight)
        checked = [t for t, end in accepted if end > back_s + RECORD_MARGIN_S]
        records = asyncio.run(_record_states(redis.url, [t.request_id for t in checked], 60.0))
        quiet = quiesce({str(i): u for i, u in enumerate(services)}, redis.url, timeout_s=60.0)
        survivor = scrape(routers[0])
    finally:
        stack.stop()
        redis.stop()
        pool.shutdown()
    lost = [t for t, _ in accepted if t.status == "lost"]
    lost += [t for t in checked if records.get(t.request_id) not in TERMINAL and t.status != "lost"]
    last = [r[-1][0] for r in results]
    return {
        "profile": PROFILE,
        "workers": prefill + decode,
        "prefill": prefill,
        "decode": decode,
        "routers": 2,
        "concurrency": args.concurrency,
        "duration_s": args.chaos_duration_s,
        "output_tokens": args.chaos_output_tokens,
        "faults": faults,
        "requests": len(results),
        "tries": len(tries),
        "retried_after_router_death": sum(1 for r in results if len(r) > 1),
        "completed": sum(1 for t in last if t.status == "completed"),
        "failed": sum(1 for t in last if t.status == "failed"),
        "failed_errors": sorted({(t.error or "")[:120] for t in last if t.status == "failed"})[:5],
        "lost": len(lost),
        "lost_ids": [t.request_id for t in lost][:10],
        "records_checked": len(checked),
        "records_by_state": dict(Counter(records.values())),
        "tries_ended_by_router_death_recorded_failed": sum(
            1 for t in checked if t.status == "failed" and records.get(t.request_id) == "failed"
        ),
        # both routers' (the killed one's as of just before its death)
        "migrations": metric_sum(survivor, "splitserve_router_migrations_total")
        + faults.get("router", {}).get("migrations_before", 0.0),
        "registry_stale_reads": metric_sum(survivor, "splitserve_router_registry_stale_reads"),
        **quiet,
        "load_before": load_before,
        "load_after": load_avg(),
    }
