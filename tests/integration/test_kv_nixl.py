"""The nixl KV transport (NIXL + UCX, DRAM to DRAM) over loopback: byte-exact moves, ordering, fences,
revokes, preflight, descriptor preparation once per peer, head slices between tensor-parallel shards.

Most tests run both agents in one process on one event loop; one runs the receiver in a spawned process.
Shapes are tiny: a block of one layer is 256 bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.parallel.plan import HeadSlice, plan
from common.protocol import KVCompat, KVDone
from kv_transfer import Endpoint, TransferError, available_backends, make_receiver, make_sender
from kv_transfer.backends.nixl import NixlReceiver, NixlSender  # imports no NIXL yet
from kv_transfer.layout import block_bytes
from tests.support.kv_helpers import (
    DST,
    HEAD_SLICE_CASES,
    MISMATCHED,
    MODEL_KV_HEADS,
    SPEC,
    SRC,
    LoopReceiver,
    Owner,
    assert_moved,
    assert_preflight_refused_and_cached,
    assert_refused_untouched,
    compat,
    filled,
    move_heads,
    push,
    received_in_another_process,
    shard_compat,
    shard_spec,
)

# UCX reads its environment when the first agent starts; spawned receivers inherit it.
os.environ["UCX_NET_DEVICES"] = "lo"
pytest.importorskip("nixl_cu12", reason="the nixl backend needs the nixl-cu12 package")


class Receiver(LoopReceiver[NixlReceiver]):
    """A NixlReceiver on the running loop that records kv_done messages."""

    def __init__(
        self,
        spec: KVCacheSpec,
        accept: Callable[[str, int], bool] = lambda r, f: True,
        kv_compat: KVCompat | None = None,
    ) -> None:
        super().__init__(NixlReceiver, spec, accept, kv_compat)


def test_layers_move_byte_exact_and_done_follows_them() -> None:
    src = filled(SPEC)

    async def main() -> Receiver:
        async with Receiver(SPEC) as r:
            tx = NixlSender(src, compat(SPEC), sender_id="p0")
            await push(tx, r.endpoint, "r1", 3, [0, 2])
            await r.wait_done(1)
            await tx.close()
            return r

    r = asyncio.run(main())
    assert_moved(src, r.kv, [0, 2])
    assert r.done == [KVDone("r1", 3, 42, 19, 2)]
    assert r.layers_at_done == [2]  # kv_done reached the owner after both layers' notifications
    assert r.owner.arrived == [("r1", 3, 0), ("r1", 3, 2)]
    assert r.rx.stats.bytes_received == 2 * len(DST) * 2 * block_bytes(src)
    assert Endpoint.parse(r.endpoint, "nixl").host == "127.0.0.1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])  # no numpy dtype: byte views
def test_layers_move_byte_exact_between_processes(tmp_path: Path, dtype: torch.dtype) -> None:
    spec = dataclasses.replace(SPEC, dtype=dtype)
    src = filled(spec, seed=1)

    async def send(endpoint: str) -> None:
        tx = NixlSender(src, compat(spec))
        await push(tx, endpoint, "r1", 1, [0, 1, 2])
        await tx.close()

    assert_moved(src, received_in_another_process(NixlReceiver, spec, tmp_path, send), [0, 1, 2])


def test_stale_fence_is_refused_before_any_write() -> None:
    src = filled(SPEC)

    async def main() -> tuple[Receiver, NixlSender]:
        async with Receiver(SPEC, accept=lambda rid, fence: fence == 2) as r:
            tx = NixlSender(src, compat(SPEC))
            await push(tx, r.endpoint, "old", 1, [0, 1])  # stale: blocks may belong to someone else
            await push(tx, r.endpoint, "new", 2, [1])  # same peer, current fence
            await r.wait_done(2)
            await tx.close()
            return r, tx

    r, tx = asyncio.run(main())
    assert_moved(src, r.kv, [1])  # only the current request's layer landed
    stats = r.rx.stats
    assert (stats.stale_drops, stats.layers_received, stats.bad_messages) == (1, 1, 0)  # one refused begin
    assert tx.stale_skips == 2 and tx.stats.layers_sent == 1
    # kv_done is passed on either way; the owner ignores one with a stale fence
    assert [d.request_id for d in r.done] == ["old", "new"]


def test_revoke_waits_for_posted_writes_and_stops_later_ones() -> None:
    src = filled(SPEC)
    current = {1}  # fences of "r" the decode side holds blocks for

    async def main() -> tuple[Receiver, NixlSender, NixlSender]:
        async with Receiver(SPEC, accept=lambda rid, fence: fence in current) as r:
            old, retry = NixlSender(src, compat(SPEC)), NixlSender(src, compat(SPEC))
            await old.send_layer(r.endpoint, "r", 1, 0, SRC, DST)
            current.clear()  # the decode side cancels fence 1 ...
            current.add(2)  # ... and a retry reuses the id with fence 2, writing from another sender
            await retry.send_layer(r.endpoint, "r", 2, 1, SRC, DST)
            async with asyncio.timeout(10):
                await r.rx.wait_idle("r")  # revokes (r, 1) only; its posted write was waited for
            assert r.rx.stats.layers_received == 2
            r.kv.k[0].zero_()
            r.kv.v[0].zero_()  # fence 1's blocks are free now: another request may use them
            await push(old, r.endpoint, "r", 1, [0, 2])  # the old sender carries on, unaware: nothing lands
            await push(retry, r.endpoint, "r", 2, [2])  # the retry is unaffected
            await r.wait_done(2)
            await old.close()
            await retry.close()
            return r, old, retry

    r, old, retry = asyncio.run(main())
    assert not r.kv.k[0].any() and not r.kv.v[0].any()
    for layer in (1, 2):
        assert torch.equal(r.kv.k[layer, DST], src.k[layer, SRC])
    assert (old.stale_skips, retry.stale_skips) == (2, 0)
    assert r.rx.stats.layers_received == 3
    # both kv_done are passed on; the owner ignores fence 1's (stale); fence 2's came after its 2 layers
    assert [(d.fence, n) for d, n in zip(r.done, r.layers_at_done, strict=True)] == [(1, 2), (2, 3)]


def test_a_lost_sender_is_waited_out_and_its_done_never_delivered() -> None:
    src = filled(SPEC)

    async def main() -> Receiver:
        async with Receiver(SPEC) as r:
            r.rx.lost_peer_grace_s = 0.2
            tx = NixlSender(src, compat(SPEC))
            await tx.send_layer(r.endpoint, "r", 1, 0, SRC, DST)
            async with asyncio.timeout(10):  # its layer landed and was heard of
                while r.rx.stats.layers_received < 1:
                    await asyncio.sleep(0.01)
            await tx.close()  # gone without kv_done (a crash looks the same from here)
            async with asyncio.timeout(10):
                await r.rx.wait_idle("r")
            return r

    r = asyncio.run(main())
    assert r.done == [] and r.rx.stats.layers_received == 1


def test_a_quiet_open_request_is_polled_with_back_off() -> None:
    """Between two layers of a long prefill nothing is due: the receiver backs off to poll_idle_s
    instead of polling every poll_active_s (a 1 ms poll through a 9 s prefill took ~0.4 s of CPU from
    the prefill, bench overlap)."""
    src = filled(SPEC)
    polls = 0

    async def main() -> tuple[Receiver, int]:
        nonlocal polls
        async with Receiver(SPEC) as r:
            rx = r.rx
            get = rx._agent.get_new_notifs

            def counted() -> dict[str, list[bytes]]:
                nonlocal polls
                polls += 1
                return get()

            rx._agent.get_new_notifs = counted
            tx = NixlSender(src, compat(SPEC))
            await tx.send_layer(r.endpoint, "r", 1, 0, SRC, DST)
            async with asyncio.timeout(10):  # the first layer is heard of
                while rx.stats.layers_received < 1:
                    await asyncio.sleep(0.01)
            polls = 0
            await asyncio.sleep(1.0)  # "the next layer is still being computed"
            quiet = polls
            await tx.send_layer(r.endpoint, "r", 1, 1, SRC, DST)
            await tx.send_done(r.endpoint, KVDone("r", 1, 42, 19, 2))
            await r.wait_done(1)
            await tx.close()
            return r, quiet

    r, quiet = asyncio.run(main())
    assert r.done == [KVDone("r", 1, 42, 19, 2)] and r.layers_at_done == [2]
    # back-off 1, 2, 4, ..., 50 ms: ~25 polls in a second; at a fixed 1 ms it was ~1,000
    assert quiet < 100, quiet


def test_preflight_mismatch_names_fields_is_cached_and_writes_nothing() -> None:
    spec = MISMATCHED
    src = filled(spec)

    async def main() -> Receiver:
        async with Receiver(SPEC) as r:
            tx = NixlSender(src, compat(spec))
            await assert_preflight_refused_and_cached(tx, r.endpoint)
            return r

    r = asyncio.run(main())
    assert_refused_untouched(r.rx, r.kv)


def test_descriptors_are_prepared_once_per_peer() -> None:
    src = filled(SPEC)

    async def main() -> tuple[Receiver, Receiver, NixlSender]:
        async with Receiver(SPEC) as a, Receiver(SPEC) as b:
            tx = NixlSender(src, compat(SPEC))
            for i in range(4):
                await push(tx, a.endpoint, f"a{i}", 1, [0, 1, 2])
                await push(tx, b.endpoint, f"b{i}", 1, [i % 3])
            await a.wait_done(4)
            await b.wait_done(4)
            await tx.close()
            return a, b, tx

    a, b, tx = asyncio.run(main())
    assert tx.dlist_preps == {"local": 1, a.endpoint: 1, b.endpoint: 1}
    assert a.layers_at_done == [3, 6, 9, 12] and b.rx.stats.layers_received == 4
    assert_moved(src, a.kv, [0, 1, 2])


def test_concurrent_layers_then_done() -> None:
    src = filled(SPEC)

    async def main() -> Receiver:
        async with Receiver(SPEC) as r:
            tx = NixlSender(src, compat(SPEC))
            await asyncio.gather(*[tx.send_layer(r.endpoint, "r", 1, layer, SRC, DST) for layer in range(3)])
            await tx.send_done(r.endpoint, KVDone("r", 1, 0, 1, 3))
            await r.wait_done(1)
            await r.rx.wait_idle("r")
            await tx.close()
            return r

    r = asyncio.run(main())
    assert_moved(src, r.kv, [0, 1, 2])
    assert r.layers_at_done == [3]


def test_bad_arguments_and_a_missing_receiver() -> None:
    async def main() -> None:
        async with Receiver(SPEC) as r:
            endpoint = r.endpoint
            tx = NixlSender(filled(SPEC), compat(SPEC), connect_timeout=5)
            with pytest.raises(ValueError, match="destination"):
                await tx.send_layer(endpoint, "r", 1, 0, [0], [SPEC.num_blocks])
            with pytest.raises(ValueError):
                await tx.send_layer(endpoint, "r", 1, 0, SRC, DST[:2])
            await tx.close()
        assert r.rx.stats.layers_received == 0
        tx = NixlSender(filled(SPEC), compat(SPEC), connect_timeout=5)
        with pytest.raises(TransferError, match="cannot open"):
            await tx.send_layer(endpoint, "r", 1, 0, SRC, DST)
        await tx.close()

    asyncio.run(main())


def test_backend_registry() -> None:
    assert available_backends() == ["tcp", "nixl", "torch_dist"]
    kv = PagedKVCache(SPEC)
    tx = make_sender("nixl", kv, compat(SPEC))
    rx = make_receiver("nixl", kv, compat(SPEC), Owner())
    assert isinstance(tx, NixlSender) and isinstance(rx, NixlReceiver)
    asyncio.run(tx.close())
    asyncio.run(rx.close())
    with pytest.raises(ValueError, match="available: tcp, nixl"):
        make_sender("carrier-pigeon", kv, compat(SPEC))


@pytest.mark.parametrize("num_kv_heads, src_tp, dst_tp", HEAD_SLICE_CASES)
def test_head_slices_move_between_tensor_parallel_shards(num_kv_heads: int, src_tp: int, dst_tp: int) -> None:
    txs, rxs = asyncio.run(move_heads(NixlReceiver, NixlSender, num_kv_heads, src_tp, dst_tp))
    routes = plan(num_kv_heads, src_tp, dst_tp)
    for p, tx in enumerate(txs):
        assert isinstance(tx, NixlSender)
        # Sliced writes prepare nothing (their descriptors are made per write): the block list of each
        # receiver is prepared at connect, ours never (no whole-block write was made).
        assert tx.dlist_preps == {rxs[r.dst_rank].endpoint: 1 for r in routes if r.src_rank == p}
        assert tx.stats.layers_sent == 2 * len([r for r in routes if r.src_rank == p])
    assert sum(tx.stats.bytes_sent for tx in txs) == sum(r.rx.stats.bytes_received for r in rxs)


def test_writes_that_do_not_fit_the_receivers_heads_are_refused_before_any_write() -> None:
    """A WRITE cannot be refused over there: the sender checks heads against the receiver's hello."""

    async def main() -> Receiver:
        spec = shard_spec(MODEL_KV_HEADS, 2, 1)  # decode rank 1 of 2: one head
        async with Receiver(spec, kv_compat=shard_compat(MODEL_KV_HEADS, 2, 1)) as r:
            src = filled(shard_spec(MODEL_KV_HEADS, 1, 0))  # three heads
            tx = NixlSender(src, shard_compat(MODEL_KV_HEADS, 1, 0))
            with pytest.raises(ValueError, match="only head slices"):
                await tx.send_layer(r.endpoint, "r", 1, 0, SRC, DST)  # whole blocks of different shards
            with pytest.raises(ValueError, match="does not fit"):
                await tx.send_layer(r.endpoint, "r", 1, 0, SRC, DST, heads=HeadSlice(1, 0, 2))
            with pytest.raises(ValueError, match="range of heads"):
                await tx.send_layer(r.endpoint, "r", 1, 0, SRC, DST, heads=HeadSlice(2, 0, 2))
            await tx.close()
            return r

    r = asyncio.run(main())
    assert r.rx.stats.layers_received == 0 and not r.kv.k.any() and not r.kv.v.any()
