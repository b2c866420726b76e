"""What the KV transport tests share: tiny shapes, filled caches, compat records, a receiver on the running
loop that records kv_done messages, a receiver in a spawned process, a hand-driven client socket
that has passed the authentication, and head slices moved between tensor-parallel shards."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

import msgspec
import pytest
import torch

from common.kv.kv_cache import FP8, KVCacheSpec, KVScales, PagedKVCache
from common.parallel.partition import kv_head_ranges
from common.parallel.plan import plan, senders_to
from common.protocol import KVCompat, KVDone, Message, decode, frame, frame_length
from common.security.secret import InternalSecret
from kv_transfer import KVReceiver, KVSender, PreflightError, ReceiverOwner
from kv_transfer.control.auth import authenticate_to_receiver
from kv_transfer.layout import slice_bytes

SPEC = KVCacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
SRC = [7, 3, 4, 5, 12]  # non-contiguous, unordered; 3-4-5 is one run
DST = [9, 10, 2, 0, 14]  # 9-10 is one run

AcceptFn = Callable[[str, int], bool]
R = TypeVar("R", bound=KVReceiver)
MakeReceiver = Callable[[PagedKVCache, KVCompat, ReceiverOwner], R]


class Owner:
    """A receiver's owner for tests: `accept` decides the fences; layers and kv_done are recorded."""

    def __init__(self, accept: AcceptFn = lambda r, f: True, on_done: Callable[[KVDone], None] | None = None):
        self.accept, self.on_done = accept, on_done
        self.arrived: list[tuple[str, int, int]] = []  # (request_id, fence, layer) in arrival order
        self.done: list[KVDone] = []

    def may_write(self, request_id: str, fence: int) -> bool:
        return self.accept(request_id, fence)

    def layer_arrived(self, request_id: str, fence: int, layer: int) -> None:
        self.arrived.append((request_id, fence, layer))

    def kv_done(self, msg: KVDone) -> None:
        self.done.append(msg)
        if self.on_done is not None:
            self.on_done(msg)


def compat(spec: KVCacheSpec) -> KVCompat:
    dtype = str(spec.dtype).removeprefix("torch.")
    return KVCompat("tiny", "h", dtype, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size)


def cache(spec: KVCacheSpec) -> PagedKVCache:
    """An empty cache of `spec`; an fp8 one with unit scales (the transports move its bytes as they are)."""
    if spec.dtype not in FP8:
        return PagedKVCache(spec)
    ones = torch.ones(spec.num_layers, spec.num_kv_heads)
    return PagedKVCache(spec, compute_dtype=torch.float32, scales=KVScales(ones, ones))


def filled(spec: KVCacheSpec, seed: int = 0) -> PagedKVCache:
    kv = cache(spec)
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


async def push(sender: KVSender, endpoint: str, rid: str, fence: int, layers: list[int]) -> None:
    for layer in layers:
        await sender.send_layer(endpoint, rid, fence, layer, SRC, DST, traceparent="00-ab-cd-01")
    done = KVDone(rid, fence, first_token=42, num_tokens=19, layer_writes=len(layers))
    await sender.send_done(endpoint, done)


MISMATCHED = dataclasses.replace(SPEC, block_size=8, dtype=torch.bfloat16)  # a sender SPEC receivers refuse


async def assert_preflight_refused_and_cached(tx: KVSender, endpoint: str) -> None:
    """tx (built with MISMATCHED) is refused, names the fields, and never asks again."""
    for _ in range(2):  # the second call fails from the cache, without contacting the receiver
        with pytest.raises(PreflightError) as e:
            await tx.send_layer(endpoint, "r", 1, 0, [0], [0])
        msg = str(e.value)
        assert "block_size (8 != 4)" in msg and "dtype ('bfloat16' != 'float32')" in msg
    with pytest.raises(PreflightError):
        await tx.send_done(endpoint, KVDone("r", 1, 0, 1, 0))
    await tx.close()


def assert_refused_untouched(rx: KVReceiver, kv: PagedKVCache) -> None:
    """The receiver refused one preflight and received (and wrote) nothing."""
    stats = rx.stats
    assert (stats.preflight_refusals, stats.layers_received, stats.dones_received) == (1, 0, 0)
    assert not kv.k.any() and not kv.v.any()


class LoopReceiver(Generic[R]):
    """A receiver (made by `make`) on the running loop that records kv_done messages."""

    def __init__(
        self,
        make: MakeReceiver[R],
        spec: KVCacheSpec,
        accept: AcceptFn = lambda r, f: True,
        kv_compat: KVCompat | None = None,  # default: compat(spec)
    ) -> None:
        self.kv = PagedKVCache(spec)
        self.layers_at_done: list[int] = []
        self.owner = Owner(accept, self._on_done)
        self.done = self.owner.done
        self.rx = make(self.kv, compat(spec) if kv_compat is None else kv_compat, self.owner)
        self.endpoint = ""

    def _on_done(self, msg: KVDone) -> None:
        self.layers_at_done.append(self.rx.stats.layers_received)

    async def __aenter__(self) -> Self:
        self.endpoint = await self.rx.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.rx.close()

    async def wait_done(self, n: int) -> None:
        async with asyncio.timeout(10):
            while len(self.done) < n:
                await asyncio.sleep(0.001)


def _receiver_process(make: MakeReceiver[KVReceiver], spec: KVCacheSpec, conn: Any, out: str) -> None:
    kv = cache(spec)

    async def main() -> None:
        done = asyncio.Event()
        rx = make(kv, compat(spec), Owner(on_done=lambda m: done.set()))
        conn.send(await rx.start())
        await asyncio.wait_for(done.wait(), 60)
        await rx.close()

    asyncio.run(main())
    torch.save({"k": kv.k, "v": kv.v}, out)


def received_in_another_process(
    make: MakeReceiver[KVReceiver],
    spec: KVCacheSpec,
    tmp_path: Path,
    send: Callable[[str], Coroutine[Any, Any, None]],
) -> PagedKVCache:
    """Start a receiver (a picklable `make`) in a spawned process, run `send(endpoint)` here, and return
    the receiver's cache once its first kv_done arrived."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    out = tmp_path / "kv.pt"
    proc = ctx.Process(target=_receiver_process, args=(make, spec, child, str(out)))
    proc.start()
    try:
        assert parent.poll(60), "receiver process did not start"
        endpoint = parent.recv()
        asyncio.run(send(endpoint))
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        proc.kill()
    got = cache(spec)
    saved = torch.load(out)
    got.k.copy_(saved["k"])
    got.v.copy_(saved["v"])
    return got


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the receiver closed the connection")
        buf += chunk
    return buf


def authenticated_socket(
    address: tuple[str, int], secret: InternalSecret | None = None, sender_id: str = "raw"
) -> socket.socket:
    """A blocking connection to a KV receiver's listener that has passed the authentication (the sender's
    half of kv_transfer.control.auth, run over the blocking socket), for a test to hand-drive the rest."""
    sock = socket.create_connection(address, timeout=10)

    async def send(msg: Message) -> None:
        sock.sendall(frame(msg))

    async def recv(expect: Any, limit: int) -> Any:
        head = sock.recv(4, socket.MSG_WAITALL)
        return decode(_recv_exactly(sock, frame_length(head, limit)), expect) if head else None

    try:
        secret = InternalSecret.from_env() if secret is None else secret  # what receivers default to
        asyncio.run(authenticate_to_receiver(send, recv, secret, sender_id))
    except BaseException:
        sock.close()
        raise
    return sock


# --- heterogeneous tensor parallelism: head slices between shards ---------------------------------------
MODEL_KV_HEADS = 3  # SmolLM2-135M's: over 2 ranks the shards are [2, 1] heads
# (model KV heads, prefill TP, decode TP) every backend's head-slice test moves
HEAD_SLICE_CASES = [
    (MODEL_KV_HEADS, 1, 2),  # one sender's heads split over two receivers
    (MODEL_KV_HEADS, 2, 1),  # two senders into one receiver, each with its own kv_done
    (5, 2, 3),  # a slice that is part of the shard on both sides, at an offset on both
]
HEADS_LAYERS = [[0, 2], [1, 2]]  # the layers prefill rank p sends: [p % 2]; layer 1 of rank 0 stays empty


def shard_spec(num_kv_heads: int, tp_size: int, tp_rank: int) -> KVCacheSpec:
    """SPEC holding rank tp_rank's KV heads of a model with num_kv_heads."""
    return dataclasses.replace(SPEC, num_kv_heads=len(kv_head_ranges(num_kv_heads, tp_size)[tp_rank]))


def shard_compat(num_kv_heads: int, tp_size: int, tp_rank: int) -> KVCompat:
    """The compat record of that rank: the model's fields (num_kv_heads: the model's), its own rank."""
    base = compat(SPEC)
    return msgspec.structs.replace(base, num_kv_heads=num_kv_heads, tp_size=tp_size, tp_rank=tp_rank)


MakeSender = Callable[[PagedKVCache, KVCompat], KVSender]


async def move_heads(
    make_rx: MakeReceiver[R], make_tx: MakeSender, num_kv_heads: int, src_tp: int, dst_tp: int
) -> tuple[list[KVSender], list[LoopReceiver[R]]]:
    """Run every route of plan(num_kv_heads, src_tp, dst_tp) through one backend and check the result.

    Prefill rank p (a sender over its own shard of distinct random data) sends its routes' heads of the
    SRC blocks to DST of each decode rank, layers HEADS_LAYERS[p % 2], then one kv_done per decode rank it
    fed; the ranks send concurrently. Each decode shard must then hold exactly those heads of those
    blocks and layers, zeros everywhere else, and every kv_done must have reached its owner with its
    src_rank and senders. Returns the (closed) senders and receivers for backend-specific checks."""
    routes = plan(num_kv_heads, src_tp, dst_tp)
    srcs = [filled(shard_spec(num_kv_heads, src_tp, p), seed=10 + p) for p in range(src_tp)]
    txs = [make_tx(srcs[p], shard_compat(num_kv_heads, src_tp, p)) for p in range(src_tp)]
    async with contextlib.AsyncExitStack() as stack:
        rxs = [
            await stack.enter_async_context(
                LoopReceiver(
                    make_rx,
                    shard_spec(num_kv_heads, dst_tp, d),
                    kv_compat=shard_compat(num_kv_heads, dst_tp, d),
                )
            )
            for d in range(dst_tp)
        ]

        async def prefill_rank(p: int) -> None:
            mine, layers = [r for r in routes if r.src_rank == p], HEADS_LAYERS[p % 2]
            for r in mine:
                for layer in layers:
                    await txs[p].send_layer(rxs[r.dst_rank].endpoint, "r1", 3, layer, SRC, DST, heads=r.heads)
            for r in mine:
                senders = senders_to(num_kv_heads, src_tp, dst_tp, r.dst_rank)
                done = KVDone("r1", 3, 42, 19, len(layers), src_rank=p, senders=senders)
                await txs[p].send_done(rxs[r.dst_rank].endpoint, done)

        await asyncio.gather(*(prefill_rank(p) for p in range(src_tp)))
        for d, rx in enumerate(rxs):
            await rx.wait_done(senders_to(num_kv_heads, src_tp, dst_tp, d))
        for tx in txs:
            await tx.close()
    for d, rx in enumerate(rxs):
        into = [r for r in routes if r.dst_rank == d]
        want_k, want_v = torch.zeros_like(rx.kv.k), torch.zeros_like(rx.kv.v)
        for r in into:
            h, src = r.heads, srcs[r.src_rank]
            theirs = slice(h.src_start, h.src_start + h.count)
            ours = slice(h.dst_start, h.dst_start + h.count)
            for layer in HEADS_LAYERS[r.src_rank % 2]:
                want_k[layer, DST, :, ours] = src.k[layer, SRC, :, theirs]
                want_v[layer, DST, :, ours] = src.v[layer, SRC, :, theirs]
        assert torch.equal(rx.kv.k, want_k) and torch.equal(rx.kv.v, want_v), f"decode rank {d}"
        writes = [len(HEADS_LAYERS[r.src_rank % 2]) for r in into]
        dones = sorted(rx.done, key=lambda m: m.src_rank)
        assert dones == [
            KVDone("r1", 3, 42, 19, n, src_rank=r.src_rank, senders=len(into))
            for r, n in zip(into, writes, strict=True)
        ]
        assert rx.layers_at_done[-1] == sum(writes)  # the last kv_done came after every layer had landed
        nbytes = sum(
            n * len(DST) * 2 * slice_bytes(rx.kv, r.heads.count) for r, n in zip(into, writes, strict=True)
        )
        assert rx.rx.stats.bytes_received == nbytes
    return txs, rxs
