"""The tcp KV transport over loopback: byte-exact moves, ordering, fences, preflight, bad headers.

The receiver serves on its own event loop in a background thread (a second loop, as in another process);
one test runs it in a real spawned process. Shapes are tiny: a block of one layer is 256 bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.protocol import PROTOCOL_VERSION, KVCompat, KVDone, KVHello, KVHelloReply, decode, frame
from kv_transfer import PreflightError, TransferError
from kv_transfer.layout import block_bytes
from kv_transfer.tcp import TcpReceiver, TcpSender, parse_endpoint

SPEC = KVCacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
SRC = [7, 3, 4, 5, 12]  # non-contiguous, unordered; 3-4-5 is one run
DST = [9, 10, 2, 0, 14]  # 9-10 is one run


def compat(spec: KVCacheSpec) -> KVCompat:
    dtype = str(spec.dtype).removeprefix("torch.")
    return KVCompat("tiny", "h", dtype, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size)


def filled(spec: KVCacheSpec, seed: int = 0) -> PagedKVCache:
    kv = PagedKVCache(spec)
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


def assert_moved(src: PagedKVCache, dst: PagedKVCache, layers: list[int]) -> None:
    """dst holds src's SRC blocks at DST for `layers`, and zeros everywhere else."""
    want_k, want_v = torch.zeros_like(dst.k), torch.zeros_like(dst.v)
    for layer in layers:
        want_k[layer, DST] = src.k[layer, SRC]
        want_v[layer, DST] = src.v[layer, SRC]
    assert torch.equal(dst.k, want_k) and torch.equal(dst.v, want_v)


class ThreadReceiver:
    """A TcpReceiver serving on its own event loop in a background thread."""

    def __init__(self, spec: KVCacheSpec, accept: Callable[[str, int], bool] = lambda r, f: True) -> None:
        self.kv = PagedKVCache(spec)
        self.done: list[KVDone] = []
        self.layers_at_done: list[int] = []
        self._cv = threading.Condition()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.rx = TcpReceiver(self.kv, compat(spec), accept, self._on_done)
        self.endpoint = asyncio.run_coroutine_threadsafe(self.rx.start(), self.loop).result(10)

    def _on_done(self, msg: KVDone) -> None:
        with self._cv:
            self.done.append(msg)
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


async def push(sender: TcpSender, endpoint: str, rid: str, fence: int, layers: list[int]) -> None:
    for layer in layers:
        await sender.send_layer(endpoint, rid, fence, layer, SRC, DST, traceparent="00-ab-cd-01")
    await sender.send_done(endpoint, KVDone(rid, fence, first_token=42, num_tokens=19))


def test_layers_move_byte_exact_and_done_follows_them(receiver: ThreadReceiver) -> None:
    src = filled(SPEC)

    async def main() -> None:
        tx = TcpSender(src, compat(SPEC), sender_id="p0")
        await push(tx, receiver.endpoint, "r1", 3, [0, 2])
        await tx.close()

    asyncio.run(main())
    receiver.wait_done(1)
    assert_moved(src, receiver.kv, [0, 2])
    assert receiver.done == [KVDone("r1", 3, 42, 19)]
    assert receiver.layers_at_done == [2]  # on_done ran after both layers had landed
    assert receiver.rx.stats.bytes_received == 2 * len(DST) * 2 * block_bytes(src)


def _receiver_process(spec: KVCacheSpec, conn: object, out: str) -> None:
    kv = PagedKVCache(spec)

    async def main() -> None:
        done = asyncio.Event()
        rx = TcpReceiver(kv, compat(spec), lambda r, f: True, lambda m: done.set())
        conn.send(await rx.start())  # type: ignore[attr-defined]
        await asyncio.wait_for(done.wait(), 60)
        await rx.close()

    asyncio.run(main())
    torch.save({"k": kv.k, "v": kv.v}, out)


def test_layers_move_byte_exact_between_processes(tmp_path: Path) -> None:
    spec = dataclasses.replace(SPEC, dtype=torch.bfloat16)  # bf16 has no numpy dtype: exercises byte views
    src = filled(spec, seed=1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    out = tmp_path / "kv.pt"
    proc = ctx.Process(target=_receiver_process, args=(spec, child, str(out)))
    proc.start()
    try:
        assert parent.poll(60), "receiver process did not start"
        endpoint = parent.recv()

        async def main() -> None:
            tx = TcpSender(src, compat(spec))
            await push(tx, endpoint, "r1", 1, [0, 1, 2])
            await tx.close()

        asyncio.run(main())
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        proc.kill()
    got = PagedKVCache(spec)
    saved = torch.load(out)
    got.k.copy_(saved["k"])
    got.v.copy_(saved["v"])
    assert_moved(src, got, [0, 1, 2])


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
        # kv_done is passed on either way; the owner ignores one with a stale fence
        assert [d.request_id for d in receiver.done] == ["old", "new"]
    finally:
        receiver.close()


def test_preflight_mismatch_names_fields_is_cached_and_sends_nothing(receiver: ThreadReceiver) -> None:
    spec = dataclasses.replace(SPEC, block_size=8, dtype=torch.bfloat16)
    src = filled(spec)

    async def main() -> None:
        tx = TcpSender(src, compat(spec))
        for _ in range(2):  # the second call fails from the cache, without contacting the receiver
            with pytest.raises(PreflightError) as e:
                await tx.send_layer(receiver.endpoint, "r", 1, 0, [0], [0])
            assert "block_size (8 != 4)" in str(e.value) and "dtype ('bfloat16' != 'float32')" in str(e.value)
        with pytest.raises(PreflightError):
            await tx.send_done(receiver.endpoint, KVDone("r", 1, 0, 1))
        await tx.close()

    asyncio.run(main())
    stats = receiver.rx.stats
    assert (stats.preflight_refusals, stats.layers_received, stats.dones_received) == (1, 0, 0)
    assert not receiver.kv.k.any() and not receiver.kv.v.any()


def _raw_client(endpoint: str) -> socket.socket:
    """A hand-driven connection that has passed the preflight."""
    sock = socket.create_connection(parse_endpoint(endpoint), timeout=10)
    sock.sendall(frame(KVHello(compat=dataclasses.asdict(compat(SPEC)))))
    (n,) = struct.unpack(">I", sock.recv(4))
    assert decode(sock.recv(n), expect=KVHelloReply).ok
    return sock


@pytest.mark.parametrize("nbytes_delta, block", [(-4, 3), (0, SPEC.num_blocks)])  # short payload; bad id
def test_bad_header_closes_connection_and_writes_nothing(
    receiver: ThreadReceiver, nbytes_delta: int, block: int
) -> None:
    sock = _raw_client(receiver.endpoint)
    nbytes = 2 * block_bytes(receiver.kv) + nbytes_delta
    header = {"kind": "kv_layer", "protocol_version": PROTOCOL_VERSION, "request_id": "r", "fence": 1}
    header.update(layer=0, block_ids=[block], nbytes=nbytes)
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
        await tx.send_done(receiver.endpoint, KVDone("r", 1, 0, 1))
        await tx.close()

    asyncio.run(main())
    receiver.wait_done(1)
    assert_moved(src, receiver.kv, [0, 1, 2])
    assert receiver.rx.stats.layers_received == 3
    asyncio.run_coroutine_threadsafe(receiver.rx.wait_idle("r"), receiver.loop).result(5)
