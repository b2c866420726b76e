"""The KV connectors without a model or a network: the decode side's reservations (fences, layer
counts, kv_done), the prefill side's per-step block ranges and the life of its writes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.connector.decode import DecodeConnector
from common.connector.prefill import PrefillConnector
from common.connector.remote_kv import IncomingKV, OutgoingKV, TransferState
from common.engine.api import Admission
from common.engine.scheduler import SchedulerOutput
from common.engine.sequence import Sequence
from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.parallel.messages import Close, Open, RankArrived, RankGone, RankOp
from common.parallel.plan import HeadSlice
from common.protocol import KVDone, PrefillRequest
from common.sampling_params import SamplingParams

S = TransferState
BS = 4


class Decode:
    def __init__(self) -> None:
        self.arrived: list[tuple[str, KVDone]] = []
        self.failed: list[tuple[str, str]] = []
        self.c = DecodeConnector(
            on_arrived=lambda rkv, msg: self.arrived.append((rkv.request_id, msg)),
            on_failed=lambda rkv, why: self.failed.append((rkv.request_id, why)),
        )


def seq(rid: str, n: int = 6, **kw: Any) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=3), seq_id=rid, **kw)


def test_a_reservation_accepts_its_own_fence_and_decodes_only_once_every_write_landed() -> None:
    async def main() -> None:
        d = Decode()
        a = await d.c.reserve(Admission("a", [5, 6], 0))
        b = await d.c.reserve(Admission("b", [7], 4))
        assert (a.fence, b.fence) == (1, 2) and b.num_cached_tokens == 4 and a.state is S.RESERVED
        assert not d.c.may_write("a", 2) and not d.c.may_write("zz", 1)  # another fence; no such request
        assert d.c.may_write("a", 1) and a.state is S.RECEIVING
        d.c.layer_arrived("a", 1, 0)
        d.c.layer_arrived("a", 2, 1)  # a stale fence's layer does not count
        d.c.kv_done(KVDone("a", 2, 9, 6, 1))  # stale: dropped
        assert d.arrived == [] and a.state is S.RECEIVING
        d.c.layer_arrived("a", 1, 1)
        d.c.kv_done(KVDone("a", 1, 9, 6, 2))
        assert [r for r, _ in d.arrived] == ["a"] and a.state is S.ARRIVED
        assert not d.c.may_write("a", 1), "after kv_done every write under the fence is stale"
        assert d.failed == []

    asyncio.run(main())


def test_kv_done_with_missing_layers_ends_the_request_instead_of_decoding_it() -> None:
    async def main() -> None:
        d = Decode()
        a = await d.c.reserve(Admission("a", [5, 6], 0))
        assert d.c.may_write("a", 1)
        d.c.layer_arrived("a", 1, 0)
        d.c.kv_done(KVDone("a", 1, 9, 6, 3))  # the sender made 3 writes, 1 landed
        assert d.arrived == [] and a.state is S.ENDED
        assert d.failed == [("a", "KV incomplete: 1 of 3 layer writes arrived")]
        assert not d.c.may_write("a", 1)

    asyncio.run(main())


class Ranks:
    """Rank 0's handle on 2 worker ranks (TPWorkers' transfer side), answering calls at once."""

    world_size = 3

    def __init__(self) -> None:
        self.calls: list[RankOp] = []
        self.report: Any = None
        self.errors = ["", ""]

    def attach(self, on_report: Any) -> None:
        self.report = on_report

    async def call(self, op: RankOp) -> list[str]:
        self.calls.append(op)
        return list(self.errors)


def test_with_tensor_parallelism_a_request_decodes_once_every_rank_has_its_kv() -> None:
    async def main() -> None:
        d, ranks = Decode(), Ranks()
        d.c.ranks = ranks  # type: ignore[assignment]
        a = await d.c.reserve(Admission("a", [5, 6], 0))
        assert ranks.calls == [Open("a", 1)], "every rank opens the fence before Reserved goes out"
        assert d.c.may_write("a", 1)
        for layer in range(2):  # two prefill ranks write into rank 0 (2 -> 3 heterogeneous TP)
            d.c.layer_arrived("a", 1, layer)
        d.c.kv_done(KVDone("a", 1, 9, 6, 1, src_rank=0, senders=2))
        ranks.report(1, RankArrived(request_id="a", fence=1, why=""))
        assert d.arrived == [], "rank 0 still waits for the second prefill rank's kv_done"
        d.c.kv_done(KVDone("a", 1, 9, 6, 1, src_rank=1, senders=2))
        assert d.arrived == [] and a.state is S.RECEIVING, "rank 2 has not reported"
        ranks.report(2, RankArrived(request_id="a", fence=1, why=""))
        assert [(r, m.first_token) for r, m in d.arrived] == [("a", 9)] and a.state is S.ARRIVED
        await d.c.end(a, lambda rid: asyncio.sleep(0))
        assert ranks.calls[-1] == Close("a", 1)

        b = await d.c.reserve(Admission("b", [7], 0))
        why = "KV incomplete: 0 of 1 layer writes arrived"
        ranks.report(2, RankArrived(request_id="b", fence=2, why=why))
        assert d.failed == [("b", "rank 2: KV incomplete: 0 of 1 layer writes arrived")]
        assert b.state is S.ENDED
        c = await d.c.reserve(Admission("c", [8], 0))
        ranks.report(1, RankGone())
        assert d.failed[-1] == ("c", "tensor-parallel rank 1 is gone") and c.state is S.ENDED
        ranks.errors = ["", "rank 2: no"]
        e = await d.c.reserve(Admission("e", [9], 0))
        assert d.failed[-1] == ("e", "rank 2: no") and e.state is S.ENDED, "a rank that cannot open it"

    asyncio.run(main())


def test_ending_a_reservation_waits_for_landing_writes_before_the_blocks_go() -> None:
    async def main() -> None:
        d = Decode()
        a = await d.c.reserve(Admission("a", [5, 6], 0))
        parked = seq("a", remote_kv="receive")
        assert d.c.holds_blocks(parked), "a write may still land: the engine must keep the blocks"
        d.c.may_write("a", 1)
        waited: list[tuple[str, bool]] = []

        async def wait_idle(rid: str) -> None:
            waited.append((rid, d.c.may_write(rid, 1)))  # the fence is already stale when it waits

        await d.c.end(a, wait_idle)
        assert waited == [("a", False)] and a.state is S.ENDED
        assert not d.c.holds_blocks(parked) and "a" not in d.c.requests
        arrived = await d.c.reserve(Admission("b", [1], 0))
        d.c.may_write("b", 2)
        d.c.layer_arrived("b", 2, 0)
        d.c.kv_done(KVDone("b", 2, 1, 1, 1))
        await d.c.end(arrived, wait_idle)  # nothing was open: no wait
        assert waited == [("a", False)]

    asyncio.run(main())


def test_a_lost_prefill_peer_fails_only_an_open_reservation() -> None:
    async def main() -> None:
        d = Decode()
        a = await d.c.reserve(Admission("a", [5], 0))
        d.c.peer_lost(a)
        assert d.failed == [("a", "prefill service lease expired before the KV arrived")]
        d.c.peer_lost(a)  # once
        assert len(d.failed) == 1 and a.state is S.ENDED

    asyncio.run(main())


class Sink:
    """A KV sender that records what it was asked to send (no network)."""

    def __init__(self) -> None:
        self.layers: list[tuple[str, int, int, list[int], list[int]]] = []
        self.dones: list[KVDone] = []
        self.release = asyncio.Event()

    async def send_layer(
        self, endpoint: str, request_id: str, fence: int, layer: int, src: list[int], dst: list[int],
        traceparent: str | None = None, heads: HeadSlice | None = None,
    ) -> None:  # fmt: skip
        assert heads is None, "one rank each side: whole blocks"
        await self.release.wait()
        self.layers.append((request_id, fence, layer, src, dst))

    async def send_done(self, endpoint: str, msg: KVDone) -> None:
        self.dones.append(msg)


def prefill_connector(sink: Sink, layers: int = 2) -> PrefillConnector:
    c = PrefillConnector(lambda endpoint: sink, lambda rkv, why: None)
    spec = KVCacheSpec(num_layers=layers, num_blocks=16, block_size=BS, num_kv_heads=1, head_dim=2)
    c.bind(PagedKVCache(spec))
    return c


def request(rid: str, n: int, dst: list[int], cached_at_decode: int = 0) -> PrefillRequest:
    params = SamplingParams(max_tokens=1)
    return PrefillRequest(rid, list(range(n)), params, "tcp://d:1", dst, 7, cached_at_decode)


def step(*items: tuple[Sequence, int]) -> SchedulerOutput:
    return SchedulerOutput(scheduled=list(items))


@pytest.mark.parametrize("prefix_hit_here", [0, 4])
def test_each_chunk_ships_the_blocks_it_wrote_and_the_first_also_cached_prefix(prefix_hit_here: int) -> None:
    """10 prompt tokens in chunks of 6 and 4, blocks of 4: chunk 1 writes blocks 0-1, chunk 2 finishes
    block 1 (partly written by chunk 1: sent again) and writes block 2. A prefix this service had
    cached (computed before the first chunk) ships with the first chunk."""

    async def main() -> None:
        c = prefill_connector(Sink())
        await c.add(request("a", 10, [20, 21, 22]))
        s = seq("a", 10, remote_kv="send")
        s.block_table = [3, 4, 5]
        s.num_computed_tokens = prefix_hit_here
        first = c.build_meta(step((s, 6 - prefix_hit_here)))
        assert first is not None and [(w.src, w.dst) for w in first.writes] == [([3, 4], [20, 21])]
        s.num_computed_tokens = 6
        second = c.build_meta(step((s, 4)))
        assert second is not None and [(w.src, w.dst) for w in second.writes] == [([4, 5], [21, 22])]

    asyncio.run(main())


def test_blocks_the_decode_side_holds_are_never_sent() -> None:
    async def main() -> None:
        c = prefill_connector(Sink())
        await c.add(request("a", 10, [20, 21, 22], cached_at_decode=8))  # two full blocks over there
        s = seq("a", 10, remote_kv="send")
        s.block_table = [3, 4, 5]
        meta = c.build_meta(step((s, 10)))
        assert meta is not None and [(w.src, w.dst) for w in meta.writes] == [([5], [22])]
        assert c.build_meta(step((seq("other", 4), 4))) is None  # a request with no destination ships nothing

    asyncio.run(main())


def test_writes_go_out_per_layer_and_kv_done_counts_them() -> None:
    async def main() -> None:
        sink = Sink()
        c = prefill_connector(sink, layers=3)
        rkv = await c.add(request("a", 5, [8, 9]))
        s = seq("a", 5, remote_kv="send")
        s.block_table = [1, 2]
        meta = c.build_meta(step((s, 5)))
        assert meta is not None and c.holds_blocks(s)
        for layer in range(3):  # the engine thread, inside the forward pass
            await asyncio.to_thread(c.save_layer, layer, meta)
        assert len(rkv.writes) == 3 and rkv.nbytes == 3 * 2 * c.head_bytes and rkv.layers == {0, 1, 2}
        assert rkv.chunks and rkv.chunks[0][1] >= rkv.chunks[0][0]
        sink.release.set()
        await c.finish_sending(rkv, first_token=11, num_tokens=5)
        assert [(x[2], x[3], x[4]) for x in sink.layers] == [(i, [1, 2], [8, 9]) for i in range(3)]
        assert sink.dones == [KVDone("a", 7, 11, 5, 3)] and rkv.state is S.SENT
        assert c.holds_blocks(s), "kv_done is out, but the blocks go back only once settled"
        await c.settle(rkv)
        assert not c.holds_blocks(s) and "a" not in c.requests

    asyncio.run(main())


def test_a_stopped_request_posts_nothing_more_and_settles_after_its_writes() -> None:
    async def main() -> None:
        sink = Sink()
        c = prefill_connector(sink)
        rkv = await c.add(request("a", 5, [8, 9]))
        s = seq("a", 5, remote_kv="send")
        s.block_table = [1, 2]
        meta = c.build_meta(step((s, 5)))
        assert meta is not None
        await asyncio.to_thread(c.save_layer, 0, meta)
        c.stop(rkv)
        await asyncio.to_thread(c.save_layer, 1, meta)  # the step goes on; its writes do not
        assert len(rkv.writes) == 1
        settling = asyncio.ensure_future(c.settle(rkv))
        await asyncio.sleep(0.01)
        assert not settling.done() and c.holds_blocks(s), "a posted write still reads the blocks"
        sink.release.set()
        await settling
        assert not c.holds_blocks(s) and rkv.state is S.ENDED and sink.dones == []

    asyncio.run(main())


def test_remote_kv_states_say_whether_kv_still_moves() -> None:
    assert IncomingKV("a", 1, [], S.RECEIVING).open and not IncomingKV("a", 1, [], S.ARRIVED).open
    assert OutgoingKV("a", 1, [], S.HELD).open and not OutgoingKV("a", 1, [], S.SENT).open
