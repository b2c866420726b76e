"""Prefix-aware routing against least-loaded routing on multi-turn chat (issue: KV-aware routing).

One real stack: Redis, two prefill and two decode services, and two routers on it that differ only in
`--routing` (prefix_aware, least_loaded). The workload is several chat sessions run at once, each a
sequence of turns whose prompt is the whole history so far (its own system prompt, every earlier
question and answer) plus a new question: each turn's prompt extends the last one, so the service
that served a session already holds most of its next prompt.

The two routers take turns (rounds A B, B A, ...), each round on fresh sessions (a salt in every
system prompt keeps the caches of one round from helping the next). Per policy: TTFT p50/p99, prompt
tokens the prefilling services computed (prompt - cached, from `usage`), KV bytes moved (each
request's record in Redis, written by the prefill service) and the cache hit rate. The JSON carries
`ttft_p50_ratio` (least-loaded / prefix-aware, median over rounds) and `kv_bytes_saved_fraction`
(1 - prefix-aware / least-loaded, over all rounds).

Both routers run with the same `--local-prefill-threshold` (`--prefix-threshold`, default 64): a
least-loaded router weighs the whole prompt against it, a prefix-aware one what the chosen decode
service would have to compute (the prompt less the prefix it holds), so a later turn whose new tail is
short is prefilled where its history is, with no transfer at all.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from bench.loadgen import sse_chunks
from bench.plots import pyplot, save
from bench.rounds import alternate, load_avg, ratio_keys, ratio_stats
from bench.serving import Stack
from bench.workload import QUESTIONS
from common.cluster.redis_server import RedisServer
from common.cluster.state import ClusterState
from common.security.secret import ensure_for_children

POLICIES = ("prefix_aware", "least_loaded")
PLOT = os.path.join("docs", "img", "prefix_routing.png")
TOPICS = ["astronomy", "cooking", "gardening", "music theory", "sailing", "chess", "geology", "poetry"]


@dataclass
class Turn:
    """One measured turn of a session."""

    session: int
    turn: int
    ttft: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    route: str = ""
    request_id: str = ""
    transfer_bytes: int = 0
    error: str | None = None


@dataclass
class Session:
    system: str
    questions: list[str]
    messages: list[dict[str, str]] = field(default_factory=list)


def make_sessions(n: int, turns: int, salt: int, seed: int, system_notes: int = 0) -> list[Session]:
    """`n` sessions of `turns` questions; every system prompt names the round's salt and its session,
    and carries `system_notes` course notes (about 35 tokens each): the instructions a deployed
    assistant's system prompt holds, shared by every turn of the session."""
    rng = random.Random(seed * 1000 + salt)
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        notes = " ".join(
            f"Course note {k + 1}: when a student asks '{rng.choice(QUESTIONS)}', connect the answer to "
            f"{rng.choice(TOPICS)} and to {topic}, name one everyday observation, and check understanding."
            for k in range(system_notes)
        )
        system = (
            f"Session {salt}-{i}. You are a patient tutor in {topic}. Answer every question in two or three "
            f"plain sentences, with one concrete example drawn from {topic}, and never use lists. Keep the "
            "whole conversation in mind: refer back to earlier answers when that helps the student, and "
            "correct yourself if an earlier answer was wrong. The student is curious and reads carefully. "
            + notes
        )
        questions = [
            f"{rng.choice(QUESTIONS)} Relate it to {topic} if you can, question {t + 1}."
            for t in range(turns)
        ]
        out.append(Session(system, questions, [{"role": "system", "content": system}]))
    return out


async def chat_turn(client: httpx.AsyncClient, url: str, s: Session, t: int, max_tokens: int) -> Turn:
    """Send turn t of session s (its whole history), stream the answer, append it to the history."""
    s.messages.append({"role": "user", "content": s.questions[t]})
    body = {
        "model": "default",
        "messages": s.messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res, text = Turn(0, t), []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            res.route = resp.headers.get("x-splitserve-route", "")
            res.request_id = resp.headers.get("x-request-id", "")
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for chunk in sse_chunks(resp):
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                if (usage := chunk.get("usage")) is not None:
                    res.prompt_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
                for c in chunk.get("choices", []):
                    piece = (c.get("delta") or {}).get("content")
                    if piece:
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - t0
                        text.append(piece)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    s.messages.append({"role": "assistant", "content": "".join(text)})
    return res


async def run_sessions(url: str, sessions: list[Session], max_tokens: int, desc: str) -> list[Turn]:
    """Every session runs its turns one after another (the next question follows the answer); the
    sessions run at once, so their turns interleave on the services."""
    turns = len(sessions[0].questions)
    bar = tqdm(total=len(sessions) * turns, desc=desc, unit="turn", leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:

        async def one(i: int, s: Session) -> list[Turn]:
            out = []
            for t in range(turns):
                r = await chat_turn(client, url, s, t, max_tokens)
                r.session = i
                out.append(r)
                bar.update(1)
            return out

        per = await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
    bar.close()
    return [t for ts in per for t in ts]


async def fill_transfer_bytes(redis_url: str, turns: list[Turn]) -> None:
    """Each request's KV bytes moved, from its record (written by the prefill service; 0 when local)."""
    state = ClusterState.from_url(redis_url)
    try:
        for t in turns:
            if t.request_id:
                rec = await state.records.get(t.request_id)
                t.transfer_bytes = int((rec or {}).get("transfer_bytes") or 0)
    finally:
        await state.close()


def summarize(turns: list[Turn]) -> dict[str, Any]:
    ok = [t for t in turns if t.error is None and t.ttft is not None]
    later = [t for t in ok if t.turn > 0]  # turns that have history to reuse
    ttft = [t.ttft for t in ok if t.ttft is not None]
    prompt, cached = sum(t.prompt_tokens for t in ok), sum(t.cached_tokens for t in ok)
    routes: dict[str, int] = {}
    for t in ok:
        key = t.route.split(";")[0] + (
            ":" + t.route.split("reason=")[1].split(";")[0] if "reason=" in t.route else ""
        )
        routes[key] = routes.get(key, 0) + 1
    return {
        "ttft_p50_ms": round(float(np.median(ttft)) * 1000, 1) if ttft else None,
        "ttft_p99_ms": round(float(np.percentile(ttft, 99)) * 1000, 1) if ttft else None,
        "later_turns_ttft_p50_ms": round(float(np.median([t.ttft for t in later])) * 1000, 1)
        if later
        else None,
        "prompt_tokens": prompt,
        "prefill_tokens_computed": prompt - cached,
        "cache_hit_rate": round(cached / prompt, 3) if prompt else 0.0,
        "kv_bytes_moved": sum(t.transfer_bytes for t in ok),
        "routes": routes,
        "errors": len(turns) - len(ok),
        "first_error": next((t.error for t in turns if t.error), None),
    }


def plot(every: dict[str, list[Turn]], n_turns: int, path: str) -> None:
    """Per turn of a session: TTFT p50 and KV bytes moved per request, for each policy."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(1, n_turns + 1)
    for policy, turns in every.items():
        ok = [t for t in turns if t.error is None and t.ttft is not None]
        ttft = [np.median([t.ttft for t in ok if t.turn == i] or [np.nan]) * 1000 for i in range(n_turns)]
        kv = [
            np.mean([float(t.transfer_bytes) for t in ok if t.turn == i] or [np.nan]) / 2**20
            for i in range(n_turns)
        ]
        ax1.plot(x, ttft, marker="o", label=policy)
        ax2.plot(x, kv, marker="o", label=policy)
    ax1.set(xlabel="turn of the chat session", ylabel="TTFT p50 (ms)", title="Time to first token")
    ax2.set(xlabel="turn of the chat session", ylabel="MiB per request", title="KV moved prefill -> decode")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    save(fig, path, dpi=110)


def run(args: argparse.Namespace) -> dict[str, Any]:
    n_sessions, n_turns, max_tokens = args.sessions, args.turns, args.answer_tokens
    model_flags = ["--model", args.model] if args.model else []
    engine_flags = [*model_flags, "--threads", str(args.threads)]
    ensure_for_children()
    redis = RedisServer()
    stack = Stack(tempfile.mkdtemp(prefix="splitserve-bench-prefix-"))
    load_before = load_avg()
    try:
        redis.start()
        shared = ["--redis-url", redis.url]
        for _ in range(2):
            stack.start("prefill", *shared, *engine_flags)
            stack.start("decode", *shared, *engine_flags)
        threshold = ["--local-prefill-threshold", str(args.prefix_threshold)]
        urls = {p: stack.start("router", *shared, *model_flags, *threshold, "--routing", p) for p in POLICIES}
        warm = make_sessions(2, 2, salt=999, seed=args.seed)
        for p in POLICIES:  # first-request costs (and both routers seeing all four services) stay out
            asyncio.run(run_sessions(urls[p], warm, 4, f"warm-up {p}"))
            warm = make_sessions(2, 2, salt=998, seed=args.seed)
        salts = iter(range(1, 1000))

        every: dict[str, list[Turn]] = {p: [] for p in POLICIES}

        def side(policy: str) -> dict[str, Any]:
            sessions = make_sessions(n_sessions, n_turns, next(salts), args.seed, args.system_notes)
            turns = asyncio.run(run_sessions(urls[policy], sessions, max_tokens, policy))
            asyncio.run(fill_transfer_bytes(redis.url, turns))
            every[policy] += turns
            return summarize(turns)

        results = alternate({p: (lambda p=p: side(p)) for p in POLICIES}, args.rounds)  # type: ignore[misc]
    finally:
        stack.stop()
        redis.stop()
    plot(every, n_turns, PLOT)
    aware, least = results["prefix_aware"], results["least_loaded"]
    ttft = ratio_stats([r["ttft_p50_ms"] for r in least], [r["ttft_p50_ms"] for r in aware])
    bytes_aware = sum(r["kv_bytes_moved"] for r in aware)
    bytes_least = sum(r["kv_bytes_moved"] for r in least)
    out: dict[str, Any] = {
        "sessions": n_sessions,
        "turns": n_turns,
        "answer_tokens": max_tokens,
        "system_notes": args.system_notes,
        "local_prefill_threshold": args.prefix_threshold,
        "rounds": args.rounds,
        "ttft_p50_ratio": ttft["median"],
        **{f"ttft_p50_{k}": v for k, v in ratio_keys(ttft).items() if k != "ratio"},
        "kv_bytes_saved_fraction": round(1 - bytes_aware / bytes_least, 3) if bytes_least else None,
        "load_before": load_before,
        "load_after": load_avg(),
        "plot": PLOT,
    }
    for name, rs in results.items():
        for k in ("ttft_p50_ms", "ttft_p99_ms", "later_turns_ttft_p50_ms", "cache_hit_rate"):
            out[f"{name}_{k}"] = [r[k] for r in rs]
        for k in ("prompt_tokens", "prefill_tokens_computed", "kv_bytes_moved", "errors"):
            out[f"{name}_{k}"] = sum(r[k] for r in rs)
        out[f"{name}_routes"] = [r["routes"] for r in rs]
        out[f"{name}_first_error"] = next((r["first_error"] for r in rs if r["first_error"]), None)
    return out
