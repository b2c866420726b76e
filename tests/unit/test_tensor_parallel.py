"""Tensor parallelism without processes: the head/vocab partition, and sharded models run as threads
over an in-process collective against the whole model."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.model.attention import AttentionMetadata
from common.model.config import ModelConfig
from common.model.llama import DecoderLayer, LlamaForCausalLM
from common.parallel.collective import TPRank
from common.parallel.partition import kv_head_ranges, q_head_ranges, shard_layouts

# --- the partition ----------------------------------------------------------------------------------


def test_kv_heads_split_evenly() -> None:
    assert kv_head_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert kv_head_ranges(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert kv_head_ranges(3, 1) == [range(0, 3)]
    assert q_head_ranges(12, 4, 2) == [range(0, 6), range(6, 12)]


def test_kv_heads_split_unevenly_larger_first() -> None:
    # SmolLM2-135M: 9 query heads, 3 KV heads over 2 ranks
    assert kv_head_ranges(3, 2) == [range(0, 2), range(2, 3)]
    assert q_head_ranges(9, 3, 2) == [range(0, 6), range(6, 9)]
    assert kv_head_ranges(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]


def test_kv_heads_replicated_when_ranks_outnumber_them() -> None:
    assert kv_head_ranges(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert kv_head_ranges(3, 6) == [range(h, h + 1) for h in (0, 0, 1, 1, 2, 2)]
    assert q_head_ranges(9, 3, 6) == [
        range(0, 2),
        range(2, 3),
        range(3, 5),
        range(5, 6),
        range(6, 8),
        range(8, 9),
    ]
    # 4 ranks over 3 KV heads: head 0 on two ranks (its query heads split between them), the others on one
    assert kv_head_ranges(3, 4) == [range(0, 1), range(0, 1), range(1, 2), range(2, 3)]
    assert q_head_ranges(6, 3, 4) == [range(0, 1), range(1, 2), range(2, 4), range(4, 6)]
    assert kv_head_ranges(1, 4) == [range(0, 1)] * 4  # multi-query attention


@pytest.mark.parametrize("nh,nkv", [(9, 3), (6, 3), (8, 2), (12, 4), (4, 1), (8, 8)])
def test_every_query_head_once_with_its_own_kv_head(nh: int, nkv: int) -> None:
    group = nh // nkv
    for tp in range(1, nh + 1):
        q, kv = q_head_ranges(nh, nkv, tp), kv_head_ranges(nkv, tp)
        assert len(q) == len(kv) == tp
        assert [h for r in q for h in r] == list(range(nh))  # contiguous, in rank order, each once
        assert {h for r in kv for h in r} == set(range(nkv))
        for qr, kr in zip(q, kv, strict=True):
            assert len(qr) >= 1 and len(kr) >= 1
            assert {h // group for h in qr} == set(kr)  # a rank's query heads read exactly its KV heads
        sizes = [len(r) for r in kv]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_refusals() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        kv_head_ranges(3, 0)
    with pytest.raises(ValueError, match="exceeds the 9 attention heads"):
        q_head_ranges(9, 3, 10)
    with pytest.raises(ValueError, match="not a multiple"):
        q_head_ranges(9, 2, 2)
    with pytest.raises(ValueError, match="intermediate_size=1536"):
        shard_layouts(9, 3, 1536, 49152, 5)
    with pytest.raises(ValueError, match="vocab_size=49153"):
        shard_layouts(9, 3, 1536, 49153, 2)
    lay = shard_layouts(9, 3, 1536, 49152, 2)
    assert [(len(x.q_heads), len(x.kv_heads), len(x.intermediate), len(x.vocab)) for x in lay] == [
        (6, 2, 768, 24576),
        (3, 1, 768, 24576),
    ]


# --- sharded layers against the whole model, ranks as threads ------------------------------------------


class ThreadWorld:
    """N ranks as threads of one process; a collective is a barrier and a shared slot per rank."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list[Any] = [None] * n


class ThreadCollective:
    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.n

    def _exchange(
        self, x: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]
    ) -> torch.Tensor:
        w = self.world
        w.slots[self.rank] = x.clone()
        w.barrier.wait()
        out = combine(list(w.slots))
        w.barrier.wait()  # everyone has read the slots before they are written again
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._exchange(x, lambda xs: torch.stack(xs).sum(0))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return self._exchange(x, lambda xs: torch.cat(xs, dim=-1) if self.rank == 0 else x)


def run_ranks(world: ThreadWorld, fn: Callable[[int], Any]) -> list[Any]:
    """fn(rank) on one thread per rank; the first error is raised (and breaks the others' barrier)."""
    out: list[Any] = [None] * world.n
    errors: list[BaseException] = []

    def target(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world.n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def tiny(tied: bool, bias: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=6, num_kv_heads=3,
        head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=tied, bos_token_id=None, eos_token_ids=(0,), model_id="tiny", weights_hash="t",
        attention_bias=bias,
    )  # fmt: skip


def whole_model(cfg: ModelConfig) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.copy_(torch.randn_like(p) * 0.2)
    return model


def paged_logits(
    model: LlamaForCausalLM, kv_heads: int, ids: torch.Tensor, chunks: list[int]
) -> torch.Tensor:
    """One sequence prefilled in chunks over a paged KV cache of `kv_heads` heads (scattered blocks);
    the logits of every row."""
    cfg, bs = model.config, 4
    cache = PagedKVCache(KVCacheSpec(cfg.num_layers, 16, bs, kv_heads, cfg.head_dim))
    table = [9, 2, 14, 5, 7]
    out, start = [], 0
    for n in chunks:
        end = start + n
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)])
        blocks = torch.tensor(table[: -(-end // bs)])
        meta = AttentionMetadata([0, n], [end], [blocks], slots)
        hidden = model(ids[start:end], torch.arange(start, end), cache, meta)
        out.append(model.compute_logits(hidden))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("tp", [2, 3, 4, 6])
@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)])
def test_sharded_model_matches_the_whole_one(tp: int, tied: bool, bias: bool) -> None:
    """Even (3), uneven (2: KV heads [2, 1]) and replicated (4, 6) head splits; tied and untied
    embeddings; q/k/v biases. Rank 0 must see the whole model's logits, dense and paged."""
    torch.set_num_threads(1)
    cfg = tiny(tied, bias)
    whole = whole_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    want_dense = whole.dense_forward(ids)
    want_paged = paged_logits(whole, cfg.num_kv_heads, ids, [5, 1, 4, 1])
    torch.testing.assert_close(want_paged, want_dense, atol=1e-5, rtol=1e-5)

    world = ThreadWorld(tp)
    layouts = shard_layouts(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size, tp)
    shards = [whole.shard(TPRank(lay, ThreadCollective(world, lay.rank))) for lay in layouts]
    for shard, lay in zip(shards, layouts, strict=True):
        assert shard.embed_tokens.weight.shape[0] == cfg.vocab_size // tp
        assert qkv_rows(shard) == (len(lay.q_heads) + 2 * len(lay.kv_heads)) * cfg.head_dim

    def rank(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = shards[r]
        return shard.dense_forward(ids), paged_logits(shard, len(layouts[r].kv_heads), ids, [5, 1, 4, 1])

    (dense, paged), *_ = run_ranks(world, rank)
    torch.testing.assert_close(dense, want_dense, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(paged, want_dense, atol=1e-4, rtol=1e-4)
    assert qkv_rows(whole) == (6 + 2 * 3) * cfg.head_dim  # the whole model is left as it was


def qkv_rows(model: LlamaForCausalLM) -> int:
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    return int(layer.qkv_proj.weight.shape[0])


def test_the_engine_refuses_what_tensor_parallelism_cannot_do_yet() -> None:
    from common.engine.device import Placement
    from common.engine.kv_connector import KVConnector
    from common.engine.llm_engine import _check_tensor_parallel

    class Shipping(KVConnector):
        pass

    cpu = Placement(torch.device("cpu"), torch.float32, "torch", cuda_graphs=False)
    _check_tensor_parallel(cpu, None)
    _check_tensor_parallel(cpu, KVConnector())  # the engine's own no-op connector
    with pytest.raises(ValueError, match="needs the worker ranks' transfer agents"):
        _check_tensor_parallel(cpu, Shipping())  # a connector that cannot drive the ranks' transfers
    shipping = Shipping()
    shipping.rank_transfer = object()  # the services set theirs (kv_transfer.ranks.RankTransfer)
    _check_tensor_parallel(cpu, shipping)
    gpu = Placement(torch.device("cuda"), torch.bfloat16, "triton", cuda_graphs=True)
    with pytest.raises(ValueError, match="CPU only"):
        _check_tensor_parallel(gpu, None)
    with pytest.raises(ValueError, match="attention_backend=triton"):
        _check_tensor_parallel(Placement(torch.device("cpu"), torch.float32, "triton", False), None)


def test_a_shard_cannot_be_exported_or_sharded_again() -> None:
    cfg = tiny(True, False)
    lay = shard_layouts(6, 3, 48, 48, 2)[0]
    shard = whole_model(cfg).shard(TPRank(lay, ThreadCollective(ThreadWorld(2), 0)))
    with pytest.raises(ValueError, match="no HF state dict"):
        shard.hf_state_dict()
    with pytest.raises(ValueError, match="shard already"):
        shard.shard(TPRank(lay, ThreadCollective(ThreadWorld(2), 0)))


# --- the rank-agent channel (common/parallel/messages.py) -------------------------------------------


def test_an_agent_message_that_does_not_decode_fails_the_call_it_names() -> None:
    """Rank 0's reading side (the agent's, a call it cannot decode: tests/integration/test_rank_agent.py)."""
    import multiprocessing as mp

    import msgspec

    from common.engine.tp_workers import _read
    from common.parallel.messages import Open, RankArrived, RankCall, RankGone, RankReply
    from common.protocol import PROTOCOL_VERSION, ProtocolError, decode, encode

    ours, theirs = mp.Pipe()
    theirs.send_bytes(encode(RankArrived(request_id="a", fence=1, why="")))
    assert _read(2, ours) == RankArrived(request_id="a", fence=1, why="")
    bad = {"kind": "rank_reply", "protocol_version": PROTOCOL_VERSION, "call_id": 5, "error": 1}
    theirs.send_bytes(msgspec.msgpack.encode(bad))
    assert _read(2, ours) == RankReply(
        call_id=5, error="rank 2: bad 'rank_reply' message: Expected `str`, got `int` - at `$.error`"
    )
    theirs.send_bytes(msgspec.msgpack.encode(["reply", 5, ""]))  # the untyped tuples of old: no call named
    assert _read(2, ours) is None
    theirs.close()
    assert _read(2, ours) == RankGone()
    with pytest.raises(ProtocolError, match="Invalid value 'rank_reply'"):  # a reply is no call
        decode(encode(RankReply(call_id=1)), RankCall)
    assert decode(encode(RankCall(call_id=1, op=Open("a", 1))), RankCall).op == Open("a", 1)
