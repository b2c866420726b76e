"""KV transfer bandwidth between two processes, per backend, next to memcpy and raw-socket baselines.

What moves: `--mib` (64) MiB of KV as 256 KiB blocks. A "block" here is one layer's K (or V) of one
cache block: block_size 256 x 4 kv heads x head_dim 64 x fp32 = 256 KiB, one contiguous run of the tensor;
each cache block moves K + V = 512 KiB per layer. 4 layers x (mib/2) cache blocks per layer; source and
destination ids are shuffled even ids, so no two blocks are adjacent and no backend can merge runs.

What is timed: from just before the first `send_layer` (all layers posted at once, as prefill_service
does) to the receiver's `kv_done` for that request, read with time.perf_counter() *in the receiver
process* (CLOCK_MONOTONIC on Linux: one clock for every process on the host) and reported back over a
pipe. Best of `--reps` (5) after one warm-up (connections, handshakes, descriptor lists). GB/s = 1e9 bytes
of payload per second. UCX_NET_DEVICES=lo unless set. UCX_PROTO_INFO=y (run once, nixl 1.5.1) shows the
WRITEs (ucp_put) going over `cma/memory`, zero-copy (process_vm_writev, one kernel copy) at every size,
and the notifications and control active messages over `tcp/lo`.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from tqdm import tqdm

import kv_transfer
from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.protocol import KVCompat, KVDone

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
        self.conn.send(("done", msg.request_id, time.perf_counter()))


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


class RemoteReceiver:
    """A `backend` receiver in a spawned process. Pipe: parent -> ("sum", ids) | ("stop",);
    child -> ("endpoint", ep) | ("done", request_id, perf_counter) | ("sum", x) | ("error", why)."""

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
        rid, t = self._expect("done")
        assert rid == request_id, f"kv_done for {rid!r}, expected {request_id!r}"
        return float(t)

    def checksum(self, ids: list[int]) -> float:
        self.conn.send(("sum", ids))
        return float(self._expect("sum")[0])

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                self.proc.join(10)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


# --- one backend ----------------------------------------------------------------------------------
def backend_seconds(
    backend: str, src: PagedKVCache, src_ids: list[int], dst_ids: list[int], reps: int
) -> float:
    """Best first-send -> kv_done time of `reps` transfers after one warm-up."""
    compat = bench_compat(src.spec)
    rx = RemoteReceiver(backend, src.spec, compat)
    try:
        return asyncio.run(_push_all(backend, src, compat, rx, src_ids, dst_ids, reps))
    finally:
        rx.close()


async def _push_all(
    backend: str,
    src: PagedKVCache,
    compat: KVCompat,
    rx: RemoteReceiver,
    src_ids: list[int],
    dst_ids: list[int],
    reps: int,
) -> float:
    tx = kv_transfer.make_sender(backend, src, compat, sender_id="bench")
    best = float("inf")
    try:
        for i in tqdm(range(reps + 1), desc=f"transfer {backend}", unit="rep", leave=False):
            rid = f"r{i}"
            t0 = time.perf_counter()
            await asyncio.gather(
                *[tx.send_layer(rx.endpoint, rid, 1, lay, src_ids, dst_ids) for lay in range(LAYERS)]
            )
            await tx.send_done(rx.endpoint, KVDone(rid, 1, 0, 0, LAYERS))
            t1 = await asyncio.to_thread(rx.done_at, rid)
            if i:
                best = min(best, t1 - t0)
    finally:
        await tx.close()
    got, want = await asyncio.to_thread(rx.checksum, dst_ids), checksum(src, src_ids)
    assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), f"{backend}: checksum {got} != {want}"
    return best


# --- baselines ------------------------------------------------------------------------------------
def memcpy_seconds(
    src: PagedKVCache, src_ids: list[int], dst_ids: list[int], reps: int
) -> tuple[float, float]:
    """(contiguous, blocks): one torch copy_ of the same number of bytes, and the same per-block copies
    (one copy_ per 256 KiB K or V block, shuffled ids) into a second cache in this process."""
    n = len(src_ids) * 2 * LAYERS * src.k[0, 0].numel()
    a, b = torch.randn(n), torch.empty(n)
    dst = PagedKVCache(src.spec)

    def blocks() -> None:
        for lay in range(LAYERS):
            for s, d in zip(src_ids, dst_ids, strict=True):
                dst.k[lay, d].copy_(src.k[lay, s])
                dst.v[lay, d].copy_(src.v[lay, s])

    def best(fn: Any) -> float:
        fn()  # warm-up: first touch of the destination pages
        out = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t0)
        return out

    return best(lambda: b.copy_(a)), best(blocks)


def _socket_receiver(nbytes: int, reps: int, conn: Connection) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        sock, _ = listener.accept()
        buf = memoryview(bytearray(nbytes))
        with sock:
            for _ in range(reps):
                got = 0
                while got < nbytes:
                    k = sock.recv_into(buf[got:])
                    if not k:
                        return
                    got += k
                conn.send(time.perf_counter())


def raw_socket_seconds(nbytes: int, reps: int) -> float:
    """Blocking sendall of `nbytes` to recv_into in another process over 127.0.0.1 (default buffers)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_socket_receiver, args=(nbytes, reps + 1, child), daemon=True)
    proc.start()
    child.close()
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
    best = float("inf")
    try:
        assert parent.poll(60), "the socket receiver did not start"
        with socket.create_connection(("127.0.0.1", parent.recv())) as sock:
            for i in tqdm(range(reps + 1), desc="transfer raw socket", unit="rep", leave=False):
                t0 = time.perf_counter()
                sock.sendall(payload)
                assert parent.poll(60), "the socket receiver stalled"
                if i:
                    best = min(best, parent.recv() - t0)
                else:
                    parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return best


# --- the scenario ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # read when the first agent starts; children inherit it
    reps = args.reps or 5
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

    def gb_s(seconds: float) -> float:
        return round(nbytes / seconds / 1e9, 3)

    available = kv_transfer.available_backends()
    for backend in kv_transfer.BACKENDS:
        if backend not in available:
            out[f"{backend}_skipped"] = "its library does not import here"
            continue
        try:
            out[f"{backend}_gb_s"] = gb_s(backend_seconds(backend, src, src_ids, dst_ids, reps))
        except Exception as e:  # a backend that cannot be set up here is reported, not fatal
            out[f"{backend}_skipped"] = f"{type(e).__name__}: {e}"
    contiguous, blocks = memcpy_seconds(src, src_ids, dst_ids, reps)
    out["memcpy_gb_s"], out["memcpy_blocks_gb_s"] = gb_s(contiguous), gb_s(blocks)
    out["raw_socket_gb_s"] = gb_s(raw_socket_seconds(nbytes, reps))
    if "nixl_gb_s" in out:
        out["nixl_vs_memcpy"] = round(out["nixl_gb_s"] / out["memcpy_gb_s"], 3)
        out["nixl_vs_memcpy_blocks"] = round(out["nixl_gb_s"] / out["memcpy_blocks_gb_s"], 3)
    out["reps"], out["torch_threads"] = reps, torch.get_num_threads()
    return out
