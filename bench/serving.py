"""End-to-end serving: one real stack (Redis, prefill, decode, three routers), one workload run through
the split path (prefill service + KV push) and through the colocated path (prefill on the decode
service), and the router's own overhead per request: without API keys, and with an API key that has
rate limits (its check and its Lua charge and refund on every request), alternated in rounds with the
same call made straight to the decode service and through the least a Python HTTP hop costs
(bench/hop_floor.py: the router's server stack and client, none of its work)."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import numpy as np
import psutil

from bench.loadgen import Result, Spec, arrival_offsets, make_specs, run_load, send, summarize
from bench.plots import pyplot, save
from bench.rounds import load_avg, ratio_keys, ratio_stats
from common.cluster.redis_server import RedisServer
from common.protocol import DecodeFrame, ErrorFrame, FrameReader, GenerateRequest, TokenFrame, encode
from common.sampling_params import SamplingParams
from common.security.internal_auth import SignedCalls
from common.security.secret import InternalSecret, ensure_for_children
from common.text.model_info import load_model_info
from common.text.tokenizer import Tokenizer

PLOT = os.path.join("docs", "img", "serving_latency.png")
# What a health check of a port nobody listens on yet may raise: OSError (refused), or, when the kernel
# connects the check to itself (TCP self-connect: its ephemeral source port is the port polled, which a
# port picked free a moment ago can be), its own request line read back as the answer
# (http.client.BadStatusLine). Either way: not up yet (the child then finds the port taken, and exits).
NOT_UP = (OSError, http.client.HTTPException)
SPLIT_THRESHOLD, LOCAL_THRESHOLD = 1, 100_000  # every prompt split / none


_SAMPLE = re.compile(r"^(splitserve_\w+)(?:\{([^}]*)\})? (\S+)$", re.MULTILINE)


def scrape(url: str) -> dict[str, float]:
    """A process's splitserve_* samples from its /metrics: {name or name{labels}: value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        f"{m.group(1)}{{{m.group(2)}}}" if m.group(2) else m.group(1): float(m.group(3))
        for m in _SAMPLE.finditer(text)
    }


def metric_sum(samples: dict[str, float], name: str, labels: str = "") -> float:
    """The sum of one metric's samples (those whose labels contain `labels`, e.g. 'tier="disk"')."""
    return sum(v for k, v in samples.items() if k.split("{", 1)[0] == name and labels in k)


T = TypeVar("T")
PORT_TRIES = 3  # starts on fresh ports after another process took a port found free (PortTaken)


class PortTaken(RuntimeError):
    """A child could not bind its port: another process took it between our finding it free and the
    child binding it (a busy machine runs other servers too)."""


def exited(role: str, code: int | None, log_text: str) -> RuntimeError:
    """What to raise for a child that exited before it served: PortTaken when its log says a port was
    taken (uvicorn's "address already in use", `splitserve up`'s "is taken"), RuntimeError else."""
    taken = "address already in use" in log_text or "is taken (" in log_text
    return (PortTaken if taken else RuntimeError)(f"{role} exited with {code}:\n{log_text[-2000:]}")


def on_fresh_ports(start: Callable[[], T], given: bool = False) -> T:
    """start(), which picks its ports itself, again while it raises PortTaken (PORT_TRIES times in all);
    once when its ports were `given` (the caller's to choose again)."""
    for attempt in range(1 if given else PORT_TRIES):
        try:
            return start()
        except PortTaken:
            if given or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def free_ports(n: int) -> int:
    """The first of n consecutive ports on 127.0.0.1 that are free now (another process may take one
    before a child binds it: Stack.start_block starts again then)."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


class Stack:
    """Service processes on 127.0.0.1, each logging to its own file; stop() ends every one."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.by_url: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self,
        role: str,
        *flags: str,
        timeout_s: float = 180.0,
        port: int | None = None,
        module: str = "splitserve",
    ) -> str:
        """Start `splitserve <role> <flags>` (on `port`, default any free one) and wait until /health
        answers; its URL. Another `module` runs as `python -m <module> <flags>` (`role` names its log).
        A port taken meanwhile by another process: PortTaken for a given `port`; a free one picked here
        is picked again (PORT_TRIES times)."""
        return on_fresh_ports(
            lambda: self._start(role, flags, timeout_s, free_ports(1) if port is None else port, module),
            given=port is not None,
        )

    def start_block(
        self, n: int, role: str, *flags: str, timeout_s: float = 180.0, module: str = "splitserve"
    ) -> int:
        """Start `splitserve <role> --port base <flags>`, a process serving on the n ports from base
        (a sim-fleet), on n consecutive free ports; again on fresh ones when a port was taken meanwhile
        (PORT_TRIES times). Returns base."""

        def once() -> int:
            base = free_ports(n)
            deadline = time.monotonic() + timeout_s
            self.start(role, *flags, port=base, timeout_s=timeout_s, module=module)
            # every port, not the first alone: a service of the block that could not bind takes the
            # process (its one event loop) down after the first already answered
            proc = self.by_url[f"http://127.0.0.1:{base}"]
            log_path = os.path.join(self.log_dir, f"{role}-{base}.log")
            for port in range(base + 1, base + n):
                self._wait_healthy(proc, f"http://127.0.0.1:{port}", role, log_path, deadline)
            return base

        return on_fresh_ports(once)

    def _start(self, role: str, flags: tuple[str, ...], timeout_s: float, port: int, module: str) -> str:
        log_path = os.path.join(self.log_dir, f"{role}-{port}.log")
        with open(log_path, "a") as log:  # the child keeps its own descriptor
            program = [role] if module == "splitserve" else []
            cmd = [sys.executable, "-m", module, *program, "--port", str(port), *flags]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.by_url[f"http://127.0.0.1:{port}"] = proc
        url = f"http://127.0.0.1:{port}"
        self._wait_healthy(proc, url, role, log_path, time.monotonic() + timeout_s)
        return url

    def _wait_healthy(
        self, proc: subprocess.Popen[bytes], url: str, role: str, log_path: str, deadline: float
    ) -> None:
        """Until `url`/health answers. If `proc` exits first it is forgotten, and PortTaken is raised
        when its log says a port was taken (RuntimeError else); RuntimeError past `deadline`."""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.procs.remove(proc)
                for u in [u for u, p in self.by_url.items() if p is proc]:
                    del self.by_url[u]
                with open(log_path, errors="replace") as f:
                    raise exited(role, proc.returncode, f.read())
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    return
            except NOT_UP:
                time.sleep(0.3)
        raise RuntimeError(f"{role} at {url} not healthy in time (log: {log_path})")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


async def warm_up(url: str, tok: Tokenizer, want_route: str, timeout_s: float = 60.0) -> None:
    """Two requests (not measured) once the router routes as expected: the services' first-request
    costs stay out of the numbers, and a split router has seen the prefill service register."""
    spec = make_specs(tok, 1, seed=12345, salt=9, prompt_median=64, prompt_sigma=0.0, out_median=4)[0]
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while True:
            r = await send(client, url, spec, timeout_s)
            if r.error is None and r.route.startswith(want_route):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"warm-up on {url}: route {r.route!r}, error {r.error!r}")
            await asyncio.sleep(0.5)
        await send(client, url, spec, timeout_s)


async def router_overhead(
    router_url: str, auth_url: str, api_key: str, decode_url: str, floor_url: str, tok: Tokenizer, n: int
) -> dict[str, list[float]]:
    """Latencies (s) of a one-token, non-streaming completion through the (local-path) router without
    keys ("open"), through one requiring a rate-limited key ("auth"), of the same prompt ids sent
    straight to the decode service ("direct") and through the bare hop of bench/hop_floor.py ("floor");
    in rounds of the four, so drift hits each alike."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    ids = tok.encode(prompt)  # what the router's tokenizer makes of it
    body = {"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    floor_body = {"prompt_ids": ids, "max_tokens": 1}
    times: dict[str, list[float]] = {"open": [], "auth": [], "direct": [], "floor": []}
    signed = SignedCalls(InternalSecret.from_env())  # the services check the cluster secret
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(n + 3):  # the first three warm every path
            t0 = time.perf_counter()
            resp = await client.post(f"{router_url}/v1/completions", json=body)
            resp.raise_for_status()
            t1 = time.perf_counter()
            resp = await client.post(
                f"{auth_url}/v1/completions", json=body, headers={"authorization": f"Bearer {api_key}"}
            )
            resp.raise_for_status()
            t2 = time.perf_counter()
            msg = GenerateRequest(f"bench-direct-{i}", ids, sampling, mode="local", deadline=time.time() + 30)
            await _generate_direct(client, decode_url, msg, signed)
            t3 = time.perf_counter()
            resp = await client.post(f"{floor_url}/v1/completions", json=floor_body)
            resp.raise_for_status()
            t4 = time.perf_counter()
            if i >= 3:
                times["open"].append(t1 - t0)
                times["auth"].append(t2 - t1)
                times["direct"].append(t3 - t2)
                times["floor"].append(t4 - t3)
    return times


# What the OpenAI features cost per output token, against plain sampling (same prompt, same seed, 32 tokens
# each). The regex allows far more than 32 tokens, so a guided request runs its full length too.
FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "extra": {"repetition_penalty": 1.2}},
    "guided": {"extra": {"structured_outputs": {"regex": "[a-z ,.]{400}"}}},
}
FEATURE_TOKENS = 32


async def feature_cost(router_url: str, rounds: int) -> dict[str, list[float]]:
    """Per request, the time per output token after the first (s) of a streamed completion with each of
    FEATURES, in rounds (one of each per round, in turn) so drift hits each alike."""
    prompt = "Write a short story about a lighthouse keeper and a storm."
    times: dict[str, list[float]] = {name: [] for name in FEATURES}
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(rounds + 1):  # the first round warms every path (and compiles the grammar)
            for name, opts in FEATURES.items():
                body = {
                    "model": "default", "prompt": prompt, "max_tokens": FEATURE_TOKENS, "temperature": 0.8,
                    "seed": 7, "stream": True, "ignore_eos": True,
                    **{k: v for k, v in opts.items() if k != "extra"}, **opts.get("extra", {}),
                }  # fmt: skip
                stamps: list[float] = []
                async with client.stream("POST", f"{router_url}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            stamps.append(time.perf_counter())
                if i > 0 and len(stamps) > 2:
                    # chunks carry one token each here (no stop strings), the last one the finish reason
                    times[name].append((stamps[-2] - stamps[0]) / (len(stamps) - 2))
    return times


def _create_key(redis_url: str) -> str:
    """An API key whose limits are never reached but are checked and charged on every request."""
    from common.cluster.state import connect
    from router.auth.keys import KeyStore, Limits

    async def create() -> str:
        r = connect(redis_url)
        try:
            limits = Limits(rpm=1_000_000, tpm=1_000_000_000, max_concurrent=10_000)
            secret, _ = await KeyStore(r).create("bench", "bench", limits=limits)
            return secret
        finally:
            await r.aclose()

    return asyncio.run(create())


IDLE_S = 5.0


def _cpu_s(procs: dict[str, psutil.Process], over_s: float = 0.0) -> dict[str, float]:
    """Each process's CPU seconds (user + system) so far; with over_s, its CPU per second over that
    long (the caller sends nothing meanwhile)."""
    before = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
    if not over_s:
        return before
    time.sleep(over_s)
    return {k: (sum(p.cpu_times()[:2]) - before[k]) / over_s for k, p in procs.items()}


async def _generate_direct(
    client: httpx.AsyncClient, decode_url: str, msg: GenerateRequest, auth: httpx.Auth
) -> None:
    headers = {"content-type": "application/msgpack"}
    url = f"{decode_url}/internal/generate"
    async with client.stream("POST", url, content=encode(msg), headers=headers, auth=auth) as resp:
        resp.raise_for_status()
        reader = FrameReader(DecodeFrame)
        async for chunk in resp.aiter_raw():
            for f in reader.feed(chunk):
                if isinstance(f, ErrorFrame):
                    raise RuntimeError(f"decode service: {f.error}")
                if isinstance(f, TokenFrame) and f.finished:
                    return
    raise RuntimeError("decode stream ended before the request finished")


async def phases(url: str, results: list[Result]) -> dict[str, float]:
    """Median time (ms) between consecutive states of the requests' records (the router keeps them in
    Redis): where a request's time goes, e.g. `phase_prefilling_to_transferring_ms` is prefill compute."""
    gaps: dict[str, list[float]] = {}
    async with httpx.AsyncClient(timeout=10) as client:
        for r in results:
            resp = await client.get(f"{url}/v1/requests/{r.request_id}") if r.request_id else None
            if resp is None or resp.status_code != 200:
                continue
            history = resp.json().get("history", [])
            for (a, ta), (b, tb) in zip(history, history[1:], strict=False):
                gaps.setdefault(f"phase_{a}_to_{b}_ms", []).append(float(tb) - float(ta))
    return {k: round(float(np.median(v)) * 1000, 1) for k, v in gaps.items()}


def plot(runs: dict[str, list[Result]], path: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=120)
    for (label, results), color in zip(runs.items(), ("tab:blue", "tab:orange"), strict=False):
        ok = [r for r in results if r.error is None]
        for ax, xs in (
            (axes[0], [r.ttft * 1000 for r in ok if r.ttft is not None]),
            (axes[1], [t * 1000 for r in ok if (t := r.tpot) is not None]),
        ):
            xs = sorted(xs)
            ax.step(xs, np.arange(1, len(xs) + 1) / max(1, len(xs)), where="post", label=label, color=color)
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms per output token)"), strict=True):
        ax.set_xlabel(name)
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("split (prefill service + KV push) vs colocated (prefill on decode), same workload")
    save(fig, path)


def _flat(prefix: str, summary: dict[str, Any], results: list[Result]) -> dict[str, Any]:
    routes = sorted({r.route for r in results if r.route})
    return {f"{prefix}_{k}": v for k, v in summary.items()} | {f"{prefix}_routes": ",".join(routes)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load_avg()
    info = load_model_info(args.model)
    tok = info.tokenizer
    n, rate = args.requests, args.rate
    model_flags = ["--model", args.model] if args.model else []
    engine_flags = [*model_flags, "--threads", str(args.threads)]
    run_timeout = arrival_offsets(n, rate, args.seed)[-1] + args.request_timeout_s
    ensure_for_children()  # the stack's processes share a secret, as in any deployment
    redis = RedisServer()
    log_dir = tempfile.mkdtemp(prefix="splitserve-bench-")
    stack = Stack(log_dir)
    try:
        redis.start()
        shared = ["--redis-url", redis.url]
        stack.start("prefill", *shared, *engine_flags)
        decode_url = stack.start("decode", *shared, *engine_flags)
        # the key made below turns auth on for every router on this Redis; these two opt out explicitly
        shared += ["--allow-unauthenticated"]
        urls = {
            "split": stack.start(
                "router", *shared, *model_flags, "--local-prefill-threshold", str(SPLIT_THRESHOLD)
            ),
            "colocated": stack.start(
                "router", *shared, *model_flags, "--local-prefill-threshold", str(LOCAL_THRESHOLD)
            ),
        }
        auth_url = stack.start(
            "router", "--redis-url", redis.url, *model_flags, "--local-prefill-threshold",
            str(LOCAL_THRESHOLD), "--require-api-key",
        )  # fmt: skip
        api_key = _create_key(redis.url)
        floor_url = stack.start("hop-floor", "--decode-url", decode_url, module="bench.hop_floor")
        runs: dict[str, list[Result]] = {}
        out: dict[str, Any] = {"rate": rate, "requests": n}
        for salt, (name, url) in enumerate(urls.items(), start=1):
            asyncio.run(warm_up(url, tok, "split" if name == "split" else "local"))
            # same seed: same lengths and texts; the salt only keeps the prefix caches cold
            specs: list[Spec] = make_specs(tok, n, args.seed, salt=salt)
            results, duration = asyncio.run(
                run_load(url, specs, rate, args.seed, run_timeout, args.request_timeout_s, name)
            )
            runs[name] = results
            out |= {f"{name}_{k}": v for k, v in asyncio.run(phases(url, results)).items()}
            out |= _flat(name, summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms), results)
            if name == "split":
                out["prompt_tokens_p50"] = int(np.median([s.prompt_tokens for s in specs]))
                out["output_tokens_p50"] = int(np.median([s.max_tokens for s in specs]))
        routers = {
            k: psutil.Process(stack.by_url[u].pid)
            for k, u in (("open", urls["colocated"]), ("auth", auth_url), ("floor", floor_url))
        }
        idle = _cpu_s(routers, IDLE_S)  # background work (registry, KV index, heartbeats) per second
        t0, cpu0 = time.monotonic(), _cpu_s(routers)
        times = asyncio.run(
            router_overhead(urls["colocated"], auth_url, api_key, decode_url, floor_url, tok, args.overhead_n)
        )
        busy, cpu1 = time.monotonic() - t0, _cpu_s(routers)
        # each router served n + 3 one-token requests meanwhile: its CPU less its background rate's share
        router_cpu = {k: (cpu1[k] - cpu0[k] - idle[k] * busy) / (args.overhead_n + 3) for k in routers}
        features = asyncio.run(feature_cost(urls["colocated"], args.feature_rounds))
        plot(runs, PLOT)
    finally:
        stack.stop()
        redis.stop()
    load_after = load_avg()
    errs = [r.error for rs in runs.values() for r in rs if r.error]
    p50 = {k: float(np.median(v)) * 1000 for k, v in times.items()}
    # per round: what the router adds over the direct call, with and without keys and limits
    open_extra = np.subtract(times["open"], times["direct"]) * 1000
    auth_extra = np.subtract(times["auth"], times["direct"]) * 1000
    floor_extra = np.subtract(times["floor"], times["direct"]) * 1000
    over_floor = np.subtract(times["open"], times["floor"]) * 1000
    plain = np.array(features["plain"])
    for name, vals in features.items():
        out[f"feature_{name}_tpot_p50_ms"] = round(float(np.median(vals)) * 1000, 2)
        if name != "plain":  # per round: the feature's time per token over plain sampling's
            ratio = np.array(vals) / plain
            out[f"feature_{name}_ratio_p50"] = round(float(np.median(ratio)), 3)
            out[f"feature_{name}_ratio_iqr"] = [round(float(x), 3) for x in np.percentile(ratio, [25, 75])]
    return out | {
        "router_p50_ms": round(p50["open"], 2),
        "router_auth_p50_ms": round(p50["auth"], 2),
        "direct_p50_ms": round(p50["direct"], 2),
        "router_overhead_ms": round(p50["open"] - p50["direct"], 2),
        "router_overhead_auth_ms": round(p50["auth"] - p50["direct"], 2),
        "auth_overhead_ms": round(p50["auth"] - p50["open"], 2),
        "router_overhead_iqr_ms": [round(float(x), 2) for x in np.percentile(open_extra, [25, 75])],
        # load-independent: the router process's CPU (user + system) per one-token request
        "router_cpu_ms_per_request": round(router_cpu["open"] * 1000, 2),
        "router_cpu_ms_per_request_auth": round(router_cpu["auth"] * 1000, 2),
        "router_idle_cpu_fraction": round(idle["open"], 4),  # of one core, with no request in flight
        "router_overhead_auth_iqr_ms": [round(float(x), 2) for x in np.percentile(auth_extra, [25, 75])],
        # the baseline: a bare Python HTTP hop (bench/hop_floor.py), what any router in Python pays
        "hop_floor_overhead_ms": round(p50["floor"] - p50["direct"], 2),
        "hop_floor_overhead_iqr_ms": [round(float(x), 2) for x in np.percentile(floor_extra, [25, 75])],
        "hop_floor_cpu_ms_per_request": round(router_cpu["floor"] * 1000, 2),
        # per round, the open router over the floor: the router's own work on the request's path
        "router_over_floor_ms": round(float(np.median(over_floor)), 2),
        "router_over_floor_iqr_ms": [round(float(x), 2) for x in np.percentile(over_floor, [25, 75])],
        # the paired figure in every bench's terms: per round, the open router's latency over direct
        **ratio_keys(ratio_stats(times["open"], times["direct"])),
        "load_before": load_before,
        "load_after": load_after,
        "errors": len(errs),
        "first_error": errs[0] if errs else None,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "plot": PLOT,
        "logs": log_dir,
    }
