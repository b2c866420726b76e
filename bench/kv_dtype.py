"""What a narrower KV cache costs in accuracy and gains in capacity (`--kv-cache-dtype`).

The same model (fp32 weights) with its KV cache in fp32, bf16, fp8 e4m3 and fp8 e5m2, each given the
same KV memory. For `--requests` chat prompts (default 20) the fp32-KV engine writes a greedy answer of
`--answer-tokens` tokens; every engine then scores prompt + answer teacher-forced (prompt logprobs: each
token's log-probability given everything before it, read back through that engine's KV cache), so the
drift is measured at the same positions whatever the engine would itself have chosen. Reported per
dtype: KV blocks in the same memory and the gain over fp32, the absolute logprob drift against fp32
(mean, p99, max over every answer token), and how often the dtype's own greedy answer equals fp32's
(`greedy_match`) with the mean length of the common start.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.rounds import load_avg
from bench.workload import QUESTIONS
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.loader import load_model
from common.sampling_params import SamplingParams

DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")
KV_MB = 64


def prompt_logprobs(engine: LLMEngine, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, computed by `engine` in one request (its KV cache included)."""
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    out: list[float] = []
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.request_id == rid and o.prompt_logprobs is not None:
                out = [lp.logprob for lp in o.prompt_logprobs[1:] if lp is not None]
    assert len(out) == len(ids) - 1, "the engine returned no prompt logprobs"
    return out


def common_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load_avg()
    model, tok = load_model(args.model, dtype=torch.float32)
    rng = random.Random(args.seed)
    questions = [rng.choice(QUESTIONS) + f" (#{i})" for i in range(args.requests)]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    greedy = SamplingParams(max_tokens=args.answer_tokens, ignore_eos=True)
    out: dict[str, Any] = {"requests": len(prompts), "answer_tokens": args.answer_tokens, "kv_mb": KV_MB}
    reference: list[list[float]] = []
    answers: list[list[int]] = []
    for name in tqdm(DTYPES, desc="kv dtypes", leave=False):
        cfg = EngineConfig(
            kv_cache_dtype=name, kv_cache_memory_mb=KV_MB, num_threads=args.threads, max_num_seqs=8
        )
        engine = LLMEngine(model, tok, cfg)
        own = [c.token_ids for c in engine.generate(prompts, greedy)]
        if name == "auto":
            answers = own
        scored = [prompt_logprobs(engine, p + a)[len(p) - 1 :] for p, a in zip(prompts, answers, strict=True)]
        if name == "auto":
            reference = scored
        drift = np.abs(np.concatenate([np.subtract(s, r) for s, r in zip(scored, reference, strict=True)]))
        starts = [common_start(o, a) for o, a in zip(own, answers, strict=True)]
        blocks = engine.kv_cache.spec.num_blocks
        key = "fp32" if name == "auto" else name
        out[key] = {
            "kv_blocks": blocks,
            "capacity_gain": round(blocks / out["fp32"]["kv_blocks"], 2) if key != "fp32" else 1.0,
            "logprob_drift_mean": round(float(drift.mean()), 4),
            "logprob_drift_p99": round(float(np.percentile(drift, 99)), 4),
            "logprob_drift_max": round(float(drift.max()), 4),
            "greedy_match": round(sum(s == args.answer_tokens for s in starts) / len(starts), 3),
            "greedy_common_start_mean": round(float(np.mean(starts)), 1),
        }
        print(f"  {key}: {out[key]}", flush=True)
    out["load_before"], out["load_after"] = load_before, load_avg()
    return out
