"""KV transfer bandwidth between two processes, per backend, next to memcpy and raw-socket baselines.

What moves: `--mib` (64) MiB of KV as 256 KiB blocks. A "block" here is one layer's K (or V) of one
cache block: block_size 256 x 4 kv heads x head_dim 64 x fp32 = 256 KiB, one contiguous run of the tensor;
each cache block moves K + V = 512 KiB per layer. 4 layers x (mib/2) cache blocks per layer; source and
destination ids are shuffled even ids, so no two blocks are adjacent and no backend can merge runs.

What is timed: from just before the first `send_layer` (all layers posted at once, as prefill_service
does) to the receiver's `kv_done` for that request, read with time.perf_counter() *in the receiver
process* (CLOCK_MONOTONIC on Linux: one clock for every process on the host) and reported back over a
pipe. Every backend's receiver and sender, and the baselines, are set up once and warmed up once
(connections, handshakes, descriptor lists); then `--rounds` (5) rounds run every side in turn, the
order reversed every other round so that outside load lands on all alike, each side taking the best of
`--reps` (3) transfers per round. A figure is the median over the rounds of its per-round value, a ratio
the median of the per-round ratios (ratio_min, ratio_max: nixl_vs_memcpy's spread). GB/s = 1e9 bytes of
payload per second. UCX_NET_DEVICES=lo unless set. UCX_PROTO_INFO=y (run once, nixl 1.5.1) shows the
WRITEs (ucp_put) going over `cma/memory`, zero-copy (process_vm_writev, one kernel copy) at every size,
and the notifications and control active messages over `tcp/lo`. So one more baseline, `cma_blocks`, is
that kernel path alone: the same blocks put into another process's cache with process_vm_writev from
one thread, one call per block, as UCX does; `nixl_vs_cma_blocks` is what NIXL and UCX cost over it, and
`cma_blocks_vs_memcpy` the most any cma transport can reach against the memcpy baseline here.

Tensor parallelism across the split (`--tp-pairs`, default 1:2,2:1, next to the 1:1 baseline; '' for
none), on tcp and nixl where each imports: KV shaped like SmolLM2-135M's (30 layers, 3 KV heads,
head_dim 64, block_size 16; fp32), about `--mib` MiB of it per transfer over every head, on shuffled,
never adjacent block ids. Prefill TP P, decode TP D: P senders in this process (on one event loop),
each over its own shard (common.parallel.partition.kv_head_ranges: TP 2 is [2, 1] heads), D receiver
processes, each over its own; every route of `plan(3, P, D)` moves layer by layer (`heads=` its slice,
None when the route is both shards whole), all layers posted at once, then each prefill rank's
kv_done to every decode rank it fed. Timed as above, per rank: from the first send_layer to the last
kv_done a prefill rank sent (sender ranks) or a decode rank heard (receiver ranks), the total to the
last of all; best of `--reps` per side and round, the pairs alternating in `--rounds` rounds of their
own after the sides above; each decode shard's blocks are checked against the heads sent to them.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import math
import multiprocessing as mp
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch
from tqdm import tqdm

import kv_transfer
from bench.rounds import alternate, load_avg, median, ratio_stats
from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.parallel.partition import kv_head_ranges
from common.parallel.plan import Route, plan, senders_to
from common.protocol import KVCompat, KVDone

T = TypeVar("T")
LAYERS = 4
BLOCK = (256, 4, 64)  # (block_size, num_kv_heads, head_dim): fp32 -> 256 KiB of K per block per layer


def bench_spec(mib: int) -> KVCacheSpec:
    per_layer = mib * 2**20 // (LAYERS * 2 * 256 * 1024)  # cache blocks moved per layer (K + V each)
    assert per_layer >= 1, f"--mib {mib} is less than one block per layer"
    return KVCacheSpec(LAYERS, 2 * per_layer, *BLOCK)


def bench_compat(spec: KVCacheSpec) -> KVCompat:
    dtype = str(spec.dtype).removeprefix("torch.")
    return KVCompat("bench", "-", dtype, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size)


# --- the receiver process (bench.overlap uses it too) -----------------------------------------------
def receiver_main(backend: str, spec: KVCacheSpec, compat: KVCompat, conn: Connection) -> None:
    """Serve `backend` into a fresh cache; pipe protocol in RemoteReceiver."""
    torch.set_num_threads(1)
    try:
        asyncio.run(_serve(backend, spec, compat, conn))
    except Exception as e:  # reported to the parent, which skips the backend with this reason
        conn.send(("error", f"{type(e).__name__}: {e}"))


class _Owner:
    """The receiver's owner here: every fence is current, and each kv_done is timed and reported."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def may_write(self, request_id: str, fence: int) -> bool:
        return True

    def layer_arrived(self, request_id: str, fence: int, layer: int) -> None:
        pass

    def kv_done(self, msg: KVDone) -> None:
        self.conn.send(("done", msg.request_id, time.perf_counter(), msg.src_rank))


async def _serve(backend: str, spec: KVCacheSpec, compat: KVCompat, conn: Connection) -> None:
    kv = PagedKVCache(spec)
    loop, stop = asyncio.get_running_loop(), asyncio.Event()

    def on_command() -> None:
        try:
            cmd = conn.recv()
        except EOFError:  # the parent is gone
            cmd = ("stop",)
        if cmd[0] == "sum":
            conn.send(("sum", checksum(kv, cmd[1])))
        else:
            stop.set()

    rx = kv_transfer.make_receiver(backend, kv, compat, _Owner(conn))
    conn.send(("endpoint", await rx.start()))
    loop.add_reader(conn.fileno(), on_command)
    await stop.wait()
    loop.remove_reader(conn.fileno())
    await rx.close()


def checksum(kv: PagedKVCache, ids: list[int]) -> float:
    return float(kv.k[:, ids].double().sum() + kv.v[:, ids].double().sum())


def stop_child(proc: Any, conn: Connection) -> None:
    """Ask a helper process to stop, and kill it if it has not within 10 s."""
    try:
        if proc.is_alive():
            conn.send(("stop",))
            proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


class RemoteReceiver:
    """A `backend` receiver in a spawned process. Pipe: parent -> ("sum", ids) | ("stop",);
    child -> ("endpoint", ep) | ("done", request_id, perf_counter, src_rank) | ("sum", x) | ("error", why)."""

    def __init__(self, backend: str, spec: KVCacheSpec, compat: KVCompat) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(backend, spec, compat, child), daemon=True)
        self.proc.start()
        child.close()  # so that a dead receiver reads as EOF here, not as silence
        self.endpoint: str = self._expect("endpoint", 120)[0]

    def _expect(self, kind: str, timeout: float = 60) -> tuple[Any, ...]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the receiver process sent no {kind!r} within {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the receiver process died (exit code {self.proc.exitcode})") from None
        if msg[0] == "error":
            raise RuntimeError(f"receiver process: {msg[1]}")
        assert msg[0] == kind, f"expected {kind!r} from the receiver, got {msg!r}"
        return tuple(msg[1:])

    def done_at(self, request_id: str) -> float:
        rid, t, _ = self._expect("done")
        assert rid == request_id, f"kv_done for {rid!r}, expected {request_id!r}"
        return float(t)

    def dones_at(self, request_id: str, n: int) -> dict[int, float]:
        """The next `n` kv_dones, all for `request_id`: sender's tensor-parallel rank -> when it was heard."""
        out: dict[int, float] = {}
        for _ in range(n):
            rid, t, src_rank = self._expect("done")
            assert rid == request_id, f"kv_done for {rid!r}, expected {request_id!r}"
            out[int(src_rank)] = float(t)
        return out

    def checksum(self, ids: list[int]) -> float:
        self.conn.send(("sum", ids))
        return float(self._expect("sum")[0])

    def close(self) -> None:
        stop_child(self.proc, self.conn)


# --- the sides: each set up once, then timed in rounds -----------------------------------------------
class LoopThread:
    """An event loop in a helper thread, where the senders live between rounds."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-senders", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class BackendSide:
    """`backend`: a receiver process and a sender (on `loop`), connected and warmed up by one transfer."""

    def __init__(
        self, backend: str, src: PagedKVCache, src_ids: list[int], dst_ids: list[int], loop: LoopThread
    ) -> None:
        self.backend, self.src, self.src_ids, self.dst_ids, self.loop = backend, src, src_ids, dst_ids, loop
        compat = bench_compat(src.spec)
        self.rx = RemoteReceiver(backend, src.spec, compat)
        self.tx: kv_transfer.KVSender | None = None
        self.sent = 0
        try:
            self.tx = loop.call(self._make(compat))
            self.once()
        except BaseException:
            self.close()
            raise

    async def _make(self, compat: KVCompat) -> kv_transfer.KVSender:
        return kv_transfer.make_sender(self.backend, self.src, compat, sender_id="bench")

    async def _post(self, rid: str) -> float:
        assert self.tx is not None
        t0 = time.perf_counter()
        await asyncio.gather(
            *[
                self.tx.send_layer(self.rx.endpoint, rid, 1, lay, self.src_ids, self.dst_ids)
                for lay in range(LAYERS)
            ]
        )
        await self.tx.send_done(self.rx.endpoint, KVDone(rid, 1, 0, 0, LAYERS))
        return t0

    def once(self) -> float:
        """One transfer, first send_layer -> the receiver's kv_done, in seconds."""
        rid = f"r{self.sent}"
        self.sent += 1
        t0 = self.loop.call(self._post(rid))
        return self.rx.done_at(rid) - t0

    def check(self) -> None:
        got, want = self.rx.checksum(self.dst_ids), checksum(self.src, self.src_ids)
        assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), f"{self.backend}: checksum {got} != {want}"

    def close(self) -> None:
        try:
            if self.tx is not None:
                self.loop.call(self.tx.close())
        finally:
            self.rx.close()


# --- baselines ------------------------------------------------------------------------------------
class Memcpy:
    """contiguous: one torch copy_ of the same number of bytes; blocks: the same per-block copies (one
    copy_ per 256 KiB K or V block, shuffled ids) into a second cache in this process. Warmed up once
    (first touch of the destination pages)."""

    def __init__(self, src: PagedKVCache, src_ids: list[int], dst_ids: list[int]) -> None:
        self.src, self.src_ids, self.dst_ids = src, src_ids, dst_ids
        n = len(src_ids) * 2 * LAYERS * src.k[0, 0].numel()
        self.a, self.b = torch.randn(n), torch.empty(n)
        self.dst = PagedKVCache(src.spec)
        self.contiguous(), self.blocks()

    def contiguous(self) -> float:
        t0 = time.perf_counter()
        self.b.copy_(self.a)
        return time.perf_counter() - t0

    def blocks(self) -> float:
        t0 = time.perf_counter()
        for lay in range(LAYERS):
            for s, d in zip(self.src_ids, self.dst_ids, strict=True):
                self.dst.k[lay, d].copy_(self.src.k[lay, s])
                self.dst.v[lay, d].copy_(self.src.v[lay, s])
        return time.perf_counter() - t0


def _socket_receiver(nbytes: int, conn: Connection) -> None:
    """Receive `nbytes` at a time until the sender hangs up, sending the time each one is complete."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        sock, _ = listener.accept()
        buf = memoryview(bytearray(nbytes))
        with sock:
            while True:
                got = 0
                while got < nbytes:
                    k = sock.recv_into(buf[got:])
                    if not k:
                        return
                    got += k
                conn.send(time.perf_counter())


class RawSocket:
    """Blocking sendall of `nbytes` to recv_into in another process over 127.0.0.1 (default buffers),
    on one connection, warmed up by one transfer."""

    def __init__(self, nbytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_socket_receiver, args=(nbytes, child), daemon=True)
        self.proc.start()
        child.close()
        self.payload = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
        self.sock: socket.socket | None = None
        try:
            assert self.conn.poll(60), "the socket receiver did not start"
            self.sock = socket.create_connection(("127.0.0.1", self.conn.recv()))
            self.once()
        except BaseException:
            self.close()
            raise

    def once(self) -> float:
        assert self.sock is not None
        t0 = time.perf_counter()
        self.sock.sendall(self.payload)
        assert self.conn.poll(60), "the socket receiver stalled"
        return float(self.conn.recv()) - t0

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()  # the receiver sees EOF and returns
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _cma_target(spec: KVCacheSpec, conn: Connection) -> None:
    """Hold a cache like the receivers' (every page touched) for the parent's process_vm_writev; pipe:
    parent -> ("sum", ids) | ("stop",); child -> ("cache", pid, k address, v address) | ("sum", x)."""
    torch.set_num_threads(1)
    kv = PagedKVCache(spec)  # zero-filled: every page touched
    conn.send(("cache", os.getpid(), kv.k.data_ptr(), kv.v.data_ptr()))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd[0] != "sum":
            return
        conn.send(("sum", checksum(kv, cmd[1])))


class CmaBlocks:
    """The kernel path NIXL's WRITEs take here, without NIXL or UCX: the same scattered K and V blocks
    written into a cache in another process with process_vm_writev, one call per 256 KiB block and one
    thread, as UCX's `cma` transport does (strace of a nixl transfer: one single-iovec call per block).
    `nixl_vs_cma_blocks` is then what NIXL + UCX cost over the copy they ask the kernel for."""

    def __init__(self, src: PagedKVCache, src_ids: list[int], dst_ids: list[int]) -> None:
        self.src, self.src_ids, self.dst_ids = src, src_ids, dst_ids
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.process_vm_writev.restype = ctypes.c_ssize_t
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_cma_target, args=(src.spec, child), daemon=True)
        self.proc.start()
        child.close()
        try:
            assert self.conn.poll(120), "the cma target process did not start"
            _, self.pid, k_addr, v_addr = self.conn.recv()
            nbytes = src.k[0, 0].numel() * src.k.element_size()
            nb = src.spec.num_blocks
            self.calls = [
                (_IoVec(s_t[lay, s].data_ptr(), nbytes), _IoVec(d_addr + (lay * nb + d) * nbytes, nbytes))
                for lay in range(LAYERS)
                for s, d in zip(src_ids, dst_ids, strict=True)
                for s_t, d_addr in ((src.k, k_addr), (src.v, v_addr))
            ]
            self.once()  # fails here, with the kernel's reason, where cma is not allowed (ptrace scope)
        except BaseException:
            self.close()
            raise

    def once(self) -> float:
        write, pid = self.libc.process_vm_writev, self.pid
        t0 = time.perf_counter()
        for local, remote in self.calls:
            if write(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != local.iov_len:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_writev: {os.strerror(err)}")
        return time.perf_counter() - t0

    def target_checksum(self, ids: list[int]) -> float:
        """checksum() of blocks `ids` of the other process's cache."""
        self.conn.send(("sum", ids))
        assert self.conn.poll(60), "the cma target process stalled"
        return float(self.conn.recv()[1])

    def check(self) -> None:
        got, want = self.target_checksum(self.dst_ids), checksum(self.src, self.src_ids)
        assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), f"cma_blocks: checksum {got} != {want}"

    def close(self) -> None:
        stop_child(self.proc, self.conn)


# --- tensor parallelism across the split: prefill TP P -> decode TP D, head slices ------------------
MODEL_LAYERS, MODEL_KV_HEADS, MODEL_HEAD_DIM = 30, 3, 64  # SmolLM2-135M's KV shape
MODEL_BLOCK = 16  # the services' default block_size
TP_BACKENDS = ("tcp", "nixl")


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """ "1:2,2:1" -> [(1, 1), (1, 2), (2, 1)]: the 1:1 baseline first, then each pair once, in order."""
    pairs = [(1, 1)]
    for part in filter(None, (p.strip() for p in text.split(","))):
        src, _, dst = part.partition(":")
        pair = (int(src), int(dst))
        if min(pair) < 1:
            raise ValueError(f"--tp-pairs: {part!r} is not prefill:decode with sizes of at least 1")
        if pair not in pairs:
            pairs.append(pair)
    return pairs


def model_spec(mib: int, heads: int = MODEL_KV_HEADS) -> KVCacheSpec:
    """A cache of `heads` of the model's KV heads, twice as many blocks as move per layer (of about
    `mib` MiB over every head)."""
    whole = KVCacheSpec(MODEL_LAYERS, 1, MODEL_BLOCK, MODEL_KV_HEADS, MODEL_HEAD_DIM)
    per_layer = max(1, mib * 2**20 // whole.bytes_per_block)
    return KVCacheSpec(MODEL_LAYERS, 2 * per_layer, MODEL_BLOCK, heads, MODEL_HEAD_DIM)


def shard_compat(spec: KVCacheSpec, tp_size: int, tp_rank: int) -> KVCompat:
    """Rank tp_rank of tp_size's record: the model's fields (num_kv_heads: the model's), its own rank."""
    dtype = str(spec.dtype).removeprefix("torch.")
    return KVCompat(
        "bench", "-", dtype, spec.num_layers, MODEL_KV_HEADS, spec.head_dim, spec.block_size,
        tp_size=tp_size, tp_rank=tp_rank,
    )  # fmt: skip


def shard_of(full: PagedKVCache, heads: range) -> PagedKVCache:
    """A cache holding `heads` of every block of `full` (a rank's shard, contiguous like a service's)."""
    kv = PagedKVCache(dataclasses.replace(full.spec, num_kv_heads=len(heads)))
    kv.k.copy_(full.k[:, :, :, heads.start : heads.stop])
    kv.v.copy_(full.v[:, :, :, heads.start : heads.stop])
    return kv


class PairSide:
    """Prefill TP `src_tp` -> decode TP `dst_tp` over `backend`: a sender per prefill rank (on `loop`)
    over its shard of `full`, a receiver process per decode rank over an empty shard; connected and
    warmed up by one transfer. `once()`: seconds from the first send_layer to the last kv_done, in
    total and per rank."""

    def __init__(
        self,
        backend: str,
        src_tp: int,
        dst_tp: int,
        full: PagedKVCache,
        src_ids: list[int],
        dst_ids: list[int],
        loop: LoopThread,
    ) -> None:
        self.backend, self.src_tp, self.dst_tp, self.loop = backend, src_tp, dst_tp, loop
        self.src_ids, self.dst_ids = src_ids, dst_ids
        self.routes: list[Route] = plan(MODEL_KV_HEADS, src_tp, dst_tp)
        self.srcs = [shard_of(full, h) for h in kv_head_ranges(MODEL_KV_HEADS, src_tp)]
        self.rxs: list[RemoteReceiver] = []
        self.txs: list[kv_transfer.KVSender] = []
        self.sent = 0
        try:
            for d, heads in enumerate(kv_head_ranges(MODEL_KV_HEADS, dst_tp)):
                spec = dataclasses.replace(full.spec, num_kv_heads=len(heads))
                self.rxs.append(RemoteReceiver(backend, spec, shard_compat(spec, dst_tp, d)))
            self.txs = loop.call(self._make())
            self.once()
        except BaseException:
            self.close()
            raise

    async def _make(self) -> list[kv_transfer.KVSender]:
        return [
            kv_transfer.make_sender(
                self.backend, kv, shard_compat(kv.spec, self.src_tp, p), rank=p, sender_id=f"bench-p{p}"
            )
            for p, kv in enumerate(self.srcs)
        ]

    def writes(self, p: int, d: int | None = None) -> tuple[int, int]:
        """(layer writes, bytes) of prefill rank p (to decode rank d, or to all) per transfer."""
        routes = [r for r in self.routes if r.src_rank == p and d in (None, r.dst_rank)]
        per_head = 2 * len(self.src_ids) * MODEL_BLOCK * MODEL_HEAD_DIM * self.srcs[0].k.element_size()
        return len(routes) * MODEL_LAYERS, sum(r.heads.count for r in routes) * MODEL_LAYERS * per_head

    def dst_writes(self, d: int) -> tuple[int, int]:
        """(layer writes, bytes) decode rank d receives per transfer."""
        per = [self.writes(p, d) for p in range(self.src_tp)]
        return sum(w for w, _ in per), sum(b for _, b in per)

    async def _post(self, rid: str) -> float:
        async def rank(p: int) -> None:
            mine = [r for r in self.routes if r.src_rank == p]
            await asyncio.gather(
                *[
                    self.txs[p].send_layer(
                        self.rxs[r.dst_rank].endpoint,
                        rid,
                        1,
                        lay,
                        self.src_ids,
                        self.dst_ids,
                        heads=None if r.full else r.heads,
                    )
                    for r in mine
                    for lay in range(MODEL_LAYERS)
                ]
            )
            for r in mine:
                senders = senders_to(MODEL_KV_HEADS, self.src_tp, self.dst_tp, r.dst_rank)
                done = KVDone(rid, 1, 0, 0, MODEL_LAYERS, src_rank=p, senders=senders)
                await self.txs[p].send_done(self.rxs[r.dst_rank].endpoint, done)

        t0 = time.perf_counter()
        await asyncio.gather(*(rank(p) for p in range(self.src_tp)))
        return t0

    def once(self) -> dict[str, float]:
        """One transfer: "total", "src<p>" (to prefill rank p's last kv_done heard) and "dst<d>" (to the
        last kv_done decode rank d heard), in seconds."""
        rid = f"r{self.sent}"
        self.sent += 1
        t0 = self.loop.call(self._post(rid))
        out: dict[str, float] = {}
        for d, rx in enumerate(self.rxs):
            heard = rx.dones_at(rid, senders_to(MODEL_KV_HEADS, self.src_tp, self.dst_tp, d))
            out[f"dst{d}"] = max(heard.values()) - t0
            for p, t in heard.items():
                out[f"src{p}"] = max(out.get(f"src{p}", 0.0), t - t0)
        out["total"] = max(out[f"dst{d}"] for d in range(self.dst_tp))
        return out

    def check(self) -> None:
        """Each decode shard's blocks hold exactly the heads the routes into it carried."""
        for d, rx in enumerate(self.rxs):
            want = 0.0
            for r in (r for r in self.routes if r.dst_rank == d):
                h, src = r.heads, self.srcs[r.src_rank]
                heads = slice(h.src_start, h.src_start + h.count)
                want += float(src.k[:, self.src_ids, :, heads].double().sum())
                want += float(src.v[:, self.src_ids, :, heads].double().sum())
            got = rx.checksum(self.dst_ids)
            assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (
                f"{self.backend} TP {self.src_tp}->{self.dst_tp}, decode rank {d}: checksum {got} != {want}"
            )

    def close(self) -> None:
        try:
            for tx in self.txs:
                self.loop.call(tx.close())
        finally:
            for rx in self.rxs:
                rx.close()


def pair_name(backend: str, pair: tuple[int, int]) -> str:
    return f"{backend}_tp_{pair[0]}_{pair[1]}"


def run_tp_pairs(args: argparse.Namespace, pairs: list[tuple[int, int]]) -> dict[str, Any]:
    """Every pair on every backend of TP_BACKENDS that imports here, alternating in rounds; the JSON
    keys for them (see the module docstring)."""
    reps, rounds = args.reps or 3, args.rounds
    spec = model_spec(args.mib)
    per_layer = spec.num_blocks // 2
    rng = random.Random(args.seed + 1)
    src_ids = rng.sample(range(0, spec.num_blocks, 2), per_layer)  # shuffled, never adjacent
    dst_ids = rng.sample(range(0, spec.num_blocks, 2), per_layer)
    full = PagedKVCache(spec)
    g = torch.Generator().manual_seed(args.seed + 1)
    full.k.copy_(torch.randn(full.k.shape, generator=g))
    full.v.copy_(torch.randn(full.v.shape, generator=g))
    out: dict[str, Any] = {
        "tp_pairs": [f"{p}:{d}" for p, d in pairs],
        "tp_shape": {
            "layers": MODEL_LAYERS,
            "kv_heads": MODEL_KV_HEADS,
            "head_dim": MODEL_HEAD_DIM,
            "block_size": MODEL_BLOCK,
            "blocks": per_layer,
            "dtype": "float32",
        },
        "tp_bytes": per_layer * spec.bytes_per_block,
    }
    available = kv_transfer.available_backends()
    sides: dict[str, PairSide] = {}
    skipped: dict[str, str] = {}
    loop = LoopThread()
    try:
        for backend in TP_BACKENDS:
            if backend not in available:
                out[f"{backend}_tp_skipped"] = "its library does not import here"
                continue
            for pair in pairs:
                name = pair_name(backend, pair)
                tqdm.write(f"[bench transfer] setting up {name}", file=sys.stderr)
                try:
                    sides[name] = PairSide(backend, *pair, full, src_ids, dst_ids, loop)
                except Exception as e:  # reported, not fatal
                    skipped[name] = f"{type(e).__name__}: {e}"

        def best_of(name: str) -> dict[str, float]:
            if name in skipped:
                return {}
            try:
                runs = [sides[name].once() for _ in range(reps)]
            except Exception as e:  # a pair that fails mid-way is reported, not fatal
                skipped[name] = f"{type(e).__name__}: {e}"
                return {}
            return {k: min(r[k] for r in runs) for k in runs[0]}

        per_round = alternate({name: partial(best_of, name) for name in sides}, rounds, "transfer tp pairs")
        for name, s in sides.items():
            if name not in skipped:
                s.check()
    finally:
        for s in sides.values():
            s.close()
        loop.close()
    gb_s_rounds: dict[str, list[float]] = {}
    for backend in TP_BACKENDS:
        for pair in pairs:
            name = pair_name(backend, pair)
            if name in skipped:
                out[f"{name}_skipped"] = skipped[name]
                continue
            if name not in sides:
                continue
            s, results = sides[name], per_round[name]
            gb_s = [out["tp_bytes"] / r["total"] / 1e9 for r in results]
            gb_s_rounds[name] = [round(x, 3) for x in gb_s]
            out[f"{name}_gb_s"] = round(median(gb_s), 3)
            ranks = []
            for p in range(pair[0]):
                writes, nbytes = s.writes(p)
                rate = median([nbytes / r[f"src{p}"] / 1e9 for r in results])
                ranks.append({"rank": p, "gb_s": round(rate, 3), "layer_writes": writes, "bytes": nbytes})
            out[f"{name}_prefill_ranks"] = ranks
            ranks = []
            for d in range(pair[1]):
                writes, nbytes = s.dst_writes(d)
                rate = median([nbytes / r[f"dst{d}"] / 1e9 for r in results])
                ranks.append({"rank": d, "gb_s": round(rate, 3), "layer_writes": writes, "bytes": nbytes})
            out[f"{name}_decode_ranks"] = ranks
            base = pair_name(backend, (1, 1))
            if pair != (1, 1) and base in gb_s_rounds:  # per-round ratios against the 1:1 baseline
                ratio = ratio_stats(gb_s, [out["tp_bytes"] / r["total"] / 1e9 for r in per_round[base]])
                out[f"{name}_vs_1_1"], out[f"{name}_vs_1_1_spread"] = (
                    ratio["median"],
                    [ratio["min"], ratio["max"]],
                )
    out["tp_gb_s_rounds"] = gb_s_rounds
    return out


# --- the scenario ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # read when the first agent starts; children inherit it
    load_before = load_avg()
    reps, rounds = args.reps or 3, args.rounds
    spec = bench_spec(args.mib)
    per_layer = spec.num_blocks // 2
    rng = random.Random(args.seed)
    src_ids = rng.sample(range(0, spec.num_blocks, 2), per_layer)  # shuffled, never adjacent
    dst_ids = rng.sample(range(0, spec.num_blocks, 2), per_layer)
    src = PagedKVCache(spec)
    g = torch.Generator().manual_seed(args.seed)
    src.k.copy_(torch.randn(src.k.shape, generator=g))
    src.v.copy_(torch.randn(src.v.shape, generator=g))
    nbytes = per_layer * 2 * LAYERS * src.k[0, 0].numel() * src.k.element_size()
    out: dict[str, Any] = {"bytes": nbytes, "block_bytes": src.k[0, 0].numel() * src.k.element_size()}
    skipped: dict[str, str] = {}
    backends: dict[str, BackendSide] = {}
    loop = LoopThread()
    raw: RawSocket | None = None
    cma: CmaBlocks | None = None
    try:
        available = kv_transfer.available_backends()
        for backend in kv_transfer.BACKENDS:
            if backend not in available:
                skipped[backend] = "its library does not import here"
                continue
            try:
                backends[backend] = BackendSide(backend, src, src_ids, dst_ids, loop)
            except Exception as e:  # a backend that cannot be set up here is reported, not fatal
                skipped[backend] = f"{type(e).__name__}: {e}"
        memcpy = Memcpy(src, src_ids, dst_ids)
        raw = RawSocket(nbytes)
        timed: dict[str, Callable[[], float]] = {name: side.once for name, side in backends.items()}
        timed |= {"memcpy": memcpy.contiguous, "memcpy_blocks": memcpy.blocks, "raw_socket": raw.once}
        try:
            cma = CmaBlocks(src, src_ids, dst_ids)
            timed["cma_blocks"] = cma.once
        except Exception as e:  # no cma here (ptrace scope, not Linux): reported, not fatal
            skipped["cma_blocks"] = f"{type(e).__name__}: {e}"

        def best_of(name: str) -> float:  # a backend that fails mid-way is reported, not fatal
            if name in skipped:
                return math.nan
            try:
                return min(timed[name]() for _ in range(reps))
            except Exception as e:
                if name not in backends:
                    raise  # a baseline that fails is a broken benchmark
                skipped[name] = f"{type(e).__name__}: {e}"
                return math.nan

        per_round = alternate({name: partial(best_of, name) for name in timed}, rounds, "transfer")
        for name, b in backends.items():
            if name not in skipped:
                b.check()
        if cma is not None:
            cma.check()
    finally:
        for b in backends.values():
            b.close()
        if cma is not None:
            cma.close()
        if raw is not None:
            raw.close()
        loop.close()
    load_after = load_avg()
    gb_s = {name: [nbytes / x / 1e9 for x in xs] for name, xs in per_round.items() if name not in skipped}
    for backend in kv_transfer.BACKENDS:
        if backend in skipped:
            out[f"{backend}_skipped"] = skipped[backend]
        else:
            out[f"{backend}_gb_s"] = round(median(gb_s[backend]), 3)
    for name in ("memcpy", "memcpy_blocks", "raw_socket"):
        out[f"{name}_gb_s"] = round(median(gb_s[name]), 3)
    if "cma_blocks" in skipped:
        out["cma_blocks_skipped"] = skipped["cma_blocks"]
    else:
        out["cma_blocks_gb_s"] = round(median(gb_s["cma_blocks"]), 3)
    ratio: dict[str, Any] = {"median": None, "min": None, "max": None, "iqr": None}
    if "nixl" in gb_s:
        ratio = ratio_stats(gb_s["nixl"], gb_s["memcpy"])
        blocks = ratio_stats(gb_s["nixl"], gb_s["memcpy_blocks"])
        out["nixl_vs_memcpy"], out["nixl_vs_memcpy_blocks"] = ratio["median"], blocks["median"]
        out["nixl_vs_memcpy_blocks_min"], out["nixl_vs_memcpy_blocks_max"] = blocks["min"], blocks["max"]
        if "cma_blocks" in gb_s:  # what NIXL + UCX cost over the kernel copy they use
            cma_r = ratio_stats(gb_s["nixl"], gb_s["cma_blocks"])
            out["nixl_vs_cma_blocks"] = cma_r["median"]
            out["nixl_vs_cma_blocks_min"], out["nixl_vs_cma_blocks_max"] = cma_r["min"], cma_r["max"]
            out["cma_blocks_vs_memcpy"] = ratio_stats(gb_s["cma_blocks"], gb_s["memcpy"])["median"]
    out |= {"ratio_min": ratio["min"], "ratio_max": ratio["max"], "ratio_iqr": ratio["iqr"]}
    out["gb_s_rounds"] = {name: [round(x, 3) for x in xs] for name, xs in gb_s.items()}
    # load-independent: what one transfer moves
    out["layers"], out["blocks"] = LAYERS, per_layer * 2 * LAYERS
    out["rounds"], out["reps"], out["torch_threads"] = rounds, reps, torch.get_num_threads()
    pairs = parse_pairs(getattr(args, "tp_pairs", "") or "")
    if len(pairs) > 1:  # the 1:1 baseline alone is no comparison
        out |= run_tp_pairs(args, pairs)
        load_after = load_avg()
    out["load_before"], out["load_after"] = load_before, load_after
    return out
