"""Tensor parallelism on this machine: one engine at TP=1 against TP=2 (`--tensor-parallel-size`), and
real services split at different TP sizes (prefill TP 1 -> decode TP 2, prefill TP 2 -> decode TP 1).

The same chat prompts, greedy, through an engine at TP=1 with one thread, TP=1 with two threads (the
same cores TP=2 uses) and TP=2 with one thread per rank, in rounds that alternate the three. Reported:
each side's time per engine step (median over rounds, with the spread), the share of a TP=2 step rank 0
spends in its collectives (all-reduce after attention and after the MLP, the logits gather; waiting
for the other rank included), and `tp2_greedy_equal`: TP=2 produced exactly TP=1's tokens. On a 2-core
CPU with a 135M model, TP=2 is expected to be slower: the point here is that it is exact, and what its
communication costs; on GPUs `scripts/gpu_check.sh` is where speed would be measured.

Then the heterogeneous splits (skipped with `--no-splits`), each on a stack of its own: Redis, one
prefill service and one decode service (`--threads 1`, `--kv-cache-mb`, default 32) at the two TP
sizes, and a router with `--local-prefill-threshold 0`, so that every request is prefilled on the
prefill service and its KV moved rank by rank, each prefill rank sending its KV heads to the decode
ranks that hold them (common/parallel/plan.py). The same prompts go to /v1/completions as token ids,
greedy, `ignore_eos`, max_tokens = `--answer-tokens`, one at a time after a warm-up; each answer must be
the TP=1 engine's: the text of its tokens and their number (the API returns text, not token ids).
`split_1_2_equal`, `split_2_1_equal`; TTFT and end-to-end medians are informational (two services and
a router sharing two cores). `greedy_equal`: TP=2 and both splits reproduced TP=1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import torch
from tqdm import tqdm

from bench.loadgen import sse_chunks
from bench.rounds import alternate, load_avg, spread
from bench.workload import QUESTIONS
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.loader import load_model
from common.sampling_params import SamplingParams
from common.text.tokenizer import Tokenizer

SPLITS = {"split_1_2": (1, 2), "split_2_1": (2, 1)}  # name -> (prefill TP, decode TP)
REQUEST_TIMEOUT_S = 120.0


def say(msg: str) -> None:
    """A progress line on stderr (the JSON line stays the last line of stdout)."""
    tqdm.write(f"[bench tp] {msg}", file=sys.stderr)


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load_avg()
    say("loading the model")
    model, tok = load_model(args.model, dtype=torch.float32)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(min(args.requests, 8))]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    params = SamplingParams(max_tokens=args.answer_tokens, ignore_eos=True)
    sides = {
        "tp1": EngineConfig(num_threads=1, max_num_seqs=8),
        "tp1_2threads": EngineConfig(num_threads=2, max_num_seqs=8),
        "tp2": EngineConfig(num_threads=1, max_num_seqs=8, tensor_parallel_size=2),
    }
    say("starting the engines (TP=1, TP=1 with two threads, TP=2)")
    engines = {name: LLMEngine(model, tok, cfg) for name, cfg in sides.items()}
    tokens: dict[str, list[list[int]]] = {}
    comm = engines["tp2"].tp_workers.comm if engines["tp2"].tp_workers is not None else None
    bar = tqdm(total=args.rounds * len(sides), desc="engines", unit="side", leave=False)

    def side(name: str) -> dict[str, float]:
        engine = engines[name]
        torch.set_num_threads(engine.config.num_threads or 1)
        if comm is not None:
            comm.seconds, comm.calls = 0.0, 0
        t0 = time.perf_counter()
        rids = [engine.add_request(p, params) for p in prompts]
        out: dict[str, list[int]] = {r: [] for r in rids}
        steps = 0
        while engine.has_unfinished():
            for o in engine.step().outputs:
                out[o.request_id] += o.token_ids
            steps += 1
        elapsed = time.perf_counter() - t0
        tokens[name] = [out[r] for r in rids]
        result = {"step_ms": 1000 * elapsed / steps, "steps": float(steps)}
        if name == "tp2" and comm is not None:
            result["comm_share"] = comm.seconds / elapsed
            result["comm_calls_per_step"] = comm.calls / steps
        bar.update(1)
        return result

    try:
        results = alternate({n: (lambda n=n: side(n)) for n in sides}, args.rounds)  # type: ignore[misc]
    finally:
        bar.close()
        for engine in engines.values():
            engine.close()
    out: dict[str, Any] = {"prompts": len(prompts), "answer_tokens": args.answer_tokens}
    out["rounds"] = args.rounds
    for name, rs in results.items():
        s = spread([r["step_ms"] for r in rs])
        out[f"{name}_step_ms"], out[f"{name}_step_ms_spread"] = s["median"], [s["min"], s["max"]]
    tp2 = results["tp2"]
    share = spread([r["comm_share"] for r in tp2])
    out["tp2_comm_share"], out["tp2_comm_share_spread"] = share["median"], [share["min"], share["max"]]
    out["tp2_comm_calls_per_step"] = tp2[0]["comm_calls_per_step"]
    out["tp2_vs_tp1_step_ratio"] = round(out["tp2_step_ms"] / out["tp1_step_ms"], 3)
    out["tp2_greedy_equal"] = tokens["tp2"] == tokens["tp1"]
    equal = out["tp2_greedy_equal"]
    if getattr(args, "no_splits", False):
        out["splits"] = "skipped (--no-splits)"
    else:
        for name, (prefill_tp, decode_tp) in SPLITS.items():
            say(f"{name}: prefill TP {prefill_tp} -> decode TP {decode_tp}")
            split = run_split(args, prefill_tp, decode_tp, prompts, tokens["tp1"], tok)
            out |= {f"{name}_{k}": v for k, v in split.items()}
            equal = equal and split["equal"]
    out["greedy_equal"] = equal
    out["load_before"], out["load_after"] = load_before, load_avg()
    return out


# --- heterogeneous splits: real services -----------------------------------------------------------
def run_split(
    args: argparse.Namespace,
    prefill_tp: int,
    decode_tp: int,
    prompts: list[list[int]],
    want: list[list[int]],
    tok: Tokenizer,
) -> dict[str, Any]:
    """One stack (Redis, prefill at `prefill_tp`, decode at `decode_tp`, a router that splits every
    prompt); each prompt once, one at a time; the answers against `want` (the TP=1 engine's tokens)."""
    from bench.serving import Stack  # the stack's modules only when the splits run
    from common.cluster.redis_server import RedisServer
    from common.security.internal_auth import SignedCalls
    from common.security.secret import InternalSecret, ensure_for_children

    ensure_for_children()
    model_flags = ["--model", args.model] if args.model else []
    engine = [*model_flags, "--threads", "1", "--kv-cache-mb", str(getattr(args, "kv_cache_mb", None) or 32)]
    redis = RedisServer()
    stack = Stack(tempfile.mkdtemp(prefix=f"splitserve-bench-tp-{prefill_tp}-{decode_tp}-"))
    t_start = time.perf_counter()
    try:
        redis.start()
        shared = ["--redis-url", redis.url]
        say(f"starting prefill (TP {prefill_tp}) and decode (TP {decode_tp}), logs in {stack.log_dir}")
        with ThreadPoolExecutor(2) as pool:  # both load the model at once
            starts = {
                role: pool.submit(stack.start, role, *shared, *engine, "--tensor-parallel-size", str(tp))
                for role, tp in (("prefill", prefill_tp), ("decode", decode_tp))
            }
            urls = {role: f.result() for role, f in starts.items()}
        say("starting the router (--local-prefill-threshold 0: every prompt split)")
        router = stack.start("router", *shared, *model_flags, "--local-prefill-threshold", "0")
        kv = httpx.get(
            urls["decode"] + "/internal/kv", auth=SignedCalls(InternalSecret.from_env()), timeout=10
        )
        kv.raise_for_status()
        start_s = time.perf_counter() - t_start
        say(f"services up after {start_s:.0f} s; warm-up, then {len(prompts)} requests")
        answers = asyncio.run(ask_all(router, prompts, args.answer_tokens))
    finally:
        stack.stop()
        redis.stop()
    texts = [tok.decode(w) for w in want]
    equal = [
        a["error"] is None and a["text"] == t and a["completion_tokens"] == len(w)
        for a, t, w in zip(answers, texts, want, strict=True)
    ]
    routes: dict[str, int] = {}
    for a in answers:
        routes[a["route"]] = routes.get(a["route"], 0) + 1
    ok = [a for a in answers if a["error"] is None and a["ttft"] is not None]
    out: dict[str, Any] = {
        "equal": all(equal),
        "tokens_compared": sum(a["completion_tokens"] for a in answers),
        "ttft_p50_ms": round(float(np.median([a["ttft"] for a in ok])) * 1000, 1) if ok else None,
        "e2e_p50_ms": round(float(np.median([a["e2e"] for a in ok])) * 1000, 1) if ok else None,
        "kv_backend": kv.json()["backend"],
        "kv_endpoints": len(kv.json()["kv_endpoint"].split(",")),
        "routes": routes,
        "startup_s": round(start_s, 1),
    }
    if not all(equal):
        i = equal.index(False)
        out["first_mismatch"] = {
            "prompt": i,
            "error": answers[i]["error"],
            "got": answers[i]["text"],
            "got_tokens": answers[i]["completion_tokens"],
            "want": texts[i],
            "want_tokens": len(want[i]),
        }
    return out


async def ask_all(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """A warm-up request until the router splits (it has seen the prefill service register), then
    every prompt in turn."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
        deadline = time.monotonic() + 60
        while True:
            warm = await ask(client, url, prompts[0], 2)
            if warm["error"] is None and warm["route"] == "split":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"warm-up on {url}: route {warm['route']!r}, error {warm['error']!r}")
            await asyncio.sleep(0.5)
        out = []
        for p in tqdm(prompts, desc="requests", unit="req", leave=False):
            out.append(await ask(client, url, p, max_tokens))
        return out


async def ask(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion of token-id `prompt`: its text, completion_tokens (from usage),
    route (the router's x-splitserve-route, up to the first ';'), TTFT and end-to-end time (s)."""
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res: dict[str, Any] = {"text": "", "completion_tokens": 0, "route": "", "ttft": None, "e2e": None}
    res["error"] = None
    text: list[str] = []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            res["route"] = resp.headers.get("x-splitserve-route", "").split(";")[0]
            if resp.status_code != 200:
                res["error"] = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for chunk in sse_chunks(resp):
                if "error" in chunk:
                    res["error"] = str(chunk["error"])[:200]
                    return res
                if (usage := chunk.get("usage")) is not None:
                    res["completion_tokens"] = int(usage["completion_tokens"])
                for c in chunk.get("choices", []):
                    if c.get("text"):
                        if res["ttft"] is None:
                            res["ttft"] = time.perf_counter() - t0
                        text.append(c["text"])
        res["e2e"] = time.perf_counter() - t0
    except httpx.HTTPError as e:
        res["error"] = f"{type(e).__name__}: {e}"
    res["text"] = "".join(text)
    return res
