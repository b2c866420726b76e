"""`splitserve bench goodput --engine sim`: split (xPyD) against colocated serving on the same number of
simulated GPUs, DistServe-style (issue 33, point 6).

For each configuration on `--goodput-gpus` simulated GPUs of `--goodput-profile` (a worker holds the
profile's TP GPUs, so N GPUs are N / TP workers):
- colocated: N / TP decode services that prefill every prompt themselves (the router's
  `--local-prefill-threshold` above any prompt; no prefill service runs);
- xPyD for every x + y = N / TP (x, y >= 1): x prefill and y decode services, the router sending every
  prompt to a prefill service (`--local-prefill-threshold 1`) and the KV over TCP to the decode service;

real processes throughout: a Redis (common/cluster/redis_server.py), one `splitserve sim-fleet` process
holding the configuration's services, one router, all on 127.0.0.1. Every configuration's stack starts up
front and the rate points run in rounds, one point of each configuration in turn (reversed every other
round), so outside load on this shared box lands on every configuration alike.
Every service runs the same engine settings (`--goodput-max-num-seqs`, the engine's default chunked
prefill budget), so neither side is tuned alone.

The workload (bench/loadgen.py): Poisson arrivals, lognormal prompt and output lengths shaped like
DistServe's settings (`WORKLOADS`), outputs forced with `ignore_eos`, streamed and timed per chunk; the
same seed gives the same lengths and arrival times at a given rate on every configuration, and each
point's prompts start with their own salt, so no prefix cache helps any point.

The sweep, per configuration (`next_rate`): rates from `--goodput-start-rate`, doubling while SLO
attainment (the share of all requests meeting both the TTFT and the TPOT objective; an error misses)
stays >= `--goodput-target`, halving while it does not; then bisection between the highest passing and
the lowest failing rate until they are within `--goodput-resolution` of each other. A configuration's
goodput is the highest passing rate below its lowest failing one (`max_rate`). `goodput_ratio` = the
best xPyD's goodput over colocated's.

`--goodput-time-scale` k runs the sim k times slower than the profile's GPU (`slowed`): attainment at
rate r / k with SLOs x k is the modeled GPU's at r, while the host's own costs (HTTP, SSE, Python, other
work on the box) shrink against the steps. Rates are reported per second of this box and, in
`max_rate_modeled`, x k.

SLOs default from the profile (`default_slos`): TPOT `TPOT_SLO_SCALE` x the profile's pure decode step
at a reference batch (tight: a decode step that carries a prefill chunk breaks it; this is the regime
where DistServe reports its gains), TTFT `TTFT_SLO_SCALE` x the time to prefill the median prompt alone.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import psutil

from bench.fleet import routed, wait_for
from bench.loadgen import Result, arrival_offsets, make_specs, run_load, summarize
from bench.plots import pyplot, save
from bench.rounds import load_avg
from bench.serving import Stack, warm_up
from common.cluster.redis_server import RedisServer
from common.config import EngineConfig
from common.engine.sim_profile import SimProfile, step_seconds
from common.security.secret import ensure_for_children
from common.text.model_info import load_model_info

DEFAULT_PROFILE = "llama3-70b-h200-tp2"
SPLIT_THRESHOLD, LOCAL_THRESHOLD = 1, 1_000_000  # every prompt to a prefill service / none
TPOT_SLO_SCALE = 1.25  # x the pure decode step at the reference batch
TTFT_SLO_SCALE = 5.0  # x the lone prefill of the median prompt
REFERENCE_BATCH = 32  # decode rows in the reference step of the TPOT objective
PLOT_NAME = "goodput.png"


@dataclass(frozen=True)
class Workload:
    """Lognormal lengths (median, sigma, cap) of prompts and outputs, in tokens."""

    name: str
    prompt_median: float
    prompt_sigma: float
    prompt_cap: int
    out_median: float
    out_sigma: float
    out_cap: int
    about: str


WORKLOADS = {
    # DistServe's summarization setting (LongBench): long prompts, short outputs
    "summarization": Workload(
        "summarization", 1500, 0.4, 3500, 90, 0.4, 256,
        "DistServe's summarization setting (LongBench): long documents, short summaries",
    ),
    # DistServe's chatbot setting (ShareGPT): medium prompts, longer answers
    "chat": Workload(
        "chat", 700, 0.6, 3000, 200, 0.6, 600,
        "DistServe's chatbot setting (ShareGPT): medium prompts, longer answers",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """One configuration: `prefill` prefill services and `decode` decode services, each a worker of the
    profile's TP GPUs; colocated when prefill == 0."""

    prefill: int
    decode: int

    @property
    def name(self) -> str:
        return "colocated" if self.prefill == 0 else f"{self.prefill}P{self.decode}D"

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


def layouts(gpus: int, tp: int) -> list[Layout]:
    """Colocated and every xPyD (x, y >= 1) on `gpus` GPUs of workers of `tp` GPUs each. ValueError when
    the GPUs are not a whole number of workers, or too few to split."""
    if gpus < 1 or tp < 1:
        raise ValueError(f"--goodput-gpus {gpus}, TP {tp}: both must be at least 1")
    if gpus % tp:
        raise ValueError(f"--goodput-gpus {gpus}: not a multiple of the profile's TP {tp} (a worker's GPUs)")
    workers = gpus // tp
    if workers < 2:
        raise ValueError(
            f"--goodput-gpus {gpus}: {workers} worker of TP {tp}; a split needs at least 2 workers"
        )
    return [Layout(0, workers)] + [Layout(x, workers - x) for x in range(1, workers)]


def parse_layout(name: str, workers: int) -> Layout:
    """'colocated' or 'xPyD' (x + y == workers) as a Layout; ValueError naming what is wrong."""
    if name == "colocated":
        return Layout(0, workers)
    head, sep, tail = name.upper().partition("P")
    if not sep or not tail.endswith("D") or not head.isdigit() or not tail[:-1].isdigit():
        raise ValueError(f"--goodput-splits: {name!r} is not 'colocated' or 'xPyD' (e.g. 2P2D)")
    x, y = int(head), int(tail[:-1])
    if x < 1 or y < 1 or x + y != workers:
        raise ValueError(f"--goodput-splits: {name!r} needs x, y >= 1 and x + y = {workers} workers")
    return Layout(x, y)


def meets(r: Result, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """Both objectives met (bench/loadgen.py's goodput: an error misses, a one-token answer has no TPOT
    and meets it)."""
    if r.error is not None or r.ttft is None or r.ttft * 1000 > slo_ttft_ms:
        return False
    tpot = r.tpot
    return tpot is None or tpot * 1000 <= slo_tpot_ms


def attainment(results: Sequence[Result], slo_ttft_ms: float, slo_tpot_ms: float) -> float:
    """The share of `results` meeting both objectives (0 for none)."""
    if not results:
        return 0.0
    return sum(meets(r, slo_ttft_ms, slo_tpot_ms) for r in results) / len(results)


def _bracket(points: Mapping[float, float], target: float) -> tuple[float | None, float | None]:
    """(highest passing rate below the lowest failing one, lowest failing rate); None where none."""
    failing = [r for r, a in points.items() if a < target]
    hi = min(failing) if failing else None
    passing = [r for r, a in points.items() if a >= target and (hi is None or r < hi)]
    return (max(passing) if passing else None), hi


def max_rate(points: Mapping[float, float], target: float) -> float | None:
    """A configuration's goodput: the highest rate meeting `target` below its lowest failing rate
    (a pass above a failure is noise, not capacity); None when no rate met it."""
    return _bracket(points, target)[0]


def next_rate(
    points: Mapping[float, float],
    start: float,
    target: float = 0.9,
    factor: float = 2.0,
    resolution: float = 0.25,
    min_rate: float = 0.05,
    max_rate_: float = 16.0,
) -> float | None:
    """The next rate to measure given {rate: attainment} so far, or None when the search is done: the
    coarse grid (start, then x factor while every point passes, / factor while none does), then bisection
    between the highest passing and the lowest failing rate until hi / lo <= 1 + resolution. Stops at
    `max_rate_` (the knee is beyond what this box can offer) and `min_rate` (nothing passes)."""
    if not points:
        return start
    lo, hi = _bracket(points, target)
    if hi is None:  # all passed: go up
        assert lo is not None
        up = lo * factor
        if lo >= max_rate_:
            return None
        return min(up, max_rate_)
    if lo is None:  # nothing passed below the lowest failure: go down
        down = hi / factor
        return down if down >= min_rate else None
    if hi / lo <= 1 + resolution:
        return None
    return round((lo + hi) / 2, 3)


def default_slos(profile: SimProfile, workload: Workload, chunk_budget: int) -> tuple[float, float]:
    """(TTFT, TPOT) objectives in ms for `workload` on `profile` (module doc): TTFT_SLO_SCALE x the
    profiled time to prefill the median prompt alone in chunks of `chunk_budget` tokens, TPOT_SLO_SCALE x
    a pure decode step of REFERENCE_BATCH sequences at the median prompt plus half the median output."""
    prompt = int(workload.prompt_median)
    prefill_s, done = 0.0, 0
    while done < prompt:
        n = min(chunk_budget, prompt - done)
        prefill_s += step_seconds(profile, [(n, done)])
        done += n
    ctx = int(workload.prompt_median + workload.out_median / 2)
    decode_s = step_seconds(profile, [(1, ctx)] * REFERENCE_BATCH)
    return round(TTFT_SLO_SCALE * prefill_s * 1000, 1), round(TPOT_SLO_SCALE * decode_s * 1000, 1)


def slowed(profile: SimProfile, scale: float) -> SimProfile:
    """`profile` on a GPU `scale` times slower: every step takes `scale` times its time (peak FLOP/s and
    bandwidth over scale, the per-step overhead times scale); KV capacity and everything else unchanged.
    Rates then scale by 1 / scale and latencies by scale, so SLO attainment at rate r / scale is the
    original's at r, while the host's own costs (HTTP, the router, Python) shrink against the steps."""
    if scale <= 0:
        raise ValueError(f"--goodput-time-scale {scale}: must be positive")
    gpu = profile.gpu.model_copy(
        update={
            "peak_flops": profile.gpu.peak_flops / scale,
            "memory_bandwidth": profile.gpu.memory_bandwidth / scale,
        }
    )
    eff = profile.efficiency.model_copy(
        update={"step_overhead_s": profile.efficiency.step_overhead_s * scale}
    )
    name = profile.name if scale == 1 else f"{profile.name}-x{scale:g}-slower"
    return profile.model_copy(update={"gpu": gpu, "efficiency": eff, "name": name})


def _idle(urls: Sequence[str], timeout_s: float) -> bool:
    """Wait until every service has nothing running or waiting and every KV block free."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = False
        for url in urls:
            try:
                h = httpx.get(url + "/health", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                busy = True
                break
            if h.get("running", 0) or h.get("waiting", 0) or h.get("free_blocks") != h.get("total_blocks"):
                busy = True
                break
        if not busy:
            return True
        time.sleep(0.3)
    return False


def _cpu(procs: Sequence[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


class Bench:
    """One configuration's stack (Redis, a sim-fleet process, a router) and its rate points."""

    def __init__(self, args: argparse.Namespace, layout: Layout, log_dir: str, profile_path: str) -> None:
        self.args, self.layout, self.log_dir, self.profile_path = args, layout, log_dir, profile_path
        self.redis = RedisServer()
        self.stack = Stack(log_dir)
        self.services: list[str] = []
        self.url = ""
        self.fleet: list[psutil.Process] = []
        self.router: psutil.Process | None = None

    def start(self) -> None:
        a, lay = self.args, self.layout
        self.redis.start()
        common = [
            "--redis-url", self.redis.url, "--sim-profile", self.profile_path,
            "--max-num-seqs", str(a.goodput_max_num_seqs),
        ]  # fmt: skip
        if a.goodput_max_batched_tokens is not None:
            common += ["--max-num-batched-tokens", str(a.goodput_max_batched_tokens)]
        if a.model:
            common += ["--model", a.model]
        # one sim-fleet process for the configuration's services, or one each (--goodput-procs service:
        # no two services share a GIL, as no two GPU workers share a host process)
        if a.goodput_procs == "service":
            shapes = [(1, 0)] * lay.prefill + [(0, 1)] * lay.decode
        else:
            shapes = [(lay.prefill, lay.decode)]
        ports: list[int] = []
        for p, d in shapes:
            flags = ("--prefill", str(p), "--decode", str(d), *common)
            base = self.stack.start_block(p + d, "sim-fleet", *flags, timeout_s=300)
            self.fleet.append(psutil.Process(self.stack.procs[-1].pid))
            ports += range(base, base + p + d)
        self.services = [f"http://127.0.0.1:{p}" for p in ports]
        threshold = SPLIT_THRESHOLD if lay.prefill else LOCAL_THRESHOLD
        model = ["--model", a.model] if a.model else []
        self.url = self.stack.start(
            "router", "--redis-url", self.redis.url, "--local-prefill-threshold", str(threshold), *model
        )
        self.router = psutil.Process(self.stack.procs[-1].pid)
        wait_for(lambda: routed(self.url, lay.decode, lay.prefill), 60, f"{self.url} to see the services")

    def stop(self) -> None:
        self.stack.stop()
        self.redis.stop()

    def point(self, rate: float, salt: int, tok: Any, workload: Workload) -> dict[str, Any]:
        """One rate: the workload at `rate` for about --goodput-duration-s (at least
        --goodput-min-requests requests), its attainment and figures."""
        a = self.args
        n = max(a.goodput_min_requests, math.ceil(rate * a.goodput_duration_s))
        specs = make_specs(
            tok, n, a.seed, salt=salt,
            prompt_median=workload.prompt_median, prompt_sigma=workload.prompt_sigma,
            prompt_cap=workload.prompt_cap, out_median=workload.out_median, out_sigma=workload.out_sigma,
            out_cap=workload.out_cap,
        )  # fmt: skip
        assert self.router is not None and self.fleet
        load = load_avg()
        r0, f0, m0 = _cpu([self.router]), _cpu(self.fleet), _cpu([psutil.Process()])
        # a request still running this long after the last arrival is cancelled and misses: the longest
        # answer meeting both objectives is done by then, so only requests that miss anyway are cut short
        drain = (a.slo_ttft_ms + workload.out_cap * a.slo_tpot_ms) / 1000 + a.goodput_drain_s
        last_arrival = arrival_offsets(n, rate, a.seed)[-1]
        results, duration = asyncio.run(
            run_load(self.url, specs, rate, a.seed, last_arrival + drain, a.request_timeout_s,
                     f"{self.layout.name} {rate:g} req/s")
        )  # fmt: skip
        cores = {
            "router_cpu_cores": round((_cpu([self.router]) - r0) / duration, 2),
            "fleet_cpu_cores": round((_cpu(self.fleet) - f0) / duration, 2),
            "loadgen_cpu_cores": round((_cpu([psutil.Process()]) - m0) / duration, 2),
        }
        idle = _idle(self.services, 60)
        want = "split" if self.layout.prefill else "local"
        routes = sorted({r.route for r in results if r.route})
        s = summarize(results, duration, a.slo_ttft_ms, a.slo_tpot_ms)
        errors = [r.error for r in results if r.error]
        return {
            "rate": rate,
            "requests": n,
            "attainment": round(attainment(results, a.slo_ttft_ms, a.slo_tpot_ms), 4),
            # each objective alone: which one a configuration misses
            "ttft_attainment": round(attainment(results, a.slo_ttft_ms, math.inf), 4),
            "tpot_attainment": round(attainment(results, math.inf, a.slo_tpot_ms), 4),
            **{k: s[k] for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "req_s",
                                 "errors", "duration_s")},
            "first_error": errors[0] if errors else None,
            "routes_ok": all(r.startswith(want) for r in routes),
            "idle_after": idle,
            "load": load,
            **cores,
        }  # fmt: skip


def plot(
    table: dict[str, list[dict[str, Any]]], target: float, path: str, title: str, time_scale: float = 1.0
) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, points in table.items():
        pts = sorted(points, key=lambda p: p["rate"])
        style: dict[str, Any] = {"color": "black", "linewidth": 2.2} if name == "colocated" else {}
        ax.plot([p["rate"] for p in pts], [100 * p["attainment"] for p in pts], "o-", label=name, **style)
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
    modeled = f"; x {time_scale:g} on the modeled GPUs" if time_scale != 1 else ""
    ax.set_xlabel(f"request rate (req/s offered, Poisson{modeled})")
    ax.set_ylabel("SLO attainment (% of requests)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    save(fig, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine != "sim":
        raise SystemExit(
            f"error: bench goodput: --engine {args.engine}: only --engine sim is supported (the comparison "
            "needs GPU-scale fleets; the torch engine on this box would measure the CPU)"
        )
    if args.goodput_workload not in WORKLOADS:
        raise SystemExit(
            f"error: --goodput-workload {args.goodput_workload!r}: choose from {', '.join(WORKLOADS)}"
        )
    for flag in ("goodput_duration_s", "goodput_start_rate", "goodput_max_rate"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be positive")
    if not 0 < args.goodput_target <= 1:
        raise SystemExit("error: --goodput-target must be in (0, 1]")
    load_before = load_avg()
    try:
        modeled = SimProfile.load(args.goodput_profile)
        profile = slowed(modeled, args.goodput_time_scale)
        tp = profile.tensor_parallel_size
        every = layouts(args.goodput_gpus, tp)
        wanted = [
            parse_layout(s.strip(), args.goodput_gpus // tp)
            for s in args.goodput_splits.split(",")
            if s.strip()
        ]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    chosen = [every[0]] + ([w for w in wanted if w.prefill] if wanted else every[1:])
    workload = WORKLOADS[args.goodput_workload]
    budget = args.goodput_max_batched_tokens or EngineConfig.model_fields["max_num_batched_tokens"].default
    ttft_default, tpot_default = default_slos(profile, workload, budget)
    args.slo_ttft_ms = args.slo_ttft_ms if args.slo_ttft_ms is not None else ttft_default
    args.slo_tpot_ms = args.slo_tpot_ms if args.slo_tpot_ms is not None else tpot_default
    tok = load_model_info(args.model).tokenizer
    ensure_for_children()
    log_dir = tempfile.mkdtemp(prefix="splitserve-goodput-")
    profile_path = os.path.join(log_dir, "profile.json")
    with open(profile_path, "w") as f:
        f.write(profile.model_dump_json(indent=2))
    table: dict[str, list[dict[str, Any]]] = {x.name: [] for x in chosen}
    points: dict[str, dict[float, float]] = {x.name: {} for x in chosen}
    t_start = time.monotonic()
    benches = [Bench(args, layout, log_dir, profile_path) for layout in chosen]
    try:
        for bench in benches:  # every stack up front: the rounds below interleave them
            bench.start()
            asyncio.run(warm_up(bench.url, tok, "split" if bench.layout.prefill else "local"))
        salt, round_ = 1, 0
        while True:  # a round: each configuration's next rate, in turn (reversed every other round)
            todo = []
            for bench in benches:
                pts = points[bench.layout.name]
                rate = next_rate(
                    pts, args.goodput_start_rate, args.goodput_target,
                    resolution=args.goodput_resolution, max_rate_=args.goodput_max_rate,
                )  # fmt: skip
                if rate is not None:
                    todo.append((bench, rate))
            if not todo:
                break
            for bench, rate in todo if round_ % 2 == 0 else reversed(todo):
                salt += 1
                p = bench.point(rate, salt, tok, workload)
                points[bench.layout.name][rate] = p["attainment"]
                table[bench.layout.name].append(p)
            round_ += 1
    finally:
        for bench in benches:
            bench.stop()
    best = {name: max_rate(pts, args.goodput_target) for name, pts in points.items()}
    colocated = best["colocated"]
    splits = {k: v for k, v in best.items() if k != "colocated"}
    best_split = max(splits, key=lambda k: splits[k] or 0.0) if splits else None
    split_rate = splits.get(best_split) if best_split else None
    ratio = round(split_rate / colocated, 3) if split_rate and colocated else None
    # each knee lies between its highest passing and its lowest failing rate: the ratio's bracket
    failing = {name: _bracket(pts, args.goodput_target)[1] for name, pts in points.items()}
    bracket = None
    if ratio is not None and best_split is not None:
        top, bottom = failing[best_split], failing["colocated"]
        assert split_rate is not None and colocated is not None
        bracket = [
            round(split_rate / bottom, 3) if bottom else None,
            round(top / colocated, 3) if top else None,
        ]
    path = os.path.join(args.out, PLOT_NAME)
    title = (
        f"{modeled.name} x {args.goodput_gpus} GPUs (sim {args.goodput_time_scale:g}x slower), "
        f"{workload.name}: SLO TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms"
    )
    plot(table, args.goodput_target, path, title, args.goodput_time_scale)
    return {
        "goodput_ratio": ratio,
        "best_split": best_split,
        "goodput_ratio_bracket": bracket,  # [best split's pass / colocated's failure, its failure / pass]
        "max_rate": best,  # req/s at >= target attainment; None: no rate met it
        "lowest_failing_rate": failing,  # None: none failed up to rate_cap
        "target_attainment": args.goodput_target,
        "rate_cap": args.goodput_max_rate,  # a max_rate equal to it: the knee is beyond what was offered
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "slo_defaults": {"ttft_ms": ttft_default, "tpot_ms": tpot_default},
        "profile": modeled.name,
        # the sim ran `time_scale` times slower than the profile's GPU: rates above are per second of
        # this box; on the modeled GPU they are time_scale times higher (SLOs above: this box's too)
        "time_scale": args.goodput_time_scale,
        "max_rate_modeled": {
            k: round(v * args.goodput_time_scale, 3) if v else None for k, v in best.items()
        },
        "tensor_parallel_size": tp,
        "gpus": args.goodput_gpus,
        "workload": {k: v for k, v in vars(workload).items()},
        "max_num_seqs": args.goodput_max_num_seqs,
        "max_num_batched_tokens": budget,
        "procs": args.goodput_procs,  # sim-fleet processes: one per configuration, or per service
        "seed": args.seed,
        "attainment_table": {
            name: {f"{p['rate']:g}": p["attainment"] for p in sorted(pts, key=lambda p: p["rate"])}
            for name, pts in table.items()
        },
        "points": table,
        "wall_s": round(time.monotonic() - t_start, 1),
        "cores": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_avg(),
        "plot": path,
        "logs": log_dir,
    }
