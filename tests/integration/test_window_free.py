"""A model with sliding layers frees the KV blocks that slid out of the window (issue 28, point 3).

Two tiny random-weight models (window 16, blocks of 4; built with transformers as
tests/integration/test_model_archs.py builds its models): a mistral, whose every layer slides (one
block table, its head released), and a gemma3 of 2 sliding layers and 1 full one (pages of 1 layer,
one full and two sliding layer groups, each with its table: common/kv/layer_groups.py). Each generates
48 tokens after a 40-token prompt, well past the window, in the real engine (fp32):

* greedy tokens equal transformers' `generate`, through the torch path and the Triton kernels
  (interpreted on a CPU), with the prefix cache on and off;
* between steps a decoding sequence's sliding tables hold at most ceil(16 / 4) + 1 blocks, their
  released blocks are HOLEs at the head of the table, a full group's table holds every block, and at
  the end every block is back (free or cached): nothing leaks;
* a hole's contents never matter: before every step every block no sequence holds is filled with NaN
  (a hole's -1 would be refused by the torch path's index_select, and would read another layer's memory
  in the kernel), and two sequences decoding together still give transformers' tokens;
* preemption under a small pool, by swap and by recompute, gives the same tokens;
* a sequence longer than the pool would hold with every layer's blocks runs;
* behind offload tiers, tier hits give the same tokens, and a prefetch on arrival brings what the
  admission reads (each layer group's pages) from the disk into RAM first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.kv.block_manager import HOLE
from common.kv.layer_groups import GroupedBlockManager
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.sampling_params import SamplingParams
from common.text.tokenizer import Tokenizer
from tests.integration.test_model_archs import BLOCK, VOCAB, Arch, build
from tests.support.tiers import WAIT_S, slow_copier, tier

WINDOW = 16
NEW = 48  # 40 + 48 tokens: five and a half windows
PROMPTS = [
    torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    for n, seed in ((40, 0), (29, 1), (35, 2))
]
BOUND = -(-WINDOW // BLOCK) + 1  # blocks a decoding sequence holds between steps


@dataclass
class Model:
    name: str
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    expected: list[list[int]]  # transformers' greedy tokens for each of PROMPTS
    pool: int  # the smallest num_kv_blocks a 40 + 48-token sequence runs in


MODELS = {
    "mistral": (Arch("mistral", {"sliding_window": WINDOW}), 9),  # a 16-token chunk and its window
    # 1 full layer (every block: 22 pages) and 2 sliding (2 groups, 9 pages each): 40 pages, the bytes
    # of 14 blocks of every layer (3 pages a block); one table would need 22 blocks
    "gemma3": (
        Arch("gemma3_text", {"sliding_window": WINDOW, "num_hidden_layers": 3, "sliding_window_pattern": 3}),
        14,
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def mistral(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    from transformers import AutoModelForCausalLM

    arch, pool = MODELS[request.param]
    folder = build(tmp_path_factory.mktemp(f"{request.param}-window"), arch)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for p in PROMPTS:
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            expected.append(out[0, len(p) :].tolist())
    model, tokenizer = load_model(str(folder))
    assert model.config.sliding_window == WINDOW
    return Model(request.param, model, tokenizer, expected, pool)


def engine(m: Model, **update: Any) -> LLMEngine:
    cfg = EngineConfig(max_num_batched_tokens=16, num_kv_blocks=64, block_size=BLOCK, dtype="float32")
    e = LLMEngine(m.model, m.tokenizer, cfg.model_copy(update=update))
    assert e.block_manager.window == WINDOW  # sliding layers: blocks are released
    assert isinstance(e.block_manager, GroupedBlockManager) == (m.name == "gemma3")
    if update.get("attention_backend") == "triton":
        assert e.runner.use_kernels
    return e


def tables(e: LLMEngine, seq: Any) -> list[tuple[int | None, list[int]]]:
    """(window, table) of each of seq's block tables: one per layer group."""
    bm = e.block_manager
    if isinstance(bm, GroupedBlockManager):
        return list(zip(bm.windows, bm.tables(seq), strict=True))
    return [(bm.window, seq.block_table)]


PARAMS = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.0)


def run(e: LLMEngine, prompts: list[list[int]], each_step: Any = None) -> list[list[int]]:
    """Greedy tokens of `prompts` run together, step by step; `each_step(engine)` before every step."""
    ids = [e.add_request(p, PARAMS) for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while e.has_unfinished():
        if each_step is not None:
            each_step(e)
        for o in e.step().outputs:
            got[o.request_id] += o.token_ids
    return [got[i] for i in ids]


def check_all_back(e: LLMEngine) -> None:
    bm = e.block_manager
    bm.check_integrity()
    assert bm.num_used == 0 and bm.num_free_blocks == bm.num_blocks, "a block leaked"


def backends() -> list[Any]:
    return ["torch", pytest.param("triton", marks=pytest.mark.skipif(not _has_triton(), reason="no triton"))]


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("backend", backends())
@torch.inference_mode()
def test_greedy_equals_transformers_and_blocks_stay_bounded(
    mistral: Model, backend: str, caching: bool
) -> None:
    e = engine(mistral, attention_backend=backend, enable_prefix_caching=caching)
    bm = e.block_manager
    rid = e.add_request(PROMPTS[0], PARAMS)
    seq = e._seqs[rid]
    tokens: list[int] = []
    most = holes = 0
    while e.has_unfinished():
        tokens += [t for o in e.step().outputs for t in o.token_ids]
        if seq.is_finished or seq.num_computed_tokens < seq.num_prompt_tokens:
            continue
        for window, table in tables(e, seq):
            n = table.count(HOLE)
            assert table[:n] == [HOLE] * n, "holes are the head of the table"
            if window is None:
                assert n == 0 and len(table) * BLOCK >= seq.num_computed_tokens  # every block
                continue
            first = max(0, seq.num_computed_tokens - window + 1) // BLOCK
            assert n == first  # each released once it slid out
            held = len(table) - n
            most, holes = max(most, held), n
            assert held <= BOUND, table
        bm.check_integrity()
    assert tokens == mistral.expected[0]
    assert most == BOUND  # the bound is reached: a window straddling a block boundary
    assert holes >= 15  # near the end: 22 blocks of tokens, the window's last few held
    check_all_back(e)
    if caching:  # released blocks keep their hash: the prompt's prefix is still served from the cache
        assert len(bm.cached_ids) > 0


@pytest.mark.parametrize("backend", backends())
@torch.inference_mode()
def test_a_holes_contents_never_matter(mistral: Model, backend: str) -> None:
    """Before every step each block a sequence released (the block its hole stood for) is NaN, and so is
    the pool's last block (what index -1 names): any read of one turns the logits NaN and the tokens
    wrong. (The pool is large enough that no released block is handed out again: a fresh block's
    unwritten tail is read, masked, by the torch path's padded decode batch, as stale data is.) Two
    sequences decode together (that padded batch) and then one alone."""
    e = engine(mistral, attention_backend=backend, enable_prefix_caching=False)
    cache, last = e.kv_cache, e.kv_cache.spec.num_blocks - 1
    ever: set[int] = set()
    poisoned: set[int] = {last}

    def poison(e: LLMEngine) -> None:
        held = {b for s in e.scheduler.running for b in e.block_manager.live_pages(s)}
        assert not held & poisoned, "a released block was handed out again: make the pool larger"
        ever.update(held)
        poisoned.update(ever - held)
        idx = torch.tensor(sorted(poisoned), dtype=torch.long)
        cache.k[:, idx] = float("nan")
        cache.v[:, idx] = float("nan")

    assert run(e, PROMPTS[:2], poison) == mistral.expected[:2]
    assert len(poisoned) > 20  # the holes of two sequences far past their windows
    check_all_back(e)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@torch.inference_mode()
def test_preemption_under_a_small_pool_gives_the_same_tokens(mistral: Model, mode: str) -> None:
    # 14 blocks: the 10-block prompt and two decoding sequences (up to 5 each) do not fit together
    e = engine(mistral, num_kv_blocks=14, preemption_mode=mode, enable_prefix_caching=False)
    assert run(e, PROMPTS) == mistral.expected
    stats = e.scheduler.stats
    assert stats[f"preempt_{mode}"] >= 1, dict(stats)
    check_all_back(e)
    assert e.scheduler.swap_blocks_used == 0 and not e._swapped_kv


@torch.inference_mode()
def test_a_sequence_longer_than_the_pool_runs(mistral: Model) -> None:
    """88 tokens are 22 blocks; the smallest pool that runs them holds a 16-token chunk and the window
    before it in each sliding table (and every block in a full group's). Before blocks were released
    such a request was refused (it needed more blocks than the cache has)."""
    e = engine(mistral, num_kv_blocks=mistral.pool)
    assert e.block_manager.most_held(len(PROMPTS[0]) + NEW, 16) <= e.block_manager.num_blocks
    assert run(e, PROMPTS[:1]) == mistral.expected[:1]
    check_all_back(e)
    with pytest.raises(ValueError, match="more KV blocks than the cache has"):
        engine(mistral, num_kv_blocks=mistral.pool - 1).add_request(PROMPTS[0], PARAMS)


@torch.inference_mode()
def test_offload_tier_hits_give_the_same_tokens(mistral: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A RAM offload tier behind a pool that holds about one sequence: the three prompts run twice, one
    at a time, so each repeat finds its prefix evicted and reads it back, past its first chunk (with
    layer groups, each group's pages under its own key: every full group's for the blocks, each sliding
    group's for the window the hit reads). The read pages go into the pool layer by layer while the
    step computes, each layer's copy started late (with layer groups a page's slot is a layer of each
    group: common/kv/layer_loads.py). The tokens equal transformers' both times; nothing leaks; the
    tiers' KV events name block hashes only (a later group's page keys are held unannounced)."""
    slow_copier(monkeypatch)
    e = engine(mistral, num_kv_blocks=mistral.pool + 2, kv_offload_ram_gb=0.05, kv_offload_load="layerwise")
    assert e.kv_offload is not None and e.kv_offload.loads is not None
    e.block_manager.enable_kv_events()
    for _ in range(2):
        for prompt, want in zip(PROMPTS, mistral.expected, strict=True):
            assert run(e, [prompt]) == [want]
    # the repeats' whole prefixes (9 + 7 + 8 blocks) came back: an admission reads the tiers' run past
    # its first chunk (16 tokens: the 3 blocks before its last, all it read before)
    assert e.block_manager.tier_hits > 3 * 3, e.block_manager.tier_hits
    e.kv_offload.flush()
    assert e.kv_offload.store.wait_idle(WAIT_S)
    events = e.block_manager.drain_kv_events()
    device = {h for held, h, t in events if held and t == "device"}
    tiered = {h for held, h, t in events if held and t == "ram"}
    assert tiered and tiered <= device, "a tier announced a key that is no block hash"
    check_all_back(e)


def disk_tier_engine(m: Model, tmp_path: Path, spare: int = 2, **update: Any) -> LLMEngine:
    """An engine with a pool of `m.pool + spare` blocks, a RAM tier of about two pools and a disk tier,
    after the three prompts ran twice, one at a time: prompt 0's blocks are on the disk only (each
    block is written there on its second eviction, and prompts 1 and 2 pushed it out of RAM)."""
    e = engine(m, num_kv_blocks=m.pool + 2)
    ram_gb = 2 * (m.pool + 2) * e.kv_cache.spec.bytes_per_block / 2**30
    # disk reads "always": a tiny model computes a block in about the time this disk reads one, so
    # "auto" could leave the disk alone, and these tests are about what a disk read puts in the pool
    update = {"kv_offload_disk_reads": "always", **update}
    e = engine(
        m, num_kv_blocks=m.pool + spare, kv_offload_ram_gb=ram_gb,
        kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gb=0.01, **update,
    )  # fmt: skip
    assert e.kv_offload is not None
    for p in (0, 1, 2, 0, 1, 2):
        assert run(e, [PROMPTS[p]]) == [m.expected[p]]
        e.kv_offload.flush()
        assert e.kv_offload.store.wait_idle(WAIT_S)
    return e


@torch.inference_mode()
def test_a_prefetch_on_arrival_brings_a_windowed_models_blocks_into_ram(
    mistral: Model, tmp_path: Path
) -> None:
    """RAM and disk tiers, RAM too small for the three prompts: prompt 0's blocks go to the disk (each
    block is written there on its second eviction). When prompt 0 arrives again, the engine's
    add_request starts a prefetch of what its admission will read (the first chunk's blocks; with
    layer groups, each group's pages under its own key); once it finished, the admission reads RAM only,
    and the tokens equal transformers'. The test waits for the prefetch (a condition); the engine
    never does."""
    e = disk_tier_engine(mistral, tmp_path)
    assert e.kv_offload is not None
    store = e.kv_offload.store
    assert store.ram is not None and store.disk is not None
    disk_reads = tier(e, "disk").read_latency.counts
    hits = e.block_manager.tier_hits
    rid = e.add_request(PROMPTS[0], PARAMS)
    assert store.wait_prefetched(WAIT_S) and store.stats().prefetch.started == 1
    assert tier(e, "disk").read_latency.counts == disk_reads
    got: list[int] = []
    while e.has_unfinished():
        got += [t for o in e.step().outputs if o.request_id == rid for t in o.token_ids]
    assert got == mistral.expected[0]
    pf = store.stats().prefetch
    assert (pf.completed, pf.in_time, pf.late, pf.dropped) == (1, 1, 0, 0) and pf.blocks > 0, pf
    assert tier(e, "disk").read_latency.counts == disk_reads, "the admission read no disk chunk"
    assert e.block_manager.tier_hits > hits
    e.close()


@torch.inference_mode()
@pytest.mark.parametrize("wait_s", [5.0, 0.0], ids=["wait", "no-wait"])
def test_an_admission_waits_for_its_prefetch_while_another_sequence_decodes(
    mistral: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait_s: float
) -> None:
    """Prompt 0's blocks on the disk only, as above, and a disk that answers the prefetch only when the
    test lets it. Prompt 0 arrives while another sequence decodes: its admission waits for the
    prefetch (the other one steps on, and the engine's thread reads no disk), then reads RAM; every
    token equals transformers'. With the wait off (`kv_offload_prefetch_wait_s` 0, the disk open) it
    is admitted at once."""
    from common.kv import tiers

    e = disk_tier_engine(mistral, tmp_path, spare=8, kv_offload_prefetch_wait_s=wait_s)
    assert e.kv_offload is not None
    store = e.kv_offload.store
    other = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(9)).tolist()
    rid_other = e.add_request(other, PARAMS)
    got: dict[str, list[int]] = {rid_other: []}

    def step() -> list[str]:
        result = e.step()
        for o in result.outputs:
            got[o.request_id] += o.token_ids
        return [a.request_id for a in result.admitted]

    step()  # the other sequence runs
    gate, reads = threading.Event(), []
    real = tiers._read_file

    def read_file(path: Path) -> bytearray:
        reads.append(threading.current_thread().name)
        assert gate.wait(WAIT_S), "the test never opened the disk"
        return real(path)

    monkeypatch.setattr(tiers, "_read_file", read_file)
    started = store.stats().prefetch.started
    if not wait_s:
        gate.set()
    rid = e.add_request(PROMPTS[0], PARAMS)
    got[rid] = []
    assert store.stats().prefetch.started == started + 1, "prompt 0's blocks are on the disk only"
    if not wait_s:
        assert rid in step() and e.scheduler.stats["prefetch_deferred"] == 0, "no wait: admitted at once"
        while e.has_unfinished():
            step()
        assert got[rid] == mistral.expected[0]
        e.close()
        return
    for _ in range(3):
        decoded = len(got[rid_other])
        assert rid not in step(), "admitted while its prefetch still reads the disk"
        assert len(got[rid_other]) == decoded + 1, "the other sequence steps on meanwhile"
    assert e.scheduler.stats["prefetch_deferred"] == 3
    gate.set()
    assert store.wait_prefetched(WAIT_S)
    while e.has_unfinished():
        step()
    assert got[rid] == mistral.expected[0]
    assert reads and set(reads) == {"kv-tier-prefetch"}, "the engine's thread read no disk"
    assert store.stats().prefetch.in_time >= 1
    e.close()
