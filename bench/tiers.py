"""KV offload tiers on multi-turn chat whose working set is several times the KV pool (issue 32).

Three real stacks, each its own Redis, one decode service and one router (no prefill service: every
request takes the local path, the decode service prefilling it), that differ only in what is behind the
decode service's KV pool (`--kv-cache-mb`, small):

* `pool`: nothing (tiers off): an evicted prefix block is recomputed;
* `ram`: a host-RAM tier (`--tiers-ram-gb`, room for every round's working set);
* `disk`: a RAM tier of the pool's size and a disk tier (`--kv-offload-disk-dir`, a temp dir): most of a
  session's history is gone from that RAM tier by its next turn, so what comes back comes from disk
  (blocks evicted twice: the reuse filter keeps a block off the disk until its second eviction).

The trace: `--sessions` chat sessions, `--turns` questions each; a turn's prompt is the session's whole
history (a system prompt of `--system-notes` course notes, every earlier question and greedy answer of
`--answer-tokens` tokens) plus a new question. The sessions take turns one request at a time (turn 1 of
every session, then turn 2, ...), so between two turns of a session every other session passes through
the pool and evicts it: the working set (every session's history) is `working_set_over_pool` times the
pool. Requests run one at a time, so a TTFT is one prompt's prefill, no queueing.

The configurations alternate in rounds (`bench/rounds.py`: A B C, C B A, ...); every configuration runs
the same sessions in a round (same salt), and a fresh salt each round keeps one round's KV from helping
the next. Reported per configuration and round: TTFT p50 (every turn, the first included) and p99, the
cached prompt tokens the responses report (`usage.prompt_tokens_details.cached_tokens`), and the decode
service's own counters (/metrics): pool prefix hits, tier hits and misses per tier, verify failures,
read latency. The JSON's headline keys:

* `ttft_p50_ratio_ram`, `ttft_p50_ratio_disk`: pool's TTFT p50 over ram's (disk's), the median of the
  per-round ratios, with min, max and IQR;
* `wrong_completions`: turns of `ram` and `disk` whose greedy answer is not `pool`'s, text for text;
* `predicted_vs_served_hits`: how well the router predicts tier hits (its KV index follows the pool and
  the tiers: KV events name each hash's tier). Per turn of the tier configurations' rounds, the prompt
  tokens the router predicted the decode service would reuse (`prefix_hit` of `x-splitserve-route`,
  in blocks, times the block size) against the cached tokens the response reported
  (`usage.prompt_tokens_details.cached_tokens`): sum of min(predicted, served) over sum of
  max(predicted, served), so 1.0 only when every turn is predicted exactly, and a miss or an
  overestimate both count; `service_counted_vs_served_hits` is the services' own side (pool prefix hits
  plus the blocks the tiers served, from /metrics, over the same cached tokens).

`{c}_{ram,disk}_hit_blocks` count the tiers' records read back: blocks, or with layer groups (Gemma 2/3)
pages, one per group a block keeps (`{c}_tier_hit_blocks` counts blocks of tokens); `pool_tokens` is
what the pool holds with every layer's KV (`/health`'s `total_blocks` over its `pages_per_block`).

`{pool,ram,disk}_prefetches_{started,dropped,completed,in_time,late}`: the decode service's prefetches
on arrival (common/kv/tiers.py; only `disk` has both tiers, so only it prefetches). Requests run one at
a time here, so a request is admitted in the engine step right after it arrives, and a prefetch is in
time only because the admission's own work before its tier read (scheduling, hashing the prompt,
copying the ~30 blocks it evicts out of the pool) takes about as long as the prefetch's read of files
from the page cache (a few ms a chunk). That read is a small part of a TTFT here, and costs about what
the RAM read that replaces it costs (both are mostly the checksum): this trace shows prefetch working,
not what it saves. What would: a cold disk (files not in the page cache, or a throttled device) and
requests that queue before admission (concurrent sessions).

Turns are `THINK_S` apart (a chat user's pause, far shorter than a real one): the tier write and the
KV event that follow one turn's evictions reach the router's index before the next turn is placed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from bench.plots import pyplot, save
from bench.prefix import Session, Turn, chat_turn, make_sessions
from bench.rounds import alternate, load_avg, ratio_keys, ratio_stats, spread
from bench.serving import Stack, scrape
from common.cluster.redis_server import RedisServer
from common.config import EngineConfig
from common.security.secret import ensure_for_children

CONFIGS = ("pool", "ram", "disk")
PLOT_NAME = "tiers_ttft.png"
TIERS = ("ram", "disk")
PREFETCH = ("started", "dropped", "completed", "in_time", "late")
THINK_S = 0.3  # between turns (module doc): KV events are flushed every 0.1 s and read at once


@dataclass
class Answered:
    """One measured turn and its answer's text (what the configurations are compared on)."""

    turn: Turn
    text: str


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    counters = ("_total", "_count", "_sum")  # counters and histograms' count and sum, not gauges
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.split("{")[0].endswith(counters)}


def tier_figures(delta: dict[str, float]) -> dict[str, Any]:
    """A side's counters: pool hits, hits/misses per tier, verify failures (blocks), read seconds."""
    out: dict[str, Any] = {
        "pool_hit_blocks": int(delta.get("splitserve_prefix_cache_hits_total", 0)),
        # blocks of tokens the tiers served (the per-tier hits below count records: pages per group)
        "tier_hit_blocks": int(delta.get("splitserve_prefix_cache_tier_hits_total", 0)),
    }
    for tier in TIERS:
        label = f'{{tier="{tier}"}}'
        out[f"{tier}_hit_blocks"] = int(delta.get(f"splitserve_kv_tier_hits_total{label}", 0))
        out[f"{tier}_miss_blocks"] = int(delta.get(f"splitserve_kv_tier_misses_total{label}", 0))
        reads = delta.get(f"splitserve_kv_tier_read_seconds_count{label}", 0)
        secs = delta.get(f"splitserve_kv_tier_read_seconds_sum{label}", 0)
        out[f"{tier}_read_ms_mean"] = round(secs / reads * 1000, 2) if reads else None
    out["verify_failures"] = int(
        sum(v for k, v in delta.items() if k.startswith("splitserve_kv_tier_verify_failures_total"))
    )
    for stage in PREFETCH:  # prefetch on arrival (common/kv/tiers.py): RAM+disk only
        out[f"prefetches_{stage}"] = int(delta.get(f"splitserve_kv_tier_prefetches_{stage}_total", 0))
    return out


def run_trace(url: str, sessions: list[Session], max_tokens: int, desc: str) -> list[Answered]:
    """Turn 1 of every session, then turn 2, ...: one request at a time."""
    turns = len(sessions[0].questions)

    async def go() -> list[Answered]:
        out = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
            with tqdm(total=len(sessions) * turns, desc=desc, unit="turn", leave=False) as bar:
                for t in range(turns):
                    for i, s in enumerate(sessions):
                        r = await chat_turn(client, url, s, t, max_tokens)
                        r.session = i
                        text = s.messages[-1]["content"] if r.error is None else ""
                        out.append(Answered(r, text))
                        bar.update(1)
                        await asyncio.sleep(THINK_S)
        return out

    return asyncio.run(go())


def route_hit_blocks(route: str) -> int:
    m = re.search(r"(?:^|; )prefix_hit=(\d+) blocks", route)
    return int(m.group(1)) if m else 0


def summarize(
    answered: list[Answered], counters: dict[str, float], block_size: int, answer_tokens: int
) -> dict[str, Any]:
    turns = [a.turn for a in answered]
    ok = [t for t in turns if t.error is None and t.ttft is not None]
    ttft = [t.ttft for t in ok if t.ttft is not None]
    later = [t.ttft for t in ok if t.turn > 0 and t.ttft is not None]
    prompt, cached = sum(t.prompt_tokens for t in ok), sum(t.cached_tokens for t in ok)
    # a session's history at its end (last prompt + answer), summed: what the trace keeps coming back to
    last: dict[int, int] = {}
    for t in ok:
        last[t.session] = max(last.get(t.session, 0), t.prompt_tokens + answer_tokens)
    return {
        "ttft_p50_ms": round(float(np.median(ttft)) * 1000, 1) if ttft else None,
        "ttft_p99_ms": round(float(np.percentile(ttft, 99)) * 1000, 1) if ttft else None,
        "later_turns_ttft_p50_ms": round(float(np.median(later)) * 1000, 1) if later else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "router_predicted_tokens": sum(route_hit_blocks(t.route) * block_size for t in ok),
        # per turn, predicted against served (module doc: predicted_vs_served_hits)
        "predicted_served_min": sum(min(route_hit_blocks(t.route) * block_size, t.cached_tokens) for t in ok),
        "predicted_served_max": sum(max(route_hit_blocks(t.route) * block_size, t.cached_tokens) for t in ok),
        "working_set_tokens": sum(last.values()),
        **tier_figures(counters),
        "errors": len(turns) - len(ok),
        "first_error": next((t.error for t in turns if t.error), None),
    }


def ttft_by_turn(answered: list[Answered], n_turns: int) -> list[float | None]:
    """TTFT p50 (ms) of each turn of a session, over sessions (and rounds)."""
    ok = [a.turn for a in answered if a.turn.error is None and a.turn.ttft is not None]
    out: list[float | None] = []
    for i in range(n_turns):
        ttft = [t.ttft for t in ok if t.turn == i and t.ttft is not None]
        out.append(round(float(np.median(ttft)) * 1000, 1) if ttft else None)
    return out


def plot(
    every: dict[str, list[Answered]], per_round: dict[str, list[dict[str, Any]]], n_turns: int, path: str
) -> None:
    """TTFT p50 per turn of a session for each configuration, and each configuration's TTFT p50 per round."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(1, n_turns + 1)
    for k, (name, answered) in enumerate(every.items()):
        ttft = [np.nan if v is None else v for v in ttft_by_turn(answered, n_turns)]
        ax1.plot(x, ttft, marker="o", label=name, color=f"C{k}")
    ax1.set(xlabel="turn of the chat session", ylabel="TTFT p50 (ms)", title="Time to first token per turn")
    ax1.legend()
    ax1.grid(alpha=0.3)
    for k, name in enumerate(per_round):
        vals = [r["ttft_p50_ms"] for r in per_round[name] if r["ttft_p50_ms"] is not None]
        if vals:
            ax2.bar(k, float(np.median(vals)), alpha=0.4, color=f"C{k}")
        ax2.scatter([k] * len(vals), vals, color=f"C{k}", zorder=3)
    ax2.set_xticks(range(len(per_round)), list(per_round))
    ax2.set(ylabel="TTFT p50 (ms)", title="TTFT p50 of each round (bar: median)")
    ax2.grid(alpha=0.3, axis="y")
    save(fig, path, dpi=110)


def run(args: argparse.Namespace) -> dict[str, Any]:
    n_sessions, n_turns, max_tokens = args.sessions, args.turns, args.answer_tokens
    pool_mb = args.kv_cache_mb
    model_flags = ["--model", args.model] if args.model else []
    template = ["--chat-template", args.chat_template] if args.chat_template else []
    engine_flags = [*model_flags, "--threads", str(args.threads), "--kv-cache-mb", str(pool_mb)]
    ram_gb, disk_ram_gb = args.tiers_ram_gb, args.tiers_disk_ram_gb or pool_mb / 1024
    disk_dir = tempfile.mkdtemp(prefix="splitserve-bench-tiers-disk-")
    tier_flags = {
        "pool": [],
        "ram": ["--kv-offload-ram-gb", f"{ram_gb:g}"],
        "disk": ["--kv-offload-ram-gb", f"{disk_ram_gb:g}", "--kv-offload-disk-dir", disk_dir,
                 "--kv-offload-disk-gb", f"{args.tiers_disk_gb:g}"],
    }  # fmt: skip
    block_size = EngineConfig().block_size
    ensure_for_children()
    redis = {c: RedisServer() for c in CONFIGS}
    stack = Stack(tempfile.mkdtemp(prefix="splitserve-bench-tiers-"))
    load_before = load_avg()
    try:
        for server in redis.values():  # on this thread: a Redis child dies with the thread that started it
            server.start()
        with ThreadPoolExecutor(len(CONFIGS)) as pool:  # the services start side by side
            decode = dict(zip(CONFIGS, pool.map(
                lambda c: stack.start("decode", "--redis-url", redis[c].url, *engine_flags, *tier_flags[c]),
                CONFIGS,
            ), strict=True))  # fmt: skip
            urls = dict(zip(CONFIGS, pool.map(
                lambda c: stack.start("router", "--redis-url", redis[c].url, *model_flags, *template), CONFIGS
            ), strict=True))  # fmt: skip
        health = httpx.get(f"{decode['pool']}/health", timeout=10).json()
        pool_blocks, pages_per_block = int(health["total_blocks"]), int(health["pages_per_block"])
        for c in CONFIGS:  # first-request costs stay out; a session of its own salt
            run_trace(urls[c], make_sessions(1, 2, salt=999, seed=args.seed), 4, f"warm-up {c}")
        every: dict[str, list[Answered]] = {c: [] for c in CONFIGS}
        by_round: dict[str, list[list[Answered]]] = {c: [] for c in CONFIGS}

        def side(c: str) -> dict[str, Any]:
            salt = len(by_round[c]) + 1  # round k: the same sessions on every configuration
            sessions = make_sessions(n_sessions, n_turns, salt, args.seed, args.system_notes)
            before = scrape(decode[c])
            answered = run_trace(urls[c], sessions, max_tokens, f"{c} round {salt}")
            delta = counter_delta(before, scrape(decode[c]))
            every[c] += answered
            by_round[c].append(answered)
            return summarize(answered, delta, block_size, max_tokens)

        results = alternate({c: (lambda c=c: side(c)) for c in CONFIGS}, args.rounds, "tiers")  # type: ignore[misc]
    finally:
        stack.stop()
        for server in redis.values():
            server.stop()
        shutil.rmtree(disk_dir, ignore_errors=True)
    plot_path = os.path.join(args.out, PLOT_NAME)
    plot(every, results, n_turns, plot_path)

    wrong, compared, first_wrong = 0, 0, None
    for c in ("ram", "disk"):
        for k, answered in enumerate(by_round[c]):
            ref = {(a.turn.session, a.turn.turn): a for a in by_round["pool"][k]}
            for a in answered:
                r = ref.get((a.turn.session, a.turn.turn))
                if r is None or a.turn.error or r.turn.error:
                    continue
                compared += 1
                if a.text != r.text:
                    wrong += 1
                    first_wrong = first_wrong or f"{c} round {k + 1} session {a.turn.session} turn " \
                        f"{a.turn.turn + 1}: {a.text!r} vs pool {r.text!r}"  # fmt: skip
    for c, rs in results.items():
        if any(r["ttft_p50_ms"] is None for r in rs):
            raise RuntimeError(f"{c}: a round without a first token; first error: {rs[0]['first_error']}")
    pool_ttft = [r["ttft_p50_ms"] for r in results["pool"]]
    ratios = {c: ratio_stats(pool_ttft, [r["ttft_p50_ms"] for r in results[c]]) for c in ("ram", "disk")}
    tiered = results["ram"] + results["disk"]
    served = sum(r["cached_tokens"] for r in tiered)
    counted = sum((r["pool_hit_blocks"] + r["tier_hit_blocks"]) * block_size for r in tiered)
    predicted = sum(r["router_predicted_tokens"] for r in tiered)
    agree, either = (
        sum(r["predicted_served_min"] for r in tiered),
        sum(r["predicted_served_max"] for r in tiered),
    )
    pool_tokens = pool_blocks // pages_per_block * block_size  # every layer's KV of this many tokens
    working = [r["working_set_tokens"] for r in results["pool"]]
    out: dict[str, Any] = {
        "sessions": n_sessions,
        "turns": n_turns,
        "answer_tokens": max_tokens,
        "system_notes": args.system_notes,
        "rounds": args.rounds,
        "threads": args.threads,
        "kv_cache_mb": pool_mb,
        "pool_tokens": pool_tokens,
        "working_set_over_pool": round(min(working) / pool_tokens, 2) if working else None,
        "ram_tier_gb": {"ram": ram_gb, "disk": disk_ram_gb},
        "disk_tier_gb": args.tiers_disk_gb,
        "ttft_p50_ratio_ram": ratios["ram"]["median"],
        **{f"ttft_p50_ram_{k}": v for k, v in ratio_keys(ratios["ram"]).items() if k != "ratio"},
        "ttft_p50_ratio_disk": ratios["disk"]["median"],
        **{f"ttft_p50_disk_{k}": v for k, v in ratio_keys(ratios["disk"]).items() if k != "ratio"},
        "predicted_vs_served_hits": round(agree / either, 4) if either else None,
        "predicted_vs_served_hits_means": "ram+disk rounds, per turn: the router's predicted reused prompt "
        "tokens (x-splitserve-route prefix_hit x block size) against the response's cached_tokens; "
        "sum of min / sum of max (1.0: every turn exact; misses and overestimates both count)",
        "router_predicted_tokens": predicted,
        "served_cached_tokens": served,
        "service_counted_vs_served_hits": round(counted / served, 4) if served else None,
        "wrong_completions": wrong,
        "compared_completions": compared,
        "first_wrong_completion": first_wrong,
        "load_before": load_before,
        "load_after": load_avg(),
        "plot": plot_path,
    }
    for c, rs in results.items():
        ttft = [r["ttft_p50_ms"] for r in rs if r["ttft_p50_ms"] is not None]
        out[f"{c}_ttft_p50_ms"] = spread(ttft, 1) if ttft else None
        out[f"{c}_ttft_p50_ms_by_turn"] = ttft_by_turn(every[c], n_turns)
        for key in ("ttft_p50_ms", "ttft_p99_ms", "later_turns_ttft_p50_ms"):
            out[f"{c}_{key}_rounds"] = [r[key] for r in rs]
        keys = ("prompt_tokens", "cached_tokens", "pool_hit_blocks", "tier_hit_blocks", "errors",
                "verify_failures", *(f"prefetches_{x}" for x in PREFETCH))  # fmt: skip
        for key in keys + tuple(f"{t}_{x}" for t in TIERS for x in ("hit_blocks", "miss_blocks")):
            out[f"{c}_{key}"] = sum(r[key] for r in rs)
        for t in TIERS:
            reads = [r[f"{t}_read_ms_mean"] for r in rs if r[f"{t}_read_ms_mean"] is not None]
            out[f"{c}_{t}_read_ms_mean"] = round(float(np.mean(reads)), 2) if reads else None
        out[f"{c}_first_error"] = next((r["first_error"] for r in rs if r["first_error"]), None)
    return out
