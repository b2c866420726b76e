"""The torch_dist KV transport (two-rank gloo groups, host memory) over loopback: byte-exact moves,
ordering, fences, wait_idle, preflight, broken pairs, head slices between tensor-parallel shards.

Most tests run both sides in one process on one event loop: the two ranks' blocking group calls run on
their pairs' threads, so a call that blocked the loop would deadlock the rendezvous. One test runs the
receiver in a spawned process. Shapes are tiny: a block of one layer is 256 bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.parallel.plan import plan
from common.protocol import KVDone, frame
from kv_transfer import (
    Endpoint,
    TransferError,
    available_backends,
    make_receiver,
    make_sender,
    resolve_backend,
)
from kv_transfer.backends.torch_dist import TorchDistReceiver, TorchDistSender
from kv_transfer.control.messages import KVLayerHeader
from kv_transfer.layout import block_bytes
from tests.support.kv_helpers import (
    DST,
    HEAD_SLICE_CASES,
    MISMATCHED,
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
)


class Receiver(LoopReceiver[TorchDistReceiver]):
    """A TorchDistReceiver on the running loop that records kv_done messages."""

    def __init__(self, spec: KVCacheSpec, accept: Callable[[str, int], bool] = lambda r, f: True) -> None:
        super().__init__(functools.partial(TorchDistReceiver, op_timeout_s=20), spec, accept)


def sender(spec: KVCacheSpec = SPEC, seed: int = 0) -> TorchDistSender:
    return TorchDistSender(filled(spec, seed), compat(spec), sender_id="p0", op_timeout_s=20)


def test_layers_move_byte_exact_and_done_follows_them() -> None:
    async def main() -> tuple[Receiver, TorchDistSender]:
        async with Receiver(SPEC) as r:
            tx = sender()
            await push(tx, r.endpoint, "r1", 3, [0, 2])
            await r.wait_done(1)
            await tx.close()
            return r, tx

    r, tx = asyncio.run(main())
    assert_moved(tx.kv, r.kv, [0, 2])
    assert r.done == [KVDone("r1", 3, 42, 19, 2)]
    assert r.layers_at_done == [2]  # kv_done reached the owner after both layers were scattered
    assert r.owner.arrived == [("r1", 3, 0), ("r1", 3, 2)]
    assert r.rx.stats.bytes_received == tx.stats.bytes_sent == 2 * len(DST) * 2 * block_bytes(tx.kv)
    assert Endpoint.parse(r.endpoint, "torch_dist").host == "127.0.0.1"


def test_layers_move_byte_exact_between_processes(tmp_path: Path) -> None:
    spec = dataclasses.replace(SPEC, dtype=torch.bfloat16)  # moved as raw bytes: any dtype works
    tx = sender(spec, seed=1)

    async def send(endpoint: str) -> None:
        await push(tx, endpoint, "r1", 1, [0, 1, 2])
        await tx.close()

    assert_moved(tx.kv, received_in_another_process(TorchDistReceiver, spec, tmp_path, send), [0, 1, 2])


def test_stale_fence_is_received_and_dropped_and_the_pair_stays_usable() -> None:
    async def main() -> tuple[Receiver, TorchDistSender]:
        async with Receiver(SPEC, accept=lambda rid, fence: fence == 2) as r:
            tx = sender()
            await push(tx, r.endpoint, "old", 1, [0, 1])  # stale: blocks may belong to someone else
            await push(tx, r.endpoint, "new", 2, [1])  # same pair, current fence
            await r.wait_done(2)
            await tx.close()
            return r, tx

    r, tx = asyncio.run(main())
    assert_moved(tx.kv, r.kv, [1])  # only the current request's layer landed
    stats = r.rx.stats
    assert (stats.stale_drops, stats.layers_received, stats.bad_messages) == (2, 1, 0)
    assert tx.stats.layers_sent == 3  # the sender cannot tell: the receiver consumed and dropped them
    # kv_done is passed on either way; the owner ignores one with a stale fence
    assert [d.request_id for d in r.done] == ["old", "new"]


def test_wait_idle_waits_for_an_accepted_layer_and_later_ones_are_dropped() -> None:
    current = {1}
    gate = threading.Event()

    async def main() -> tuple[Receiver, TorchDistSender]:
        async with Receiver(SPEC, accept=lambda rid, fence: fence in current) as r:
            land = r.rx._land

            def gated(*args: Any) -> None:  # the pair's thread: hold the first layer before it lands
                assert gate.wait(10)
                land(*args)

            r.rx._land = gated  # type: ignore[method-assign]
            tx = sender()
            first = asyncio.create_task(tx.send_layer(r.endpoint, "r", 1, 0, SRC, DST))
            async with asyncio.timeout(10):
                while not r.rx._writing["r"]:  # the header was accepted; its bytes are held back
                    await asyncio.sleep(0.001)
            current.clear()  # the decode side cancels the request ...
            idle = asyncio.create_task(r.rx.wait_idle("r"))
            await asyncio.sleep(0.1)
            assert not idle.done()  # ... and must wait: the accepted layer may still land
            gate.set()
            async with asyncio.timeout(10):
                await idle
                await first
            assert r.rx.stats.layers_received == 1  # it landed before wait_idle returned
            r.kv.k.zero_()
            r.kv.v.zero_()  # the blocks are free now: another request may use them
            await push(tx, r.endpoint, "r", 1, [1, 2])  # the sender carries on, unaware: nothing lands
            await r.wait_done(1)
            await tx.close()
            return r, tx

    r, tx = asyncio.run(main())
    assert not r.kv.k.any() and not r.kv.v.any()
    assert (r.rx.stats.layers_received, r.rx.stats.stale_drops) == (1, 2)


def test_preflight_mismatch_names_fields_is_cached_and_sends_nothing() -> None:
    spec = MISMATCHED

    async def main() -> Receiver:
        async with Receiver(SPEC) as r:
            tx = sender(spec)
            await assert_preflight_refused_and_cached(tx, r.endpoint)
            return r

    r = asyncio.run(main())
    assert_refused_untouched(r.rx, r.kv)


def test_concurrent_layers_then_done_and_one_pair_per_endpoint() -> None:
    async def main() -> tuple[Receiver, Receiver, TorchDistSender]:
        async with Receiver(SPEC) as a, Receiver(SPEC) as b:
            tx = sender()
            for i in range(2):
                layers = [tx.send_layer(a.endpoint, f"a{i}", 1, layer, SRC, DST) for layer in range(3)]
                await asyncio.gather(*layers, tx.send_layer(b.endpoint, f"b{i}", 1, i, SRC, DST))
                await tx.send_done(a.endpoint, KVDone(f"a{i}", 1, 0, 1, 3))
                await tx.send_done(b.endpoint, KVDone(f"b{i}", 1, 0, 1, 1))
            await a.wait_done(2)
            await b.wait_done(2)
            await a.rx.wait_idle("a1")
            assert len(tx._peers) == 2 and len(a.rx._pairs) == len(b.rx._pairs) == 1
            await tx.close()
            return a, b, tx

    a, b, tx = asyncio.run(main())
    assert_moved(tx.kv, a.kv, [0, 1, 2])
    assert_moved(tx.kv, b.kv, [0, 1])
    assert a.layers_at_done == [3, 6] and b.layers_at_done == [1, 2]


def test_a_bad_header_breaks_the_pair_and_the_sender_reconnects() -> None:
    async def main() -> tuple[Receiver, TorchDistSender]:
        async with Receiver(SPEC) as r:
            tx = sender()
            await tx.send_layer(r.endpoint, "r", 1, 0, SRC, DST)
            peer = tx._peers[r.endpoint]
            # A header the receiver refuses (a foreign or buggy sender): it closes the connection.
            bad = KVLayerHeader("x", 1, 0, [SPEC.num_blocks], 2 * block_bytes(tx.kv))
            peer.writer.write(frame(bad))
            async with asyncio.timeout(10):
                while r.endpoint in tx._peers:
                    await asyncio.sleep(0.001)
            assert peer.broken
            await push(tx, r.endpoint, "r2", 1, [1])  # a new pair
            await r.wait_done(1)
            await tx.close()
            return r, tx

    r, tx = asyncio.run(main())
    assert r.rx.stats.bad_messages == 1 and r.rx.stats.layers_received == 2
    assert_moved(tx.kv, r.kv, [0, 1])


def test_bad_arguments_and_a_missing_receiver() -> None:
    async def main() -> None:
        async with Receiver(SPEC) as r:
            endpoint = r.endpoint
            tx = sender()
            with pytest.raises(ValueError, match="destination"):
                await tx.send_layer(endpoint, "r", 1, 0, [0], [SPEC.num_blocks])
            with pytest.raises(ValueError):
                await tx.send_layer(endpoint, "r", 1, 0, SRC, DST[:2])
            await tx.close()
        assert r.rx.stats.layers_received == 0
        tx = TorchDistSender(filled(SPEC), compat(SPEC), connect_timeout=5)
        with pytest.raises(TransferError, match="cannot open"):
            await tx.send_layer(endpoint, "r", 1, 0, SRC, DST)
        await tx.close()

    asyncio.run(main())
    with pytest.raises(ValueError, match="torch_dist://host:port"):
        Endpoint.parse("tcp://127.0.0.1:1", "torch_dist")


def test_backend_registry() -> None:
    assert "torch_dist" in available_backends()
    assert resolve_backend("auto")[0] in ("nixl", "tcp")  # auto never picks torch_dist
    assert resolve_backend("torch_dist") == ("torch_dist", "configured")
    kv = PagedKVCache(SPEC)
    tx = make_sender("torch_dist", kv, compat(SPEC))
    rx = make_receiver("torch_dist", kv, compat(SPEC), Owner())
    assert isinstance(tx, TorchDistSender) and isinstance(rx, TorchDistReceiver)
    asyncio.run(tx.close())
    asyncio.run(rx.close())


@pytest.mark.parametrize("num_kv_heads, src_tp, dst_tp", HEAD_SLICE_CASES)
def test_head_slices_move_between_tensor_parallel_shards(num_kv_heads: int, src_tp: int, dst_tp: int) -> None:
    make_rx = functools.partial(TorchDistReceiver, op_timeout_s=20)
    make_tx = functools.partial(TorchDistSender, op_timeout_s=20)
    txs, rxs = asyncio.run(move_heads(make_rx, make_tx, num_kv_heads, src_tp, dst_tp))
    assert sum(tx.stats.bytes_sent for tx in txs) == sum(r.rx.stats.bytes_received for r in rxs)
    assert sum(tx.stats.layers_sent for tx in txs) == 2 * len(plan(num_kv_heads, src_tp, dst_tp))
