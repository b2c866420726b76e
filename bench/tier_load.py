"""What a RAM tier hit costs to put back into the pool: all before the step, or layer by layer while the
step computes (common/kv/layer_loads.py).

One LLMEngine per mode of `--kv-offload-load` (whole, inline, layerwise), in this process, on the same
model (fp32, `--threads`), each with a RAM tier and a pool that holds one prompt: a long prompt
(`--prompt-tokens`, 2048) is computed once, a filler prompt as long evicts it into the RAM tier, then
the prompt plus a new turn of 32 tokens comes back: its
admission reads the prompt's blocks from RAM and computes only the new turn. Timed: that request's
whole `generate` of one token (its TTFT in the engine: the tier read and verification, the copy into
the pool, the suffix's forward). The modes alternate in `--rounds` rounds (A B C, C B A, ...), a
fresh eviction before every timed hit; the tokens of every hit must equal the whole mode's.

Reported per mode: the TTFT's spread over rounds; `ttft_ratio_whole` = whole / layerwise (> 1: the
overlap paid) and `ttft_ratio_inline` = inline / layerwise, per round; the copier's own time per
block and how much of it the forward waited for (`exposed_fraction` = wait / copy: 0 is all hidden).
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import torch

from bench.rounds import alternate, load_avg, median, ratio_stats, spread
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.loader import load_model
from common.sampling_params import SamplingParams

MODES = ("whole", "inline", "layerwise")
BLOCK = 16
TEXT = (
    "The lighthouse keeper climbed the spiral stairs at dusk, counting the steps as his father had, "
    "and wound the clockwork that turned the lens. Out at sea the fishing boats came home in a line. "
)


def _ids(tok: Any, n: int, salt: str) -> list[int]:
    ids = tok.encode(salt + " " + TEXT * (1 + n // 30))[:n]
    assert len(ids) == n, f"the text gives only {len(ids)} tokens"
    return ids


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    n = args.prompt_tokens or 2048
    new = 32
    prompt, filler = _ids(tok, n, "Story one."), _ids(tok, n, "Story two.")
    turn = _ids(tok, new, "And then?")
    blocks = -(-(n + new + 2) // BLOCK) + 2  # one prompt and its turn: the filler evicts it
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engines = {
        m: LLMEngine(
            model,
            tok,
            EngineConfig(
                dtype="float32",
                num_kv_blocks=blocks,
                kv_offload_ram_gb=1.0,
                kv_offload_load=m,
                max_num_batched_tokens=max(n, 512),
                max_num_seqs=1,
            ),
        )  # fmt: skip
        for m in MODES
    }
    tokens: dict[str, list[list[int]]] = {m: [] for m in MODES}
    hits: dict[str, list[int]] = {m: [] for m in MODES}

    def side(mode: str) -> float:
        e = engines[mode]
        assert e.kv_offload is not None
        e.generate([filler], params)  # evicts the prompt: into the RAM tier
        e.kv_offload.flush()
        assert e.kv_offload.store.wait_idle(60), "the tier writer never caught up"
        before = e.block_manager.tier_hits
        t0 = time.perf_counter()
        out = e.generate([prompt + turn], params)[0].token_ids
        took = time.perf_counter() - t0
        hits[mode].append(e.block_manager.tier_hits - before)
        tokens[mode].append(out)
        return took * 1000

    load_before = load_avg()
    try:
        for m in MODES:  # the prompt computed once, and a warm-up hit
            engines[m].generate([prompt], params)
            side(m)
        for m in MODES:  # the figures below count the timed rounds only
            tokens[m].clear()
            hits[m].clear()
            o = engines[m].kv_offload
            assert o is not None
            o.copy_in_s, o.copy_in_blocks = 0.0, 0
            if o.loads is not None:
                o.loads.copy_s = o.loads.wait_s = 0.0
                o.loads.loaded_blocks = 0
        ttft = alternate({m: partial(side, m) for m in MODES}, args.rounds, progress="tier-load")
        offload = {m: engines[m].kv_offload for m in MODES}
        loads = {m: o.loads for m, o in offload.items() if o is not None and o.loads is not None}
        copy = {
            m: {
                "copy_ms_per_block": round(ld.copy_s * 1000 / max(1, ld.loaded_blocks), 4),
                "wait_ms_per_block": round(ld.wait_s * 1000 / max(1, ld.loaded_blocks), 4),
                "exposed_fraction": round(ld.wait_s / ld.copy_s, 3) if ld.copy_s else None,
            }
            for m, ld in loads.items()
        }
        whole = offload["whole"]
        assert whole is not None
        copy["whole"] = {"copy_ms_per_block": round(whole.copy_in_s * 1000 / max(1, whole.copy_in_blocks), 4)}
    finally:
        for e in engines.values():
            e.close()
    return {
        "model": model.config.model_id,
        "prompt_tokens": n,
        "new_tokens": new,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "tier_hit_blocks": {m: sorted(set(h)) for m, h in hits.items()},
        "tokens_equal": all(tokens[m] == tokens["whole"] for m in MODES),
        **{f"{m}_ttft_ms": spread(ttft[m], 1) for m in MODES},
        "ttft_ratio_whole": ratio_stats(ttft["whole"], ttft["layerwise"]),
        "ttft_ratio_inline": ratio_stats(ttft["inline"], ttft["layerwise"]),
        "ttft_ms_median": {m: round(median(ttft[m]), 1) for m in MODES},
        "copies": copy,
        "load_before": load_before,
        "load_after": load_avg(),
    }
