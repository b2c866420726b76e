"""The worker ranks of a tensor-parallel engine, and rank 0's handle on them.

Rank 0 is the engine process: scheduler, sampler, everything as without tensor parallelism. It starts
ranks 1..N-1 as processes ("spawn"), which join one gloo group with it (a TCPStore on 127.0.0.1, any
free port), receive their weight shard from it over the group and allocate their KV cache shard (same
blocks, only their KV heads). Every step rank 0 sends each worker the step's flattened inputs
(`StepInputs`, what ModelRunner.prepare built) with the step's swap-outs, swap-ins and dropped swap
copies, pickled once, over a pipe per worker; then all ranks run the forward (whose all-reduces and
logit gathers are the gloo collectives) and rank 0 samples.

A service's engine (a KV connector: the prefill/decode split) also gives each worker a transfer
agent (`transfer`, kv_transfer/ranks.py): the worker's own KV sender or receiver over its shard, so
each rank moves its own KV heads. Rank 0 drives the agents over a second pipe per worker (`call`, with
the typed messages of common/parallel/messages.py), and hears a decode agent's reports (`on_report`);
a prefill step carries the layer writes each rank posts.

The KV offload tiers (common/kv/offload.py) live on rank 0 and hold every KV head of a block: rank 0
fetches the workers' heads of the blocks the prefix cache evicts (`tier_out`, `tier_out_wait`) and
hands them their heads of the blocks a tier read returns (`tier_in`, `tier_in_wait`), each a round
trip on the step pipe (`TierOut` / `TierIn`, answered by a `TierReply`, the bytes as a frame of their
own after the message) while the workers wait for the next step: the step messages are unchanged, and
a worker answers before it reads the next one.

The step goes over a pipe, not a gloo broadcast: an idle engine leaves its workers blocked in
`recv`, which no collective timeout can end, and a pipe's end (rank 0 exited, even by SIGKILL) ends
them: a worker exits on EOF, on a broken collective, or when its parent process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from common.engine.kv_connector import KVConnector
from common.engine.model_runner import ModelRunner, StepInputs
from common.kv.kv_cache import KVCacheSpec, KVScales, PagedKVCache
from common.kv.offload import gather_blocks, scatter_blocks
from common.model.config import ModelConfig
from common.model.llama import LlamaForCausalLM
from common.parallel.collective import GlooCollective, TPRank, Unconnected, gloo_group
from common.parallel.messages import (
    AgentMessage,
    RankCall,
    RankGone,
    RankOp,
    RankReply,
    RankReport,
    RankStats,
    call_id_of,
)
from common.parallel.partition import ShardLayout
from common.protocol import KVCompat, ProtocolError, decode, encode
from common.runtime.allocator import tune as tune_allocator

log = logging.getLogger("splitserve.tp")

# A collective waits at most this long for the other ranks. Ranks run each step in lockstep (one
# all-reduce per half layer), so this only bounds how long a hung or vanished rank goes unnoticed.
OP_TIMEOUT_S = 300.0
START_TIMEOUT_S = 300.0  # spawning, importing torch, joining the group, receiving the weights
WEIGHTS_TAG = 7


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    store_port: int
    model_config: ModelConfig
    dtype: torch.dtype
    layout: ShardLayout
    kv_spec: KVCacheSpec
    num_threads: int
    compat: KVCompat | None = None  # this rank's transfer preflight record
    transfer: RankTransferSpec | None = None  # a service: the rank's own KV transfer agent
    scales: KVScales | None = None  # an fp8 cache: its heads' scales
    exact_prefill: bool = True  # an fp8 cache: prefill chunks read their own K/V as computed


class RankAgent(Protocol):
    """A worker rank's KV transfer side (kv_transfer.ranks.RankAgent)."""

    endpoint: str  # a decode agent's receiver endpoint ("" for a prefill agent)

    def save_layer(self, layer: int, items: Any) -> None: ...

    def close(self) -> None: ...


class RankTransferSpec(Protocol):
    """How a worker starts its agent (kv_transfer.ranks.RankTransfer: picklable, sent at spawn)."""

    def start(
        self, kv: PagedKVCache, compat: KVCompat, conn: multiprocessing.connection.Connection
    ) -> RankAgent: ...


@dataclass
class StepMessage:
    """What a worker does for one step, in this order: forget, swap out, swap in, forward."""

    step: StepInputs | None = None
    save: Any = None  # the layer writes every rank posts during the forward (a prefill service)
    drop: list[str] = field(default_factory=list)  # swapped-out copies of sequences let go
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)  # (seq id, its blocks)
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)  # (seq id, the blocks it gets)

    @property
    def is_empty(self) -> bool:
        return self.step is None and not (self.drop or self.swap_out or self.swap_in)


@dataclass
class TierOut:
    """Rank 0 asks a worker for its KV heads of blocks the prefix cache evicted (the offload tiers):
    answered with a TierReply and, unless it failed, the bytes (`gather_blocks`) as the next frame."""

    call: int
    block_ids: list[int]


@dataclass
class TierIn:
    """Rank 0 hands a worker its KV heads of blocks a tier read returned: `nbytes` of block-major bytes
    follow as the next frame; written into `block_ids`, then answered with a TierReply."""

    call: int
    block_ids: list[int]
    nbytes: int


@dataclass
class TierReply:
    """A worker's answer to TierOut or TierIn `call`: error "" when it went well; `nbytes` is not None
    when that many bytes follow as the next frame (a TierOut that went well)."""

    call: int
    error: str = ""
    nbytes: int | None = None


class TPWorkers:
    """Rank 0's side of the group: starts the workers, hands them their shards, sends each step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        layouts: list[ShardLayout],
        kv_specs: list[KVCacheSpec],
        num_threads: int,
        compats: list[KVCompat] | None = None,
        transfer: RankTransferSpec | None = None,
        scales: list[KVScales | None] | None = None,
        exact_prefill: bool = True,
    ) -> None:
        """Start ranks 1.. and build rank 0's shard of `model` (a whole model, left as it is):
        `self.model`. Returns once every worker holds its weights and KV cache (and, with `transfer`,
        its agent runs: a decode agent's endpoint is in `self.endpoints`)."""
        n = len(layouts)
        self.world_size = n
        self._pending = StepMessage()
        self.endpoints: list[str] = []  # ranks 1..: their receivers' endpoints (decode agents)
        self._controls: list[multiprocessing.connection.Connection] = []
        self._calls = itertools.count(1)
        self._tier_calls = itertools.count(1)  # TierOut / TierIn on the step pipes
        self._tier_out: tuple[int, list[int]] | None = None  # (call, ranks asked)
        self._tier_in: tuple[int, list[int], list[str]] | None = None  # (call, ranks sent to, errors)
        self._replies: dict[tuple[int, int], asyncio.Future[str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_report: Callable[[int, RankReport], None] | None = None
        self.rank_stats: dict[int, RankStats] = {}  # rank -> its agent's last counters
        # A worker that exits while the engine runs (killed, crashed): on_lost(rank) runs on the
        # listening thread (a service exits: the engine cannot step without the rank). Not on close().
        self.on_lost: Callable[[int], None] | None = None
        self._closing = {"set": False}
        timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        # close() and the interpreter's exit (or this object's collection) stop the workers
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._closing)
        try:
            for r in range(1, n):
                compat = compats[r] if compats is not None else None
                spec = WorkerSpec(
                    r, n, store.port, model.config, model.dtype, layouts[r], kv_specs[r], num_threads,
                    compat, transfer, scales[r] if scales is not None else None, exact_prefill,
                )  # fmt: skip
                ours, theirs = ctx.Pipe()
                ctl_ours, ctl_theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main, args=(spec, theirs, ctl_theirs), name=f"splitserve-tp{r}", daemon=True
                )
                proc.start()
                theirs.close()
                ctl_theirs.close()
                self._procs.append(proc)
                self._conns.append(ours)
                self._controls.append(ctl_ours)
            group = self._wait(lambda: gloo_group(store, 0, n, OP_TIMEOUT_S), "join the gloo group")
            self._group, self._store = group, store
            for r in range(1, n):  # one shard at a time: the whole model and one shard at most
                shard = model.shard(TPRank(layouts[r], Unconnected(r, n)))
                tensors = list(shard.state_dict().values())
                del shard
                self._wait(functools.partial(_send_all, group, tensors, r), f"send rank {r} its weights")
                del tensors
            for r, conn in enumerate(self._conns, start=1):
                self.endpoints.append(self._wait(functools.partial(_ready, conn), f"hear from rank {r}"))
            for r, conn in enumerate(self._controls, start=1):
                threading.Thread(
                    target=self._listen, args=(r, conn), name=f"splitserve-tp{r}-ctl", daemon=True
                ).start()
            self.comm = GlooCollective(group, 0, n)  # rank 0's collectives (and their time)
            self.model = model.shard(TPRank(layouts[0], self.comm))
        except BaseException:
            self.close()
            raise

    def _wait(self, fn: Callable[[], Any], what: str) -> Any:
        """Run fn (a blocking call the workers must answer) while watching them: a worker that exits
        meanwhile fails the start at once, naming it, instead of after a timeout."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller below
                box["error"] = e

        t = threading.Thread(target=run, name="splitserve-tp-start", daemon=True)
        t.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while t.is_alive():
            t.join(0.1)
            for r, proc in enumerate(self._procs, start=1):
                if not proc.is_alive() and t.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {r} exited (code {proc.exitcode}) before it could {what}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel start: timed out waiting to {what}")
        if "error" in box:
            raise RuntimeError(f"tensor-parallel start: could not {what}: {box['error']}") from box["error"]
        return box.get("value")

    # --- per step -----------------------------------------------------------------------------------
    def swap_out(self, seq_id: str, blocks: list[int]) -> None:
        self._pending.swap_out.append((seq_id, list(blocks)))

    def swap_in(self, seq_id: str, blocks: list[int]) -> None:
        self._pending.swap_in.append((seq_id, list(blocks)))

    def drop(self, seq_id: str) -> None:
        self._pending.drop.append(seq_id)

    def run(self, step: StepInputs | None, save: Any = None) -> None:
        """Send the workers this step (None: only the KV operations queued since the last one), with
        the layer writes they post during it (`save`, the connector's `rank_meta`)."""
        msg, self._pending = self._pending, StepMessage()
        msg.step, msg.save = step, save
        if msg.is_empty:
            return
        for r, proc in enumerate(self._procs, start=1):  # a step with a rank missing would fail in gloo
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {r} is gone (exit code {proc.exitcode})")
        self._send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def flush(self) -> None:
        """Send the queued KV operations now (a step that computes nothing)."""
        self.run(None)

    def _send(self, data: bytes) -> None:
        for r, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as e:
                code = self._procs[r - 1].exitcode
                raise RuntimeError(f"tensor-parallel rank {r} is gone (exit code {code}): {e}") from e

    # --- the KV offload tiers (common/kv/offload.py's ShardPeers) ----------------------------------
    def tier_out(self, ranks: Sequence[int], block_ids: Sequence[int]) -> None:
        """Ask each of `ranks` (workers) for its KV heads of the blocks; `tier_out_wait` returns them.
        RuntimeError naming the rank if one is gone."""
        call = next(self._tier_calls)
        self._tier_out = (call, list(ranks))
        msg = pickle.dumps(TierOut(call, list(block_ids)), protocol=pickle.HIGHEST_PROTOCOL)
        for r in ranks:
            self._tier_send(r, msg)

    def tier_out_wait(self) -> list[torch.Tensor]:
        """The last `tier_out`'s ranks' KV heads of its blocks (flat uint8, block-major), once every one
        of them has copied them out; RuntimeError naming the rank if one failed or is gone (or did not
        answer within OP_TIMEOUT_S)."""
        assert self._tier_out is not None, "tier_out first"
        (call, ranks), self._tier_out = self._tier_out, None
        out: list[torch.Tensor] = []
        for r in ranks:
            reply = self._tier_reply(r, call)
            if reply.error:
                raise RuntimeError(f"tensor-parallel rank {r}: {reply.error}")
            assert reply.nbytes is not None
            buf = torch.empty(reply.nbytes, dtype=torch.uint8)
            try:
                self._conns[r - 1].recv_bytes_into(buf.numpy())
            except (EOFError, OSError) as e:
                raise RuntimeError(f"tensor-parallel rank {r} is gone: {e}") from e
            out.append(buf)
        return out

    def tier_in(self, block_ids: Sequence[int], shards: Sequence[torch.Tensor]) -> None:
        """Send worker rank r its KV heads of the blocks (`shards[r - 1]`, block-major uint8) to write;
        `tier_in_wait` hears whether every rank did."""
        call = next(self._tier_calls)
        sent: list[int] = []
        errors: list[str] = []
        for r, shard in enumerate(shards, start=1):
            data = shard.contiguous().view(torch.uint8).reshape(-1)
            msg = pickle.dumps(TierIn(call, list(block_ids), data.numel()), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                self._tier_send(r, msg, data.numpy().data)
                sent.append(r)
            except RuntimeError as e:
                errors.append(str(e))
        self._tier_in = (call, sent, errors)

    def tier_in_wait(self) -> str:
        """Wait for every worker's answer to the last `tier_in`: "" when each wrote its heads, else why
        not (every rank that did not, named)."""
        assert self._tier_in is not None, "tier_in first"
        (call, sent, errors), self._tier_in = self._tier_in, None
        for r in sent:
            try:
                reply = self._tier_reply(r, call)
            except RuntimeError as e:
                errors.append(str(e))
                continue
            if reply.error:
                errors.append(f"tensor-parallel rank {r}: {reply.error}")
        return "; ".join(errors)

    def _tier_send(self, rank: int, msg: bytes, payload: memoryview | None = None) -> None:
        if not self._conns:
            raise RuntimeError("the tensor-parallel workers are stopped")
        try:
            self._conns[rank - 1].send_bytes(msg)
            if payload is not None:
                self._conns[rank - 1].send_bytes(payload)
        except OSError as e:
            code = self._procs[rank - 1].exitcode
            raise RuntimeError(f"tensor-parallel rank {rank} is gone (exit code {code}): {e}") from e

    def _tier_reply(self, rank: int, call: int) -> TierReply:
        """Worker `rank`'s TierReply to `call` (a late one to an earlier call, and its bytes, skipped);
        RuntimeError when the rank failed, is gone or stays silent for OP_TIMEOUT_S."""
        if not self._conns:
            raise RuntimeError("the tensor-parallel workers are stopped")
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        deadline = time.monotonic() + OP_TIMEOUT_S
        while True:
            try:
                if not conn.poll(0.1):
                    if not proc.is_alive():
                        raise RuntimeError(f"tensor-parallel rank {rank} is gone (exit code {proc.exitcode})")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"tensor-parallel rank {rank}: no answer in {OP_TIMEOUT_S:g} s")
                    continue
                msg = pickle.loads(conn.recv_bytes())
                if isinstance(msg, TierReply) and msg.call != call and msg.nbytes is not None:
                    conn.recv_bytes()  # the bytes of an answer nobody waits for any more
            except (EOFError, OSError) as e:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} is gone (exit code {proc.exitcode}): {e!r}"
                ) from e
            if isinstance(msg, TierReply):
                if msg.call == call:
                    return msg
                continue
            if isinstance(msg, tuple) and msg and msg[0] == "error":  # the worker failed and exits
                raise RuntimeError(str(msg[1]))
            raise RuntimeError(f"tensor-parallel rank {rank}: a {type(msg).__name__} on the step pipe")

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()
        for conn in self._controls:
            conn.close()
        self._controls.clear()

    # --- the transfer agents (event loop) ---------------------------------------------------------
    def attach(self, on_report: Callable[[int, RankReport], None]) -> None:
        """Hear the agents on the running event loop: replies to `call`, and reports, which go to
        on_report(rank, message) on the loop. Once; later calls change nothing. (Their counters,
        `rank_stats`, are kept from the start.)"""
        if self._loop is None:
            self._loop, self._on_report = asyncio.get_running_loop(), on_report

    async def call(self, op: RankOp) -> list[str]:
        """Ask every agent to do `op` (common/parallel/messages.py) and wait for all answers: the errors
        ("" where it went well), rank 1 first. A rank that is gone answers with that."""
        assert self._loop is not None, "attach() first"
        call_id = next(self._calls)
        data = encode(RankCall(call_id=call_id, op=op))
        futs = []
        for r, conn in enumerate(self._controls, start=1):
            fut = self._loop.create_future()
            self._replies[(r, call_id)] = fut
            try:
                conn.send_bytes(data)
            except OSError as e:
                self._replies.pop((r, call_id))
                fut.set_result(f"rank {r} is gone: {e}")
            futs.append(fut)
        return list(await asyncio.gather(*futs))

    def _listen(self, rank: int, conn: multiprocessing.connection.Connection) -> None:
        while True:
            msg = _read(rank, conn)
            if msg is None:
                continue
            if isinstance(msg, RankStats):
                self.rank_stats[rank] = msg
                continue
            loop = self._loop  # replies only follow calls, made on the loop once attached
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens any more
                    loop.call_soon_threadsafe(self._heard, rank, msg)
            if isinstance(msg, RankGone):
                if self.on_lost is not None and not self._closing["set"]:
                    self.on_lost(rank)
                return

    def _heard(self, rank: int, msg: RankReply | RankReport) -> None:
        if isinstance(msg, RankReply):
            fut = self._replies.pop((rank, msg.call_id), None)
            if fut is not None and not fut.done():
                fut.set_result(msg.error)
            return
        if isinstance(msg, RankGone):  # every call still waiting on this rank fails
            for key in [k for k in self._replies if k[0] == rank]:
                fut = self._replies.pop(key)
                if not fut.done():
                    fut.set_result(f"tensor-parallel rank {rank} is gone")
        if self._on_report is not None:
            self._on_report(rank, msg)

    @property
    def alive(self) -> list[int]:
        """Pids of the workers still running (for tests and /health-like checks)."""
        return [p.pid for p in self._procs if p.is_alive()]


def _read(rank: int, conn: multiprocessing.connection.Connection) -> AgentMessage | RankGone | None:
    """The next message from a worker's agent: RankGone once its pipe ends; a message that does not
    decode is logged and, when it names a call, fails that call with the reason (None otherwise)."""
    try:
        data = conn.recv_bytes()
    except (EOFError, OSError):
        return RankGone()
    try:
        msg: AgentMessage = decode(data, AgentMessage)
    except ProtocolError as e:
        log.error("rank %d: a control message that does not decode: %s", rank, e)
        call_id = call_id_of(data)
        return RankReply(call_id=call_id, error=f"rank {rank}: {e}") if call_id is not None else None
    return msg


def _send_all(group: Any, tensors: list[torch.Tensor], rank: int) -> None:
    for t in tensors:
        group.send([t.contiguous()], rank, WEIGHTS_TAG).wait()


def _ready(conn: multiprocessing.connection.Connection) -> str:
    """The worker's ready message: its agent's endpoint ("" without one)."""
    kind, detail = conn.recv()
    if kind != "ready":
        raise RuntimeError(detail)
    return str(detail)


def _stop(
    procs: list[Any], conns: list[multiprocessing.connection.Connection], closing: dict[str, bool]
) -> None:
    closing["set"] = True  # the workers' exits from here on are ours
    stop = pickle.dumps(None)
    for conn in conns:
        with contextlib.suppress(OSError):  # that worker is gone already
            conn.send_bytes(stop)
    deadline = time.monotonic() + 10
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            log.warning("tensor-parallel worker %s did not stop: killing it", proc.name)
            proc.kill()
            proc.join(5)
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()


# --- the worker process -------------------------------------------------------------------------------
def worker_main(
    spec: WorkerSpec,
    conn: multiprocessing.connection.Connection,
    control: multiprocessing.connection.Connection,
) -> None:
    """A worker rank's process: join, receive the shard, then run steps until told to stop or rank 0
    is gone. Always ends with os._exit (no interpreter teardown racing gloo's threads)."""
    tune_allocator()  # before any thread: see common/runtime/allocator.py
    _exit_with_parent()
    code = 0
    try:
        torch.set_num_threads(spec.num_threads)
        timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", spec.store_port, None, False, timeout=timeout)
        group = gloo_group(store, spec.rank, spec.world_size, OP_TIMEOUT_S)
        tp = TPRank(spec.layout, GlooCollective(group, spec.rank, spec.world_size))
        model = LlamaForCausalLM.empty(spec.model_config, spec.dtype, tp)
        for t in model.state_dict().values():
            group.recv([t], 0, WEIGHTS_TAG).wait()
        kv = PagedKVCache(
            spec.kv_spec, compute_dtype=spec.dtype, scales=spec.scales, exact_prefill=spec.exact_prefill
        )
        agent = None
        if spec.transfer is not None:
            assert spec.compat is not None
            agent = spec.transfer.start(kv, spec.compat, control)
        runner = ModelRunner(model, kv, connector=_AgentHook(agent) if agent is not None else None)
        conn.send(("ready", agent.endpoint if agent is not None else ""))
        _serve(conn, runner, kv)
    except (EOFError, OSError):
        code = 0  # rank 0 closed its end: the engine is gone
    except BaseException:
        code = 1
        detail = f"tensor-parallel rank {spec.rank} failed:\n{traceback.format_exc()}"
        log.error("%s", detail)
        with contextlib.suppress(OSError):
            conn.send(("error", detail))
    os._exit(code)


def _serve(conn: multiprocessing.connection.Connection, runner: ModelRunner, kv: PagedKVCache) -> None:
    swapped: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    while True:
        msg = pickle.loads(conn.recv_bytes())  # EOFError once rank 0 is gone
        if msg is None:
            return
        if isinstance(msg, TierOut):
            _tier_out(conn, kv, msg)
            continue
        if isinstance(msg, TierIn):
            _tier_in(conn, kv, msg)
            continue
        assert isinstance(msg, StepMessage)
        for seq_id in msg.drop:
            swapped.pop(seq_id, None)
        for seq_id, blocks in msg.swap_out:
            swapped[seq_id] = kv.copy_out(blocks)
        for seq_id, blocks in msg.swap_in:
            kv.copy_in(blocks, swapped.pop(seq_id))
        if msg.step is not None:
            runner.run_shard(msg.step, msg.save)


def _tier_out(conn: multiprocessing.connection.Connection, kv: PagedKVCache, msg: TierOut) -> None:
    """Answer a TierOut: this rank's heads of the blocks, copied now (before the next step)."""
    try:
        data = gather_blocks(kv, msg.block_ids).reshape(-1)
    except Exception as e:  # answered: rank 0 drops these blocks, the rank goes on
        conn.send_bytes(pickle.dumps(TierReply(msg.call, error=f"copying blocks out failed: {e!r}")))
        return
    conn.send_bytes(pickle.dumps(TierReply(msg.call, nbytes=data.numel())))
    conn.send_bytes(data.numpy().data)


def _tier_in(conn: multiprocessing.connection.Connection, kv: PagedKVCache, msg: TierIn) -> None:
    """Apply a TierIn (its bytes are the next frame, read whatever happens) and answer it."""
    buf = torch.empty(msg.nbytes, dtype=torch.uint8)
    error = ""
    try:
        conn.recv_bytes_into(buf.numpy())
        s = kv.spec
        shape = (len(msg.block_ids), 2, s.num_layers, s.block_size, s.num_kv_heads, -1)
        scatter_blocks(kv, msg.block_ids, buf.view(shape))
    except (EOFError, OSError):
        raise
    except Exception as e:  # answered: the load is a miss on every rank, the rank goes on
        error = f"writing blocks from a tier failed: {e!r}"
    conn.send_bytes(pickle.dumps(TierReply(msg.call, error=error)))


class _AgentHook(KVConnector):
    """A worker runner's connector: each layer of a step with writes goes to the rank's agent."""

    def __init__(self, agent: RankAgent) -> None:
        self.agent = agent

    def save_layer(self, layer: int, meta: Any) -> None:
        self.agent.save_layer(layer, meta)


def _exit_with_parent() -> None:
    """Exit as soon as the parent (rank 0) is gone, whatever this process is blocked in."""
    parent = mp.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="splitserve-tp-parent", daemon=True).start()
