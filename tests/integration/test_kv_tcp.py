"""The tcp KV transport over loopback: byte-exact moves, ordering, fences, preflight, bad headers, head
slices between tensor-parallel shards.

The receiver serves on its own event loop in a background thread (a second loop, as in another process);
one test runs it in a real spawned process. Shapes are tiny: a block of one layer is 256 bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.parallel.plan import HeadSlice, plan
from common.protocol import PROTOCOL_VERSION, KVDone, decode, frame
from kv_transfer import Endpoint, TransferError
from kv_transfer.backends.tcp import TcpReceiver, TcpSender
from kv_transfer.control.messages import KVHello, KVHelloReply
from kv_transfer.layout import block_bytes, slice_bytes
from tests.support.kv_helpers import (
    DST,
    HEAD_SLICE_CASES,
    MISMATCHED,
    MODEL_KV_HEADS,
    SPEC,
    SRC,
    Owner,
    assert_moved,
    assert_preflight_refused_and_cached,
    assert_refused_untouched,
    authenticated_socket,
    compat,
    filled,
    move_heads,
    push,
    received_in_another_process,
    shard_compat,
    shard_spec,
)


class ThreadReceiver:
    """A TcpReceiver serving on its own event loop in a background thread."""

    def __init__(self, spec: KVCacheSpec, accept: Callable[[str, int], bool] = lambda r, f: True) -> None:
        self.kv = PagedKVCache(spec)
        self.layers_at_done: list[int] = []
        self._cv = threading.Condition()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.owner = Owner(accept, self._on_done)
        self.done = self.owner.done
        self.rx = TcpReceiver(self.kv, compat(spec), self.owner)
        self.endpoint = asyncio.run_coroutine_threadsafe(self.rx.start(), self.loop).result(10)

    def _on_done(self, msg: KVDone) -> None:
        with self._cv:
            self.layers_at_done.append(self.rx.stats.layers_received)
            self._cv.notify_all()

    def wait_done(self, n: int) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.done) >= n, timeout=10), f"{len(self.done)} kv_done"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.rx.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def receiver() -> Iterator[ThreadReceiver]:
    r = ThreadReceiver(SPEC)
    yield r
    r.close()


def test_layers_move_byte_exact_and_done_follows_them(receiver: ThreadReceiver) -> None:
    src = filled(SPEC)

    async def main() -> None:
        tx = TcpSender(src, compat(SPEC), sender_id="p0")
        await push(tx, receiver.endpoint, "r1", 3, [0, 2])
        await tx.close()

    asyncio.run(main())
    receiver.wait_done(1)
    assert_moved(src, receiver.kv, [0, 2])
    assert receiver.done == [KVDone("r1", 3, 42, 19, 2)]
    assert receiver.layers_at_done == [2]  # kv_done reached the owner after both layers had landed
    assert receiver.owner.arrived == [("r1", 3, 0), ("r1", 3, 2)]  # and so did each layer, in order
    assert receiver.rx.stats.bytes_received == 2 * len(DST) * 2 * block_bytes(src)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])  # no numpy dtype: byte views
def test_layers_move_byte_exact_between_processes(tmp_path: Path, dtype: torch.dtype) -> None:
    spec = dataclasses.replace(SPEC, dtype=dtype)
    src = filled(spec, seed=1)

    async def send(endpoint: str) -> None:
        tx = TcpSender(src, compat(spec))
        await push(tx, endpoint, "r1", 1, [0, 1, 2])
        await tx.close()

    assert_moved(src, received_in_another_process(TcpReceiver, spec, tmp_path, send), [0, 1, 2])


def test_stale_fence_is_drained_not_written_and_connection_stays_usable() -> None:
    receiver = ThreadReceiver(SPEC, accept=lambda rid, fence: fence == 2)
    src = filled(SPEC)
    try:

        async def main() -> None:
            tx = TcpSender(src, compat(SPEC))
            await push(tx, receiver.endpoint, "old", 1, [0, 1])  # stale: blocks may belong to someone else
            await push(tx, receiver.endpoint, "new", 2, [1])  # same connection, current fence
            await tx.close()

        asyncio.run(main())
        receiver.wait_done(2)
        assert_moved(src, receiver.kv, [1])  # only the current request's layer landed
        stats = receiver.rx.stats
        assert (stats.stale_drops, stats.layers_received) == (2, 1)
        assert receiver.owner.arrived == [("new", 2, 1)]  # a drained layer never "arrived"
        # kv_done is passed on either way; the owner ignores one with a stale fence
        assert [d.request_id for d in receiver.done] == ["old", "new"]
    finally:
        receiver.close()


def test_preflight_mismatch_names_fields_is_cached_and_sends_nothing(receiver: ThreadReceiver) -> None:
    spec = MISMATCHED
    src = filled(spec)

    async def main() -> None:
        tx = TcpSender(src, compat(spec))
        await assert_preflight_refused_and_cached(tx, receiver.endpoint)

    asyncio.run(main())
    assert_refused_untouched(receiver.rx, receiver.kv)


def _raw_client(endpoint: str) -> socket.socket:
    """A hand-driven connection that has passed the authentication and the preflight."""
    ep = Endpoint.parse(endpoint, "tcp")
    sock = authenticated_socket((ep.host, ep.port))
    sock.sendall(frame(KVHello(compat=compat(SPEC))))
    (n,) = struct.unpack(">I", sock.recv(4))
    assert decode(sock.recv(n), KVHelloReply).ok
    return sock


def test_hello_of_another_protocol_version_is_refused_with_the_reason(receiver: ThreadReceiver) -> None:
    ep = Endpoint.parse(receiver.endpoint, "tcp")
    sock = authenticated_socket((ep.host, ep.port))
    hello = {"kind": "kv_hello", "protocol_version": PROTOCOL_VERSION + 1, "compat": {}, "sender_id": "x"}
    body = msgpack.packb(hello)
    sock.sendall(struct.pack(">I", len(body)) + body)
    (n,) = struct.unpack(">I", sock.recv(4))
    reply = decode(sock.recv(n), KVHelloReply)
    assert not reply.ok and f"protocol_version {PROTOCOL_VERSION + 1} is not supported" in reply.error
    assert sock.recv(1) == b""  # and then it hung up
    sock.close()
    assert receiver.rx.stats.preflight_refusals == 1


def test_an_oversized_frame_is_refused_before_it_is_read(receiver: ThreadReceiver) -> None:
    sock = _raw_client(receiver.endpoint)
    sock.sendall(struct.pack(">I", 1 << 31))  # claims 2 GiB: nothing is allocated, the peer is dropped
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""
    sock.close()
    assert receiver.rx.stats.bad_messages == 1


@pytest.mark.parametrize(
    "nbytes_delta, block, heads",
    [
        (-4, 3, (0, 0)),  # short payload
        (0, SPEC.num_blocks, (0, 0)),  # bad id
        (0, 3, (1, 2)),  # heads 1..3 of a 2-head shard
        (0, 3, (0, -1)),  # a negative head count
        (4, 3, (1, 1)),  # a long payload for a 1-head slice
    ],
)
def test_bad_header_closes_connection_and_writes_nothing(
    receiver: ThreadReceiver, nbytes_delta: int, block: int, heads: tuple[int, int]
) -> None:
    sock = _raw_client(receiver.endpoint)
    nbytes = 2 * slice_bytes(receiver.kv, max(heads[1], 0) or SPEC.num_kv_heads) + nbytes_delta
    header = {"kind": "kv_layer", "protocol_version": PROTOCOL_VERSION, "request_id": "r", "fence": 1}
    header.update(layer=0, block_ids=[block], nbytes=nbytes, head_start=heads[0], head_count=heads[1])
    body = msgpack.packb(header)
    sock.sendall(struct.pack(">I", len(body)) + body + b"\x7f" * nbytes)
    with contextlib.suppress(ConnectionResetError):  # a reset: our payload was still unread over there
        assert sock.recv(1) == b""  # the receiver hung up
    sock.close()
    assert receiver.rx.stats.bad_messages == 1 and receiver.rx.stats.layers_received == 0
    assert not receiver.kv.k.any() and not receiver.kv.v.any()


def test_sender_errors_when_the_receiver_is_gone() -> None:
    receiver = ThreadReceiver(SPEC)
    endpoint = receiver.endpoint
    receiver.close()

    async def main() -> None:
        tx = TcpSender(filled(SPEC), compat(SPEC), connect_timeout=5)
        with pytest.raises(TransferError, match="cannot open"):
            await tx.send_layer(endpoint, "r", 1, 0, SRC, DST)
        with pytest.raises(ValueError):
            await tx.send_layer(endpoint, "r", 1, 0, SRC, DST[:2])

    asyncio.run(main())


def test_concurrent_sends_to_one_endpoint_do_not_interleave(receiver: ThreadReceiver) -> None:
    src = filled(SPEC)

    async def main() -> None:
        tx = TcpSender(src, compat(SPEC))
        layers = [tx.send_layer(receiver.endpoint, "r", 1, layer, SRC, DST) for layer in range(3)]
        await asyncio.gather(*layers)
        await tx.send_done(receiver.endpoint, KVDone("r", 1, 0, 1, 3))
        await tx.close()

    asyncio.run(main())
    receiver.wait_done(1)
    assert_moved(src, receiver.kv, [0, 1, 2])
    assert receiver.rx.stats.layers_received == 3
    asyncio.run_coroutine_threadsafe(receiver.rx.wait_idle("r"), receiver.loop).result(5)


@pytest.mark.parametrize("num_kv_heads, src_tp, dst_tp", HEAD_SLICE_CASES)
def test_head_slices_move_between_tensor_parallel_shards(num_kv_heads: int, src_tp: int, dst_tp: int) -> None:
    txs, _ = asyncio.run(move_heads(TcpReceiver, TcpSender, num_kv_heads, src_tp, dst_tp))
    assert sum(tx.stats.layers_sent for tx in txs) == 2 * len(plan(num_kv_heads, src_tp, dst_tp))


def test_a_head_slice_past_the_senders_shard_is_refused_before_connecting() -> None:
    async def main() -> None:
        tx = TcpSender(filled(shard_spec(MODEL_KV_HEADS, 1, 0)), shard_compat(MODEL_KV_HEADS, 1, 0))
        for heads in (HeadSlice(2, 0, 2), HeadSlice(0, 0, 0), HeadSlice(-1, 0, 1), HeadSlice(0, -1, 1)):
            with pytest.raises(ValueError, match="range of heads"):
                await tx.send_layer("tcp://127.0.0.1:1", "r", 1, 0, SRC, DST, heads=heads)
        await tx.close()

    asyncio.run(main())
