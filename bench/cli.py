"""`splitserve bench <scenario>`: every scenario prints one JSON object as its last line."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any, cast

Scenario = Callable[[argparse.Namespace], dict[str, Any]]
# --requests when not given; 64 for the others
DEFAULT_REQUESTS = {"serving": 24, "soak": 5000, "kv-dtype": 20}
# --rounds when not given; 5 for the others. A round of batching or peer-hf runs the whole workload on
# each side (a smaller one would change the figure: the ratio grows with requests per batch slot).
DEFAULT_ROUNDS = {"batching": 3, "peer-hf": 3, "prefix": 2, "fairness": 2, "tp": 3, "tiers": 3}
# flags whose default depends on the scenario (None when not given): {flag's dest: {scenario: default}}
SCENARIO_DEFAULTS: dict[str, dict[str, Any]] = {
    "sessions": {"tiers": 6},  # prefix: 4
    "system_notes": {"tiers": 6},  # prefix: 10
    "kv_cache_mb": {"tiers": 32},
    "prompt_tokens": {"overlap": 2048, "window": 4096, "tier-load": 2048, "tier-stall": 2048},
    "slo_ttft_ms": {"goodput": None},  # goodput: derived from its profile and workload (bench/goodput.py)
    "slo_tpot_ms": {"goodput": None},
}
FALLBACK_DEFAULTS = {"sessions": 4, "system_notes": 10, "slo_ttft_ms": 2000.0, "slo_tpot_ms": 200.0}


SCENARIOS = {  # name -> module in bench/ with run(args); imported only when chosen, so a scenario
    # runs where only its own dependencies are installed (the GPU check's machine has no Redis client)
    "batching": "batching",
    "peer-hf": "peer_hf",
    "scheduler": "scheduler_cost",
    "roofline": "roofline",
    "sweep": "sweep",
    "serving": "serving",
    "transfer": "transfer",
    "overlap": "overlap",
    "soak": "soak",
    "prefix": "prefix",
    "fairness": "fairness",
    "kv-dtype": "kv_dtype",
    "tp": "tp",
    "matmul": "matmul",
    "tiers": "tiers",
    "tier-load": "tier_load",
    "tier-stall": "tier_stall",
    "fleet": "fleet",
    "chaos-fleet": "chaos_fleet",
    "window": "window",
    "planner": "planner",
    "goodput": "goodput",
    "slo-predict": "slo_predict",
}


def _scenario(name: str) -> Scenario:
    module = importlib.import_module(f"bench.{SCENARIOS[name]}")
    return cast(Scenario, module.run)


def _run(args: argparse.Namespace) -> int:
    # `all`: every figure; the soak and chaos-fleet (minutes of load and faults) run only when named
    only_named = ("soak", "chaos-fleet")
    names = [n for n in SCENARIOS if n not in only_named] if args.scenario == "all" else [args.scenario]
    if args.scenario != "all" and args.scenario not in SCENARIOS:
        print(
            f"error: unknown scenario {args.scenario!r}; choose from: all, {', '.join(SCENARIOS)}",
            file=sys.stderr,
        )
        return 2
    results: dict[str, Any] = {}
    for name in names:
        print(f"== bench {name}", file=sys.stderr)
        requests = args.requests or DEFAULT_REQUESTS.get(name, 64)
        rounds = args.rounds or DEFAULT_ROUNDS.get(name, 5)
        given = {
            k: v.get(name, FALLBACK_DEFAULTS.get(k))
            for k, v in SCENARIO_DEFAULTS.items()
            if vars(args)[k] is None
        }
        scenario_args = argparse.Namespace(**{**vars(args), **given, "requests": requests, "rounds": rounds})
        results[name] = _scenario(name)(scenario_args)
        if not args.json:
            for k, v in results[name].items():
                print(f"{name:>10}  {k:<32} {v}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.scenario}.json"), "w") as f:
        json.dump(results, f, indent=2)
    final = results[names[0]] if len(names) == 1 else results
    print(json.dumps(final))
    return 0


def add_bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="run a benchmark scenario (or 'all')")
    b.add_argument(
        "scenario",
        help="batching | peer-hf | scheduler | roofline | sweep | serving | transfer | overlap | soak | "
        "prefix | fairness | kv-dtype | tp | matmul | tiers | tier-load | tier-stall | fleet | chaos-fleet | "
        "window | planner | goodput | slo-predict | all",
    )
    b.add_argument("--json", action="store_true", help="print only progress and the JSON line")
    b.add_argument(
        "--requests", type=int, default=None, help="default 64 (serving: 24, soak: 5000, kv-dtype: 20)"
    )
    b.add_argument("--max-batch", type=int, default=16)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--model", default=None)
    b.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="batching, peer-hf")
    b.add_argument(
        "--kv-cache-mb",
        type=int,
        default=None,
        help="batching, peer-hf: KV cache size (1024); tp: the split services' (32); tiers: the decode "
        "services' KV pool (32)",
    )
    b.add_argument("--out", default="bench/out", help="folder for result JSON and plots")
    b.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="batching, peer-hf, transfer, overlap, matmul, roofline: rounds alternating the sides (A B, "
        "B A, ...); the ratio is the median of the per-round ratios (default 5; batching, peer-hf: 3, a "
        "whole workload each)",
    )
    s = b.add_argument_group("serving")
    s.add_argument("--rate", type=float, default=1.0, help="request arrivals per second (Poisson)")
    s.add_argument(
        "--slo-ttft-ms", type=float, default=None,
        help="time-to-first-token objective (2000; bench goodput: from its profile)",
    )  # fmt: skip
    s.add_argument(
        "--slo-tpot-ms", type=float, default=None,
        help="per-output-token objective (200; bench goodput: from its profile)",
    )  # fmt: skip
    s.add_argument("--request-timeout-s", type=float, default=60.0, help="per request")
    s.add_argument("--threads", type=int, default=1, help="torch threads per prefill/decode service")
    s.add_argument("--overhead-n", type=int, default=30, help="sequential requests for router_overhead_ms")
    s.add_argument(
        "--feature-rounds", type=int, default=8, help="rounds of plain/logprobs/penalties/guided requests"
    )
    x = b.add_argument_group("prefix")
    x.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="prefix: chat sessions run at once (4); tiers: sessions (6)",
    )
    x.add_argument("--turns", type=int, default=6, help="prefix, tiers: questions per session")
    x.add_argument(
        "--answer-tokens",
        type=int,
        default=16,
        help="prefix, fairness, kv-dtype, tp, tiers: tokens per answer",
    )
    x.add_argument(
        "--system-notes",
        type=int,
        default=None,
        help="prefix (10), tiers (6): course notes in each system prompt (~35 tokens each)",
    )
    x.add_argument(
        "--prefix-threshold", type=int, default=64, help="prefix: both routers' --local-prefill-threshold"
    )
    f = b.add_argument_group("fairness")
    f.add_argument("--phase-s", type=float, default=20.0, help="fairness: seconds per phase")
    f.add_argument("--fair-seqs", type=int, default=4, help="fairness: the decode services' max_num_seqs")
    f.add_argument("--victim-rate", type=float, default=0.5, help="fairness: tenant B's requests per second")
    f.add_argument(
        "--fair-budget", type=int, default=None, help="fairness: the decode services' max_num_batched_tokens"
    )
    f.add_argument(
        "--fair-bulk", type=int, default=0,
        help="fairness: the fair-share service's --fair-bulk-prefill-tokens (default 0: unbounded)",
    )  # fmt: skip
    f.add_argument(
        "--fair-burst-s", type=float, default=None,
        help="fairness: the fair-share service's --fair-burst-s (default: the service's, 2)",
    )  # fmt: skip
    r = b.add_argument_group("tiers")
    r.add_argument(
        "--tiers-ram-gb", type=float, default=0.25, help="tiers: the RAM tier of the ram configuration"
    )
    r.add_argument(
        "--tiers-disk-ram-gb",
        type=float,
        default=None,
        help="tiers: the RAM tier in front of the disk tier (default: the KV pool's size)",
    )
    r.add_argument("--tiers-disk-gb", type=float, default=1.0, help="tiers: the disk tier (in a temp dir)")
    r.add_argument(
        "--cold-disk",
        action="store_true",
        help="tier-stall: drop the disk tier's files from the page cache before each hit (cold reads)",
    )
    r.add_argument(
        "--disk-read-mbps",
        type=float,
        default=None,
        help="tier-stall: throttle the disk tier's device to this many MB/s of reads (a cgroup v1 blkio "
        "limit; needs root; implies --cold-disk)",
    )
    r.add_argument(
        "--compare",
        choices=["wait", "disk-reads"],
        default="wait",
        help="tier-stall: the two sides: the prefetch wait on and off (wait), or --kv-offload-disk-reads "
        "auto and always (disk-reads)",
    )
    r.add_argument(
        "--chat-template",
        default=None,
        help="tiers: the routers' --chat-template (a Jinja template or its file), for a --model without one",
    )
    t = b.add_argument_group("tp")
    t.add_argument(
        "--no-splits",
        action="store_true",
        help="tp: only the engines (TP=1 against TP=2), not the services split at TP 1->2 and 2->1",
    )
    gp = b.add_argument_group("goodput")
    gp.add_argument("--engine", default="sim", help="goodput: the engine (only sim is supported)")
    gp.add_argument(
        "--goodput-profile", default="llama3-70b-h200-tp2", help="goodput: the sim profile of every worker"
    )
    gp.add_argument(
        "--goodput-gpus", type=int, default=8, help="goodput: simulated GPUs per configuration (TP counted)"
    )
    gp.add_argument(
        "--goodput-workload", default="summarization", help="goodput: summarization | chat (DistServe-like)"
    )
    gp.add_argument(
        "--goodput-splits", default="", help="goodput: xPyD to compare, e.g. 1P3D,2P2D (default: all)"
    )
    gp.add_argument(
        "--goodput-time-scale", type=float, default=2.0,
        help="goodput: the simulated GPU this many times slower (host costs shrink against its steps)",
    )  # fmt: skip
    gp.add_argument(
        "--goodput-duration-s", type=float, default=15.0, help="goodput: seconds of arrivals a point"
    )
    gp.add_argument("--goodput-min-requests", type=int, default=24, help="goodput: requests a point at least")
    gp.add_argument("--goodput-start-rate", type=float, default=1.0, help="goodput: the search's first rate")
    gp.add_argument("--goodput-max-rate", type=float, default=16.0, help="goodput: the highest rate offered")
    gp.add_argument("--goodput-target", type=float, default=0.9, help="goodput: attainment that counts")
    gp.add_argument(
        "--goodput-resolution",
        type=float,
        default=0.25,
        help="goodput: bisect until pass/fail rates are this close",
    )
    gp.add_argument(
        "--goodput-drain-s", type=float, default=2.0,
        help="goodput: seconds past the longest answer's SLO time before a point's stragglers are cut",
    )  # fmt: skip
    gp.add_argument(
        "--goodput-max-num-seqs", type=int, default=128, help="goodput: every service's max_num_seqs"
    )
    gp.add_argument(
        "--goodput-procs", choices=("config", "service"), default="config",
        help="goodput: one sim-fleet process per configuration (its services share a GIL) or per service",
    )  # fmt: skip
    gp.add_argument(
        "--goodput-max-batched-tokens", type=int, default=None,
        help="goodput: every service's chunked-prefill budget (default: the engine's)",
    )  # fmt: skip
    fl = b.add_argument_group("fleet")
    fl.add_argument("--fleet-prefill", type=int, default=16, help="fleet: simulated prefill services")
    fl.add_argument("--fleet-decode", type=int, default=48, help="fleet: simulated decode services")
    fl.add_argument("--fleet-procs", type=int, default=4, help="fleet: sim-fleet processes holding them")
    fl.add_argument("--fleet-routers", type=int, default=1, help="fleet: routers sharing the Redis")
    fl.add_argument("--fleet-duration-s", type=float, default=20.0, help="fleet: seconds of arrivals")
    fl.add_argument("--fleet-output-tokens", type=int, default=4, help="fleet: max_tokens of each request")
    fl.add_argument(
        "--fleet-rates",
        default=None,
        help="fleet: a sweep, e.g. 15,30,60,120: each rate through 1 router and through --fleet-routers, "
        "with a plot (<--out>/fleet.png); default: one run at --rate",
    )
    pl = b.add_argument_group("planner")
    pl.add_argument("--planner-minutes", type=float, default=60.0, help="planner: virtual minutes of trace")
    pl.add_argument("--planner-peak-rps", type=float, default=100.0, help="planner: the trace's peak rate")
    pl.add_argument(
        "--planner-interval-s", type=float, default=15.0, help="planner: seconds between decisions"
    )
    pl.add_argument("--planner-startup-s", type=float, default=60.0, help="planner: a new worker's start-up")
    pl.add_argument("--planner-outage-min", type=float, default=5.0, help="planner: minutes without signals")
    pl.add_argument("--planner-budget", type=int, default=16, help="planner: workers in all, at most")
    pl.add_argument("--planner-max-role", type=int, default=8, help="planner: workers of one role, at most")
    pl.add_argument("--planner-ttft-s", type=float, default=1.0, help="planner: TTFT p90 target")
    pl.add_argument("--planner-tpot-s", type=float, default=0.05, help="planner: TPOT p90 target")
    pl.add_argument(
        "--planner-law",
        choices=["forecast", "reactive"],
        default="forecast",
        help="planner: the law whose figures are the JSON's top-level keys and the plot's (both are "
        "replayed; planner/forecast.py, planner/policy.py)",
    )
    pl.add_argument(
        "--planner-profile",
        default="llama3-8b-h100",
        help="planner: the simulated fleet's profile, a shipped name or a JSON file (`splitserve "
        "sim-calibrate` fits one to a GPU run: the capacity table written is then that hardware's)",
    )
    pl.add_argument(
        "--planner-capacity-out",
        metavar="FILE",
        help="planner: also write the capacity table measured on the simulated fleet (splitserve planner "
        "--capacity-table reads it)",
    )
    pl.add_argument(
        "--planner-frontier",
        action="store_true",
        help="planner: also replay the trace under other settings of the reactive law and three schedules "
        "that know the rate ahead, with a plot of SLO windows against worker-minutes "
        "(<--out>/planner_frontier.png)",
    )
    o = b.add_argument_group("soak")
    o.add_argument("--concurrency", type=int, default=8, help="soak, chaos-fleet: requests in flight at once")
    o.add_argument("--disconnect-fraction", type=float, default=0.1, help="soak: clients that hang up early")
    o.add_argument(
        "--tiers",
        action="store_true",
        help="soak: every service with a RAM and a disk KV tier behind a small pool; half the prompts repeat",
    )
    c = b.add_argument_group("chaos-fleet")
    c.add_argument("--chaos-prefill", type=int, default=8, help="chaos-fleet: simulated prefill services")
    c.add_argument("--chaos-decode", type=int, default=24, help="chaos-fleet: simulated decode services")
    c.add_argument(
        "--chaos-prefill-procs", type=int, default=2, help="chaos-fleet: processes holding the prefills"
    )
    c.add_argument(
        "--chaos-decode-procs", type=int, default=8, help="chaos-fleet: processes holding the decodes"
    )
    c.add_argument(
        "--chaos-kill-procs",
        type=int,
        default=1,
        help="chaos-fleet: decode processes SIGKILLed at 20 %% of the run",
    )
    c.add_argument("--chaos-duration-s", type=float, default=60.0, help="chaos-fleet: seconds of load")
    c.add_argument(
        "--chaos-output-tokens", type=int, default=48, help="chaos-fleet: max_tokens of each request"
    )
    k = b.add_argument_group("transfer, overlap")
    k.add_argument("--mib", type=int, default=64, help="transfer: MiB of KV moved per repetition")
    k.add_argument(
        "--reps", type=int, default=None, help="transfer: best of this many per side per round (3)"
    )
    k.add_argument(
        "--tp-pairs",
        default="1:2,2:1",
        help="transfer: prefill:decode tensor-parallel sizes moving the model's KV shards head by head, "
        "next to the 1:1 baseline ('' for none)",
    )
    k.add_argument("--backend", default="nixl", help="overlap: KV transfer backend")
    k.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="overlap, tier-load, tier-stall: prompt length (2048); window: (4096)",
    )
    b.set_defaults(func=_run)
