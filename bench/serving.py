"""End-to-end serving: one real stack (Redis, prefill, decode, two routers), one workload run through
the split path (prefill service + KV push) and through the colocated path (prefill on the decode
service), and the router's own overhead per request."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import httpx
import numpy as np

from bench.loadgen import Result, Spec, arrival_offsets, make_specs, run_load, send, summarize
from common.cluster.redis_server import RedisServer
from common.protocol import DecodeFrame, ErrorFrame, FrameReader, GenerateRequest, TokenFrame, encode
from common.sampling_params import SamplingParams
from common.text.model_info import load_model_info
from common.text.tokenizer import Tokenizer

PLOT = os.path.join("docs", "img", "serving_latency.png")
SPLIT_THRESHOLD, LOCAL_THRESHOLD = 1, 100_000  # every prompt split / none


class Stack:
    """Service processes on 127.0.0.1, each logging to its own file; stop() ends every one."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.by_url: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, role: str, *flags: str, timeout_s: float = 180.0, port: int | None = None) -> str:
        """Start `splitserve <role> <flags>` (on `port`, default any free one) and wait until /health
        answers; its URL."""
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        log_path = os.path.join(self.log_dir, f"{role}-{port}.log")
        with open(log_path, "a") as log:  # the child keeps its own descriptor
            cmd = [sys.executable, "-m", "splitserve", role, "--port", str(port), *flags]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.by_url[f"http://127.0.0.1:{port}"] = proc
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"{role} exited with {proc.returncode}:\n{f.read()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    return url
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"{role} not healthy after {timeout_s:.0f} s (log: {log_path})")

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


async def router_overhead(router_url: str, decode_url: str, tok: Tokenizer, n: int) -> tuple[float, float]:
    """p50 (ms) of a one-token, non-streaming completion through the (local-path) router, and of the
    same prompt ids sent straight to the decode service; alternated so drift hits both alike."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    ids = tok.encode(prompt)  # what the router's tokenizer makes of it
    body = {"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    via_router, direct = [], []
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(n + 3):  # the first three warm both paths
            t0 = time.perf_counter()
            resp = await client.post(f"{router_url}/v1/completions", json=body)
            resp.raise_for_status()
            t1 = time.perf_counter()
            msg = GenerateRequest(f"bench-direct-{i}", ids, sampling, mode="local", deadline=time.time() + 30)
            await _generate_direct(client, decode_url, msg)
            t2 = time.perf_counter()
            if i >= 3:
                via_router.append(t1 - t0)
                direct.append(t2 - t1)
    return float(np.median(via_router)) * 1000, float(np.median(direct)) * 1000


async def _generate_direct(client: httpx.AsyncClient, decode_url: str, msg: GenerateRequest) -> None:
    headers = {"content-type": "application/msgpack"}
    url = f"{decode_url}/internal/generate"
    async with client.stream("POST", url, content=encode(msg), headers=headers) as resp:
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _flat(prefix: str, summary: dict[str, Any], results: list[Result]) -> dict[str, Any]:
    routes = sorted({r.route for r in results if r.route})
    return {f"{prefix}_{k}": v for k, v in summary.items()} | {f"{prefix}_routes": ",".join(routes)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    info = load_model_info(args.model)
    tok = info.tokenizer
    n, rate = args.requests, args.rate
    model_flags = ["--model", args.model] if args.model else []
    engine_flags = [*model_flags, "--threads", str(args.threads)]
    run_timeout = arrival_offsets(n, rate, args.seed)[-1] + args.request_timeout_s
    redis = RedisServer()
    log_dir = tempfile.mkdtemp(prefix="splitserve-bench-")
    stack = Stack(log_dir)
    try:
        redis.start()
        shared = ["--redis-url", redis.url]
        stack.start("prefill", *shared, *engine_flags)
        decode_url = stack.start("decode", *shared, *engine_flags)
        urls = {
            "split": stack.start(
                "router", *shared, *model_flags, "--local-prefill-threshold", str(SPLIT_THRESHOLD)
            ),
            "colocated": stack.start(
                "router", *shared, *model_flags, "--local-prefill-threshold", str(LOCAL_THRESHOLD)
            ),
        }
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
        via_router, direct = asyncio.run(router_overhead(urls["colocated"], decode_url, tok, args.overhead_n))
        plot(runs, PLOT)
    finally:
        stack.stop()
        redis.stop()
    errs = [r.error for rs in runs.values() for r in rs if r.error]
    return out | {
        "router_p50_ms": round(via_router, 2),
        "direct_p50_ms": round(direct, 2),
        "router_overhead_ms": round(via_router - direct, 2),
        "errors": len(errs),
        "first_error": errs[0] if errs else None,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "plot": PLOT,
        "logs": log_dir,
    }
