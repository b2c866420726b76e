"""What a narrower KV cache costs in accuracy and gains in capacity (`--kv-cache-dtype`).

The same model (fp32 weights) with its KV cache in fp32, bf16, fp8 e4m3 and fp8 e5m2, each given the
same KV memory. Reported per dtype, flat (the figures issue 28 asks for):

* `ppl_<dtype>` and `ppl_ratio_<dtype>`: the perplexity of a held-out text (`HELD_OUT`, not the fp8
  calibration text), scored teacher-forced through that engine's KV cache, and its ratio to bf16 KV's
  (the goal for fp8: at most 1.02). Every score here (this, the drifts below) is read through the
  cache: an engine with `kv_exact_prefill` off, whose prefill chunks read even their own K/V back from
  the cache as a decode step reads it (served, an fp8 prefill chunk sees its own K/V as computed, and
  a prompt scored in one chunk would hardly touch the cache);
* `held_out_drift_<dtype>` and `held_out_drift_p99_<dtype>`: the mean (and p99) over the held-out
  text's tokens of |logprob - bf16 KV's logprob|, the same tokens scored: a steadier figure than the
  perplexity ratio, whose rounding noise (about +-0.5 % for e5m2 on these 913 tokens) is of the size of
  the goal's margin;
* `greedy_equal_<dtype>`: whether the greedy answer to the README question ("What is the capital of
  France?", through the chat template; `ask`) is token for token bf16 KV's, as served
  (`answer_<dtype>`: its text); `greedy_equal_through_cache_<dtype>`: the same with every read through
  the cache (its first token is a near tie on SmolLM2: 0.08 nats with fp32 KV);
* `kv_bytes_per_token_<dtype>`: KV bytes one token takes, all layers, K and V;
* `kv_clamped_<dtype>`: K/V values the fp8 cache saturated over the whole run (`PagedKVCache.clamped`).

And nested per dtype, as before: for `--requests` chat prompts (default 20) the fp32-KV engine writes a
greedy answer of `--answer-tokens` tokens; every engine then scores prompt + answer teacher-forced
(prompt logprobs: each token's log-probability given everything before it, read back through that
engine's KV cache), so the drift is measured at the same positions whatever the engine would itself
have chosen: KV blocks in the same memory and the gain over fp32, the absolute logprob drift against
fp32 (mean, p99, max over every answer token), and how often the dtype's own greedy answer equals fp32's
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
from common.text.tokenizer import Tokenizer

DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")
KV_MB = 64
README_QUESTION = "What is the capital of France?"
README_ANSWER_TOKENS = 48
# Held out: none of it is in common/kv/quant.py's CALIBRATION_TEXT (what the fp8 scales come from).
HELD_OUT = (
    "The lighthouse at the end of the harbour was built in 1868, after two ships ran aground on the "
    "rocks in a single winter. Its first keeper, a former sailor named Thomas Reid, lived in the small "
    "stone cottage beside the tower with his wife and their three children. Every evening he climbed the "
    "ninety-two steps to light the lamp, and every morning he cleaned the soot from the glass. In storms "
    "he stayed awake all night, watching the beam sweep across the water and listening for the bell of "
    "the buoy that marked the channel.\n\n"
    "In 1921 the oil lamp was replaced by an electric light, and in 1965 the station was automated. The "
    "cottage stood empty for years until the town council turned it into a small museum. Visitors can now "
    "see the keeper's logbooks, which record the weather, the ships that passed and, now and then, a "
    "line about the family: a birthday, a fever, a letter from a son who had gone to sea. The tower "
    "itself is open on summer afternoons. From the gallery at the top, on a clear day, you can see the "
    "coast curve away to the north and the islands floating on the horizon to the west.\n\n"
    "Scientists who study coastal erosion also use the site. The cliff below the lighthouse loses about "
    "thirty centimetres a year, and measurements taken since the 1950s show that the rate has increased. "
    "Engineers have proposed several ways to protect the foundations, from a rock barrier at the base of "
    "the cliff to moving the whole tower inland, as was done with a similar lighthouse in North Carolina "
    "in 1999. For now, the council has chosen to monitor the cliff and to decide again in ten years.\n\n"
    "To make a simple loaf of bread, mix five hundred grams of flour with a teaspoon of salt and a small "
    "packet of dried yeast. Add about three hundred millilitres of warm water and stir until the dough "
    "comes together. Knead it on a floured table for ten minutes, until it feels smooth and springs back "
    "when you press it with a finger. Put it in a bowl, cover it with a damp cloth and leave it somewhere "
    "warm for an hour, or until it has doubled in size. Then knock the air out, shape it into a round, "
    "and let it rise again on a baking tray while the oven heats to two hundred and twenty degrees. Bake "
    "for thirty to thirty-five minutes. The loaf is ready when it sounds hollow as you tap the bottom.\n\n"
    '"Are you sure this is the right road?" Maria asked, looking at the map on her knees.\n'
    '"No," said her brother, "but it is the only road, so it must be."\n'
    "The car climbed slowly between the pine trees. Below them the valley was already in shadow, and "
    "the first lights were coming on in the village they had left an hour before. Maria folded the map "
    "and put it away. She had stopped believing in it at the last junction, where a sign pointing left "
    "had been painted over and a newer one, pointing right, leaned against a fence post. When they "
    "reached the top of the pass the wind was strong enough to rock the car, and they sat for a minute "
    "without speaking, watching the clouds move over the ridge.\n\n"
    "Plants make their own food through photosynthesis. In the leaves, a green pigment called "
    "chlorophyll absorbs light, mostly red and blue, and uses its energy to split water molecules. The "
    "oxygen from the water is released into the air, while the hydrogen is used, together with carbon "
    "dioxide taken in through small pores in the leaf, to build sugars. Some of these sugars are burned "
    "for energy; others are stored as starch or turned into cellulose, the material of cell walls. "
    "Almost all the oxygen in the atmosphere was produced this way, over billions of years, first by "
    "bacteria in the oceans and later by land plants.\n\n"
    "Dear Mr Patel,\n"
    "Thank you for your letter of the fourteenth and for the photographs of the damage. I am sorry to "
    "hear that the repair to the roof did not hold through the winter. Our records show that the work "
    "was completed in October and is covered by a two-year guarantee, so there will be no charge for "
    "putting it right. One of our team will call you this week to arrange a visit; in the meantime, if "
    "water is still coming in, please let us know and we will send someone sooner.\n"
    "Yours sincerely,\nAnne Morrison"
)


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


def perplexity(engine: LLMEngine, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], teacher-forced through `engine`'s KV cache."""
    return float(np.exp(-np.mean(prompt_logprobs(engine, ids))))


def kv_bytes_per_token(engine: LLMEngine) -> int:
    spec = engine.kv_cache.spec
    return spec.bytes_per_block // spec.block_size


def ask(tok: Tokenizer, question: str) -> str:
    """The question through the model's chat template; for a model without one (a base model, such as
    the Gemma 3 270M GGUF) as a plain question-and-answer prompt."""
    if tok.chat_template:
        return tok.apply_chat_template([{"role": "user", "content": question}])
    return f"Question: {question}\nAnswer:"


def common_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load_avg()
    model, tok = load_model(args.model, dtype=torch.float32)
    rng = random.Random(args.seed)
    questions = [rng.choice(QUESTIONS) + f" (#{i})" for i in range(args.requests)]
    prompts = [tok.encode(ask(tok, q)) for q in questions]
    greedy = SamplingParams(max_tokens=args.answer_tokens, ignore_eos=True)
    held_out = tok.encode(HELD_OUT)
    readme = tok.encode(ask(tok, README_QUESTION))
    out: dict[str, Any] = {
        "requests": len(prompts),
        "answer_tokens": args.answer_tokens,
        "kv_mb": KV_MB,
        "held_out_tokens": len(held_out),
    }
    reference: list[list[float]] = []
    answers: list[list[int]] = []
    ppl: dict[str, float] = {}
    held_lp: dict[str, np.ndarray] = {}
    readme_answers: dict[str, list[int]] = {}
    readme_through: dict[str, list[int]] = {}
    readme_params = SamplingParams(max_tokens=README_ANSWER_TOKENS)
    for name in tqdm(DTYPES, desc="kv dtypes", leave=False):
        cfg = EngineConfig(
            kv_cache_dtype=name, kv_cache_memory_mb=KV_MB, num_threads=args.threads, max_num_seqs=8
        )
        engine = LLMEngine(model, tok, cfg)  # as served: fp8 prefill chunks read their own K/V exact
        # every read through the cache (fp8: kv_exact_prefill off), as a decode step reads: what scores
        scorer = engine  # (the option means nothing for a cache that is not fp8: one engine does)
        if engine.kv_cache.quantized:
            scorer = LLMEngine(model, tok, cfg.model_copy(update={"kv_exact_prefill": False}))
        key = "fp32" if name == "auto" else name
        held_lp[key] = np.array(prompt_logprobs(scorer, held_out))
        ppl[key] = float(np.exp(-held_lp[key].mean()))  # `perplexity`, from the same logprobs
        readme_answers[key] = engine.generate([readme], readme_params)[0].token_ids
        readme_through[key] = scorer.generate([readme], readme_params)[0].token_ids
        own = [c.token_ids for c in engine.generate(prompts, greedy)]
        if name == "auto":
            answers = own
        scored = [prompt_logprobs(scorer, p + a)[len(p) - 1 :] for p, a in zip(prompts, answers, strict=True)]
        if name == "auto":
            reference = scored
        drift = np.abs(np.concatenate([np.subtract(s, r) for s, r in zip(scored, reference, strict=True)]))
        starts = [common_start(o, a) for o, a in zip(own, answers, strict=True)]
        blocks = engine.kv_cache.spec.num_blocks
        out[f"kv_bytes_per_token_{key}"] = kv_bytes_per_token(engine)
        out[f"kv_clamped_{key}"] = engine.kv_cache.clamped + (
            scorer.kv_cache.clamped if scorer is not engine else 0
        )
        out[key] = {
            "kv_blocks": blocks,
            "capacity_gain": round(blocks / out["fp32"]["kv_blocks"], 2) if key != "fp32" else 1.0,
            "logprob_drift_mean": round(float(drift.mean()), 4),
            "logprob_drift_p99": round(float(np.percentile(drift, 99)), 4),
            "logprob_drift_max": round(float(drift.max()), 4),
            "greedy_match": round(sum(s == args.answer_tokens for s in starts) / len(starts), 3),
            "greedy_common_start_mean": round(float(np.mean(starts)), 1),
        }
        print(f"  {key}: ppl {ppl[key]:.4f}, {out[key]}", flush=True)
    for key in ppl:
        out[f"ppl_{key}"] = round(ppl[key], 4)
        out[f"ppl_ratio_{key}"] = round(ppl[key] / ppl["bfloat16"], 4)
        held_drift = np.abs(held_lp[key] - held_lp["bfloat16"])
        out[f"held_out_drift_{key}"] = round(float(held_drift.mean()), 4)
        out[f"held_out_drift_p99_{key}"] = round(float(np.percentile(held_drift, 99)), 4)
        out[f"greedy_equal_{key}"] = readme_answers[key] == readme_answers["bfloat16"]
        out[f"answer_{key}"] = tok.decode(readme_answers[key])
        out[f"greedy_equal_through_cache_{key}"] = readme_through[key] == readme_answers["bfloat16"]
    out["load_before"], out["load_after"] = load_before, load_avg()
    return out
