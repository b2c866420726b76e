"""The engine on a CUDA GPU: defaults (bf16, Triton kernels, CUDA graphs, KV sized from free memory),
graph replay against eager steps, and KV transports moving VRAM blocks. Skipped where torch sees no
GPU; `scripts/gpu_check.sh` runs them (with the kernel tests, compiled instead of interpreted)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.kv.kv_cache import PagedKVCache
from common.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Explain photosynthesis to a child in simple words.",
    "Hi",
]


def chat(tok, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_default_engine_is_bf16_triton_with_graphs_and_kv_from_free_memory() -> None:
    util = 0.5
    model_path = os.environ.get("SPLITSERVE_MODEL") or None
    engine = LLMEngine.from_config(EngineConfig(model=model_path, gpu_memory_utilization=util))
    tok = engine.tokenizer
    try:
        p = engine.placement
        assert (p.device.type, p.dtype, p.attention_backend, p.cuda_graphs) == (
            "cuda",
            torch.bfloat16,
            "triton",
            True,
        )
        _, total = torch.cuda.mem_get_info()
        kv_bytes = engine.kv_cache.spec.num_blocks * engine.kv_cache.spec.bytes_per_block
        assert kv_bytes > 0.2 * util * total, "the KV cache should take most of the share"
        assert torch.cuda.memory_allocated() <= util * total
        out = engine.generate([chat(tok, "What is the capital of France?")], SamplingParams(max_tokens=16))
        assert "Paris" in out[0].text
        assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    finally:
        del engine
        torch.cuda.empty_cache()


def test_graph_replay_gives_the_tokens_of_eager_steps(smollm) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [chat(tok, p) for p in PROMPTS]
    outs = {}
    for graphs in (False, True):
        cfg = EngineConfig(dtype="float32", num_kv_blocks=512, cuda_graphs=graphs, max_num_seqs=8)
        engine = LLMEngine(model, tok, cfg)
        outs[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        if graphs:
            assert engine.runner.graphs is not None and engine.runner.graphs.replays >= 10
        del engine
    assert outs[True] == outs[False]


def _filled_cuda(spec, seed: int) -> PagedKVCache:  # type: ignore[no-untyped-def]
    kv = PagedKVCache(spec, device="cuda")
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


@pytest.mark.parametrize("backend", ["nixl", "tcp"])
def test_transports_move_vram_blocks_byte_exact(backend: str) -> None:
    """Both caches in VRAM: NIXL registers them as VRAM (UCX moves them GPU to GPU), tcp stages them
    through host memory. NCCL (torch_dist) needs two GPUs, one per rank: not checked on one card."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if backend == "nixl":
        pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed on this GPU machine")
    from kv_transfer import make_receiver, make_sender
    from tests.support.kv_helpers import DST, SPEC, SRC, Owner, compat

    src = _filled_cuda(SPEC, 1)
    dst = PagedKVCache(SPEC, device="cuda")
    owner = Owner()
    done = owner.done

    async def main() -> None:
        rx = make_receiver(backend, dst, compat(SPEC), owner)
        endpoint = await rx.start()
        tx = make_sender(backend, src, compat(SPEC), sender_id="p0")
        from tests.support.kv_helpers import push

        await push(tx, endpoint, "r1", 1, [0, 1, 2])
        async with asyncio.timeout(20):
            while not done:
                await asyncio.sleep(0.001)
        await tx.close()
        await rx.close()

    asyncio.run(main())
    torch.cuda.synchronize()
    assert torch.equal(dst.k[:, DST], src.k[:, SRC]) and torch.equal(dst.v[:, DST], src.v[:, SRC])


def test_tier_copies_out_of_and_into_vram_are_pinned_batched_and_byte_exact() -> None:
    """The offload tiers' side of a VRAM pool (common/kv/offload.py): evicted blocks come out into
    pinned host memory, read blocks go back in one copy and an index_copy_ per K and V; both are done
    on return. The bytes equal a plain copy's, the blocks the source's, and no other block is touched."""
    from common.kv.offload import gather_blocks, put_blocks
    from tests.support.kv_helpers import DST, SPEC, SRC

    src = _filled_cuda(SPEC, 2)
    data = gather_blocks(src, SRC).reshape(-1)
    assert data.is_pinned() and data.device.type == "cpu"
    plain = torch.stack((src.k[:, SRC], src.v[:, SRC])).permute(2, 0, 1, 3, 4, 5).cpu().contiguous()
    assert torch.equal(data, plain.view(torch.uint8).reshape(-1))
    per = data.numel() // len(SRC)
    bufs = [memoryview(data[i * per : (i + 1) * per].numpy().data) for i in range(len(SRC))]
    dst = PagedKVCache(SPEC, device="cuda")
    put_blocks(dst, DST, bufs)
    assert torch.equal(dst.k[:, DST], src.k[:, SRC]) and torch.equal(dst.v[:, DST], src.v[:, SRC])
    untouched = [b for b in range(SPEC.num_blocks) if b not in DST]
    assert not dst.k[:, untouched].any() and not dst.v[:, untouched].any()


def test_layer_by_layer_tier_loads_into_vram_are_byte_exact() -> None:
    """Tier hits put in layer by layer on a copy stream (common/kv/layer_loads.py): the compute stream
    waits for each slot's event (`before_layer`), `settle` for all; the blocks equal the source's and
    no other block is touched. A kernel queued on the compute stream after the wait reads the copy."""
    from common.kv.layer_loads import LayerLoads
    from common.kv.offload import gather_blocks
    from tests.support.kv_helpers import DST, SPEC, SRC

    src = _filled_cuda(SPEC, 3)
    data = gather_blocks(src, SRC).reshape(-1)
    per = data.numel() // len(SRC)
    bufs = [memoryview(data[i * per : (i + 1) * per].numpy().data) for i in range(len(SRC))]
    dst = PagedKVCache(SPEC, device="cuda")
    loads = LayerLoads(dst)
    assert loads.mode == "cuda"
    dst.loads = loads
    try:
        loads.add(DST, bufs)
        for layer in range(SPEC.num_layers):
            dst.before_layer(layer)
            got = dst.k[layer, DST].clone()  # on the compute stream, after its wait
            assert torch.equal(got, src.k[layer, SRC])
        dst.settle_loads()
        assert not loads.pending
        assert torch.equal(dst.k[:, DST], src.k[:, SRC]) and torch.equal(dst.v[:, DST], src.v[:, SRC])
        untouched = [b for b in range(SPEC.num_blocks) if b not in DST]
        assert not dst.k[:, untouched].any() and not dst.v[:, untouched].any()
    finally:
        loads.close()


def test_tier_hits_into_vram_layer_by_layer_give_the_tokens_of_whole_copies(smollm) -> None:  # type: ignore[no-untyped-def]
    """A RAM tier behind a VRAM pool too small to keep three prompts: every repeat reads its prefix back,
    put in layer by layer on the copy stream while the step computes (auto on a GPU) or all before the
    step (whole); CUDA graphs on. The greedy tokens are equal, request by request; the tier's memory
    is pinned and no hit is staged through another buffer."""
    from tests.support.tiers import ORDER, QUESTIONS, run_in_turn

    model, tok = smollm
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    blocks = max(-(-(len(p) + 4) // 16) for p in prompts) + 2
    outs, hits = {}, {}
    for load in ("whole", "auto"):
        cfg = EngineConfig(
            dtype="float32",
            num_kv_blocks=blocks,
            max_num_seqs=1,
            kv_offload_ram_gb=0.25,
            kv_offload_load=load,
        )
        engine = LLMEngine(model, tok, cfg)
        assert engine.kv_offload is not None
        assert (engine.kv_offload.loads is not None) == (load == "auto")
        outs[load] = run_in_turn(engine, prompts, ORDER, params)
        hits[load] = engine.block_manager.tier_hits
        # the RAM tier is pinned memory (common/kv/tiers.HostArena): its hits are copied to the GPU
        # from the tier's own slots, never staged first
        off = engine.kv_offload
        arena = off.store.arena
        assert arena is not None and arena.allocated_bytes > 0
        assert all(torch.from_numpy(seg).is_pinned() for seg in arena._seg if seg is not None)
        assert off.staged_bytes == 0 and (off.loads is None or off.loads.staged_bytes == 0)
        engine.close()
    assert outs["auto"] == outs["whole"] and hits["auto"] == hits["whole"] > 0
