"""KV offload tiers with tensor parallelism (common/kv/offload.py, common/engine/tp_workers.py).

The tiny model's 3 KV heads over 2 ranks split unevenly ([2, 1]); over 4 ranks head 0 is replicated on
ranks 0 and 1. Rank 0's tiers hold every head of a block: on eviction it fetches the workers' heads
over the step pipes, on a tier hit it hands them back. Three prompts cycle through a pool that holds
one: each repeat finds its prefix evicted and read back from a tier, and the greedy tokens must equal
a tiers-off run on one rank (the way the tensor-parallel tests compare: never floats bit for bit). A
damaged disk record, a worker that cannot write its heads and a worker that is gone are misses,
recomputed, never data.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.llama import LlamaForCausalLM
from common.prefix_hash import prefix_chain
from common.sampling_params import SamplingParams
from common.text.tokenizer import Tokenizer
from tests.support.tiers import LONG, ORDER, QUESTIONS, damage, run_in_turn, tier

MAX_TOKENS = 4
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
RAM = {"kv_offload_ram_gb": 0.01}


@pytest.fixture(scope="module")
def prompts(tiny: tuple[LlamaForCausalLM, Tokenizer]) -> list[list[int]]:
    _, tok = tiny
    return [tok.encode(q) for q in QUESTIONS]


def _config(prompts: list[list[int]], tp: int = 1, **more: Any) -> EngineConfig:
    """A pool of one request's blocks and two more: most of the last prompt is evicted by the next."""
    per_request = max(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts)
    return EngineConfig(
        num_kv_blocks=per_request + 2, max_num_seqs=1, num_threads=1, tensor_parallel_size=tp, **more
    )


@pytest.fixture(scope="module")
def reference(tiny: tuple[LlamaForCausalLM, Tokenizer], prompts: list[list[int]]) -> list[list[int]]:
    """One rank, tiers off: every repeat recomputes its prefix."""
    model, tok = tiny
    engine = LLMEngine(model, tok, _config(prompts))
    outs = run_in_turn(engine, prompts, LONG, PARAMS)
    assert engine.block_manager.prefix_hits == 0, "the pool must be too small to keep a repeated prompt"
    return outs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [2, 4])
def test_ram_tier_hits_with_tensor_parallelism_give_one_ranks_tokens(
    tiny: tuple[LlamaForCausalLM, Tokenizer], prompts: list[list[int]], reference: list[list[int]], tp: int
) -> None:
    """2 ranks: heads [2, 1], uneven; 4 ranks: heads [1, 1, 1, 1], head 0 on ranks 0 and 1."""
    model, tok = tiny
    one = LLMEngine(model, tok, _config(prompts, **RAM))  # only its store's layout digest is used
    assert one.kv_offload is not None
    digest = one.kv_offload.store.digest
    one.close()
    engine = LLMEngine(model, tok, _config(prompts, tp, **RAM))
    try:
        assert engine.kv_offload is not None and engine.tp_workers is not None
        assert engine.kv_offload.store.digest == digest, "a chunk names the whole model, not the TP size"
        assert engine.kv_cache.spec.num_kv_heads < model.config.num_kv_heads  # rank 0 holds a share
        assert run_in_turn(engine, prompts, ORDER, PARAMS) == reference[: len(ORDER)]
        ram = tier(engine, "ram")
        assert ram.hits > 0 and ram.hits == engine.block_manager.tier_hits
        assert ram.verify_failures.total() == 0 and engine.kv_offload.dropped_blocks == 0
        assert len(engine.tp_workers.alive) == tp - 1
        # the router's read cost counts the round trip to every rank, not just the store's read
        assert engine.kv_offload.copy_in_blocks == ram.hits and engine.kv_offload.copy_in_s > 0
        read_only = engine.kv_offload.store.read_s_per_block()["ram"] * 1000
        assert engine.kv_offload.read_ms_per_block()["ram"] > read_only
    finally:
        engine.close()


@pytest.mark.timeout(240)
def test_disk_tier_with_two_ranks_and_a_flipped_byte(
    tiny: tuple[LlamaForCausalLM, Tokenizer],
    prompts: list[list[int]],
    reference: list[list[int]],
    tmp_path: Path,
) -> None:
    """Prompt 0's records are damaged before request 6 would read them: a miss, recomputed; prompts 1
    and 2 come back from the disk for requests 7 and 8."""
    model, tok = tiny
    cfg = _config(prompts, 2, kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gb=0.01)
    engine = LLMEngine(model, tok, cfg)
    hits: dict[int, int] = {}

    def before(i: int) -> None:
        hits[i] = engine.block_manager.tier_hits
        if i == 6:
            assert engine.kv_offload is not None
            damage(engine.kv_offload.store, prompts[0], "checksum")

    try:
        assert run_in_turn(engine, prompts, LONG, PARAMS, before) == reference
        disk = tier(engine, "disk")
        assert disk.verify_failures["checksum"] >= 1, disk.verify_failures
        assert hits[6] == hits[7] == 0, "nothing before request 7 came from the disk"
        assert disk.hits > 0 and disk.hits == engine.block_manager.tier_hits
    finally:
        engine.close()


@pytest.mark.timeout(240)
def test_a_rank_that_fails_or_is_gone_makes_a_tier_read_a_miss(
    tiny: tuple[LlamaForCausalLM, Tokenizer], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """A worker that cannot write its heads answers so (and serves on); one killed by SIGKILL makes
    rank 0's load return 0 though rank 0 read and wrote its own heads: never a partial success."""
    model, tok = tiny
    engine = LLMEngine(model, tok, _config(prompts, 2, **RAM))
    try:
        tiers, workers = engine.kv_offload, engine.tp_workers
        assert tiers is not None and workers is not None
        assert run_in_turn(engine, prompts, ORDER[:3], PARAMS) == reference[:3]  # prompt 0 is in RAM now
        # a shard of the wrong size: rank 1 reads it, refuses it, and answers
        workers.tier_in([0], [torch.zeros(7, dtype=torch.uint8)])
        why = workers.tier_in_wait()
        assert why.startswith("tensor-parallel rank 1: writing blocks from a tier failed"), why
        # ... and serves on: prompt 0 read back from RAM on both ranks, the tokens one rank gives
        assert run_in_turn(engine, prompts, [0], PARAMS) == [reference[3]]
        assert engine.block_manager.tier_hits > 0
        [proc] = workers._procs
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)  # until the kernel has ended it
        assert not workers.alive
        hashes = prefix_chain(prompts[1], 16)
        tokens = [tuple(prompts[1][i * 16 : (i + 1) * 16]) for i in range(len(hashes))]
        assert tiers.store.read(hashes, tokens), "prompt 1's blocks are in RAM"
        assert tiers.load(hashes, tokens, list(range(len(hashes)))) == 0  # the engine is done for anyway
        # an evicted block whose heads the gone worker cannot hand over is never offered, and counted
        offered = tiers.offered_blocks
        tiers.evicted(0, 12345, tuple(range(16)))
        tiers.flush()
        assert tiers.offered_blocks == offered and tiers.stats().unoffered_blocks == 1
    finally:
        engine.close()


@pytest.mark.timeout(240)
def test_fp8_tiers_with_two_ranks(tiny: tuple[LlamaForCausalLM, Tokenizer], prompts: list[list[int]]) -> None:
    """An fp8 cache: each rank's heads keep their own scales, the chunk holds every head's bytes and its
    digest names the whole model's scales (one rank's store has the same)."""
    model, tok = tiny
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    one = LLMEngine(model, tok, _config(prompts, **fp8, **RAM))
    assert one.kv_offload is not None
    digest = one.kv_offload.store.digest
    one.close()
    want = run_in_turn(LLMEngine(model, tok, _config(prompts, **fp8)), prompts, ORDER, PARAMS)
    engine = LLMEngine(model, tok, _config(prompts, 2, **fp8, **RAM))
    try:
        assert engine.kv_offload is not None and engine.kv_offload.store.digest == digest
        assert run_in_turn(engine, prompts, ORDER, PARAMS) == want
        assert engine.block_manager.tier_hits > 0
        assert tier(engine, "ram").verify_failures.total() == 0
    finally:
        engine.close()


@pytest.mark.services
@pytest.mark.timeout(300)
def test_tier_hits_across_the_split_with_two_ranks_on_each_side(  # type: ignore[no-untyped-def]
    tiny, redis_url, tmp_path
) -> None:
    """Real prefill and decode services of 2 ranks each, RAM tiers, the tcp backend, a real Redis and
    router (test_kv_tiers_split.py's first half at TP 2): A, then B (A leaves both pools for the
    tiers), then A again: both services read A back on every rank, so the decode ranks' receivers get
    only the suffix, and every answer is the plain engine's."""
    from tests.integration.test_kv_tiers_split import (
        BS,
        FLAGS,
        POOL_BLOCKS,
        plain_answers,
        read_back_from_tiers,
        story,
    )
    from tests.support.cluster import Cluster

    _, tok = tiny
    a = story("Ada")
    reusable = (len(tok.encode(tok.apply_chat_template(a), add_special_tokens=False)) - 1) // BS
    cluster = Cluster(redis_url, str(tmp_path))
    env = {"SPLITSERVE_NUM_KV_BLOCKS": str(POOL_BLOCKS)}
    tp = ("--tensor-parallel-size", "2", "--kv-offload-ram-gb", "0.25")
    try:
        prefill = cluster.start("prefill", *FLAGS, *tp, env=env)
        decode = cluster.start("decode", *FLAGS, *tp, env=env)
        router = cluster.start("router", "--local-prefill-threshold", "1")  # every prompt split
        read_back_from_tiers(router.url, prefill.url, decode.url, plain_answers(tiny), reusable)
        for proc in (prefill, decode):
            h = cluster.wait_blocks_free(proc)
            assert h["free_blocks"] == h["total_blocks"], f"{proc.role} leaked blocks: {h}"
    finally:
        cluster.stop()
