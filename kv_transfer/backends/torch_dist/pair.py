"""What both sides of the torch_dist backend share: the per-pair process group and its thread.

A pair's group is a two-rank torch.distributed process group built straight from a store (no
init_process_group, no default group): rank 0 is the receiver, rank 1 the sender. gloo moves host
memory over TCP; NCCL moves CUDA memory and is used only when both caches are on CUDA.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from common.kv.kv_cache import PagedKVCache
from kv_transfer.base import TransferError

RECEIVER_RANK, SENDER_RANK = 0, 1
TAG = 0  # one ordered stream per pair: every message is matched in order on the same tag
JOIN_S = 5.0  # close() waits this long for pair threads to drop their groups


def group_backends(kv: PagedKVCache) -> list[str]:
    """Process-group backends this side can move its cache with, preferred first."""
    if kv.k.device.type == "cuda" and dist.is_nccl_available():
        return ["nccl", "gloo"]
    return ["gloo"]


def staging_device(kv: PagedKVCache, backend: str) -> torch.device:
    """Where a layer is packed for the wire: NCCL sends device memory, gloo host memory."""
    return kv.k.device if backend == "nccl" else torch.device("cpu")


def make_group(backend: str, store: Any, rank: int, host: str, timeout: float) -> Any:
    """A two-rank group on `store` (blocks until the other rank builds its side). gloo listens on `host`,
    the address the control connection uses, so the pair takes the route the control stream takes."""
    td = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        nccl = dist.ProcessGroupNCCL  # absent from CPU builds: only reached when is_nccl_available()
        opts = nccl.Options()
        opts._timeout = td
        return nccl(store, rank, 2, opts)
    gloo = dist.ProcessGroupGloo
    opts = gloo._Options()  # type: ignore[attr-defined]  # the stubs name it Options; the binding _Options
    opts._timeout = td
    opts._devices = [gloo.create_device(hostname=host)]
    return gloo(store, rank, 2, opts)


def sync(device: torch.device) -> None:
    """Wait until the work queued on `device` by this thread is done (a no-op on the host)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def p2p(group: Any, op: str, buf: torch.Tensor, peer: int) -> None:
    """Send or receive `buf` whole, blocking until it is done (and, on CUDA, until the bytes are in place)."""
    work = group.send([buf], peer, TAG) if op == "send" else group.recv([buf], peer, TAG)
    work.wait()
    sync(buf.device)


Job = tuple[Callable[[], Any], "concurrent.futures.Future[Any]"]


class PairWorker:
    """The one thread that owns a pair's process group and runs its blocking calls, in submission order.

    Submission order is the order of the headers on the control connection, so the two sides' sends and
    receives match one to one. After a failed call the group's state is unknown (gloo closes a pair on a
    timeout): every later job fails at once. `stop` lets the running job finish, fails the queued ones and
    drops the group, which closes its sockets: the peer's pending call fails at once instead of timing out.
    """

    def __init__(self, name: str) -> None:
        self.group: Any = None  # set by the first job (make_group)
        self.broken = ""
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Queue fn; the returned future (of the running loop) resolves with its result. Cancelling that
        future does not stop a job: await it through asyncio.shield."""
        cf: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self._stopped:
            cf.set_exception(TransferError(f"the process group pair is closed: {self.broken or 'stopped'}"))
        else:
            self._jobs.put((fn, cf))
        return asyncio.wrap_future(cf)

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._jobs.put(None)

    async def join(self, timeout: float) -> bool:
        """Stop, and wait up to `timeout` s for the thread to drop the group; False if it is still in a call.
        (A process must not exit while a group is being torn down: the C++ runtime aborts.)"""
        self.stop()
        await asyncio.to_thread(self._thread.join, timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, cf = job
            if not cf.set_running_or_notify_cancel():
                continue
            if self.broken:
                cf.set_exception(TransferError(f"the process group pair is broken: {self.broken}"))
                continue
            try:
                cf.set_result(fn())
            except Exception as e:  # gloo/NCCL raise RuntimeError (timeouts, a closed peer)
                self.broken = f"{type(e).__name__}: {e}"
                cf.set_exception(TransferError(self.broken))
        self.group = None  # the last reference: its sockets close now
        while not self._jobs.empty():  # submitted between stop() and here
            job = self._jobs.get()
            if job is not None and job[1].set_running_or_notify_cancel():
                job[1].set_exception(TransferError("the process group pair is closed"))


async def join_all(workers: set[PairWorker], timeout: float) -> None:
    """Stop and join every worker (forgetting the joined ones); one still in a call is left to its timeout."""
    batch = list(workers)
    done = await asyncio.gather(*(w.join(timeout) for w in batch))
    for w, ok in zip(batch, done, strict=True):
        if ok:
            workers.discard(w)
