"""The prefill service's KV connector: ships each request's prompt KV into a decode service's reserved
blocks, layer by layer, while the rest of the step computes.

Scheduler side. Event loop: `add` registers a request's destination (endpoint, blocks, fence) and
takes its lease before the engine sees it; `finish_sending` waits for its writes and sends kv_done;
`stop` and `settle` end it. Engine thread, between steps: `build_meta` turns the step's schedule into
the block ranges each request ships this step; `holds_blocks` keeps a finished request's blocks until
its writes are done.
Worker side (engine thread, inside the forward pass): `save_layer(i, meta)` posts layer i's writes to
the event loop as soon as the layer is in the cache.

With tensor parallelism every rank sends its own KV heads: this connector (rank 0) sends rank 0's,
and hands each step's writes to the worker ranks (`rank_meta`), whose agents post theirs
(kv_transfer/ranks.py); `finish_sending` and `settle` wait for every rank. Which heads go to which
decode rank (the decode service may have another TP size) is common/parallel/plan.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import trace

from common.connector.base import RemoteKVConnector
from common.connector.remote_kv import OutgoingKV, TransferState
from common.engine.scheduler import SchedulerOutput
from common.engine.sequence import Sequence
from common.kv.block_manager import HOLE
from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.parallel.messages import Finish, Settle
from common.parallel.plan import (
    HeadSlice,
    SaveItem,
    layer_pairs,
    plan,
    shard_dones,
    shard_writes,
    split_endpoints,
)
from common.protocol import KVCompat, KVDone, PrefillRequest, TransferError
from common.runtime.telemetry import span_ctx, traceparent, tracer

if TYPE_CHECKING:
    from common.engine.tp_workers import TPWorkers

S = TransferState
_tracer = tracer(__name__)


class KVSink(Protocol):
    """What the connector needs of a KV sender (kv_transfer.KVSender is one)."""

    async def send_layer(
        self,
        endpoint: str,
        request_id: str,
        fence: int,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        traceparent: str | None = None,
        heads: HeadSlice | None = None,
    ) -> None: ...

    async def send_done(self, endpoint: str, msg: KVDone) -> None: ...


@dataclass(frozen=True)
class LayerWrite:
    """One request's share of a step: these source blocks go to those destination blocks, every layer."""

    rkv: OutgoingKV
    src: list[int]
    dst: list[int]
    tokens: int  # tokens of the request this step computes
    skip: tuple[int, ...] = ()  # per layer, leading pairs left out: out of that layer's sliding window
    # layer groups 1.. (common/kv/layer_groups.py): their pages for the same blocks as src/dst
    group_src: list[list[int]] = field(default_factory=list)
    group_dst: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class SaveMeta:
    """A step's transfer work, built once before the forward pass (no Sequence is read inside it)."""

    writes: list[LayerWrite]
    last_layer: int


class PrefillConnector(RemoteKVConnector[OutgoingKV]):
    peer_gone = "decode service lease expired"

    def __init__(
        self, sender_for: Callable[[str], KVSink], on_failed: Callable[[OutgoingKV, str], None]
    ) -> None:
        super().__init__(on_failed)  # the decode side is gone: the service ends the request
        self.sender_for = sender_for  # the sender for a decode service's endpoint (its scheme names it)
        self.block_size = self.num_layers = self.head_bytes = 0  # from bind()
        self.spec: KVCacheSpec | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, kv: PagedKVCache) -> None:
        s = self.spec = kv.spec
        self.block_size, self.num_layers = s.block_size, s.num_layers
        self.head_bytes = 2 * s.block_size * s.head_dim * kv.k.element_size()  # one KV head's K and V
        self.group_of = kv.group_of  # each layer's layer group (common/kv/layer_groups.py)
        self.group_layers = [s.groups.layers(g) for g in range(s.groups.num_groups)]
        self._heads = (s.num_kv_heads, 1)  # (the model's KV heads, ranks): one rank until bind_ranks

    def bind_ranks(self, ranks: TPWorkers | None, compat: KVCompat) -> None:
        super().bind_ranks(ranks, compat)
        self._heads = (compat.num_kv_heads, compat.tp_size)

    def _routes(self, endpoint: str) -> list[tuple[str, HeadSlice | None]]:
        """Where rank 0's writes for a decode service's endpoint(s) go, and which of its heads."""
        return shard_writes(*self._heads, 0, split_endpoints(endpoint))

    def _heads_moved(self, endpoint: str) -> int:
        """KV heads of a block every rank together writes to the decode service (with replicated
        heads on the decode side, more than the model has)."""
        return sum(r.heads.count for r in plan(*self._heads, len(split_endpoints(endpoint))))

    # --- scheduler side: event loop -------------------------------------------------------------------
    async def add(self, req: PrefillRequest, trace_ctx: Any = None) -> OutgoingKV:
        """Register where req's KV goes (before the engine sees the request) and lease our blocks."""
        self._loop = asyncio.get_running_loop()
        if self.ranks is not None:
            self.ranks.attach(lambda rank, msg: None)  # a prefill agent only answers calls
        rkv = OutgoingKV(
            req.request_id, req.fence, req.block_ids, S.HELD, group_block_ids=req.group_block_ids
        )
        rkv.endpoint, rkv.skip_blocks = req.kv_endpoint, req.num_cached_tokens // self.block_size
        if self.spec is not None and self.spec.layer_windows:  # sliding layers: only their windows move
            n = len(req.token_ids)
            rkv.first_needed = tuple(self.spec.first_needed_block(i, n) for i in range(self.num_layers))
        # once per request, not per layer write: the pairs rank 0 writes, and every rank's bytes a block
        rkv.routes = self._routes(req.kv_endpoint)
        rkv.block_bytes = self.head_bytes * self._heads_moved(req.kv_endpoint)
        rkv.trace_ctx, rkv.traceparent = trace_ctx, req.traceparent
        self.requests[req.request_id] = rkv
        if self.leases is not None:
            await self.leases.acquire(rkv)
        return rkv

    async def finish_sending(self, rkv: OutgoingKV, first_token: int, num_tokens: int) -> None:
        """The prompt is computed and token 0 sampled (so every layer write is posted): wait for them,
        then tell the decode service, ordered after the layers on the same sender. TransferError if a
        write or the notification failed."""
        for w in rkv.writes:
            await asyncio.wrap_future(w)
        msg = KVDone(rkv.request_id, rkv.fence, first_token, num_tokens, 0, rkv.traceparent)
        if self.ranks is not None:  # the other ranks wait for their writes and send their kv_dones
            errors = [e for e in await self.ranks.call(Finish(rkv.request_id, rkv.endpoint, msg)) if e]
            if errors:
                raise TransferError("; ".join(errors))
        for done, endpoint in shard_dones(*self._heads, 0, rkv.endpoint, msg, rkv.written):
            await self.sender_for(rkv.endpoint).send_done(endpoint, done)
        rkv.state = S.SENT

    def stop(self, rkv: OutgoingKV) -> None:
        """Post no more writes for rkv (writes already posted still run: `settle` waits for them)."""
        if rkv.open:
            rkv.state = S.ENDED

    async def settle(self, rkv: OutgoingKV) -> None:
        """After the engine stopped computing rkv (its first token, or a Finish): wait until no write
        reads its blocks, then let go of them and of the lease. The engine frees the blocks at the next
        Finish."""
        self.stop(rkv)
        for w in rkv.writes:
            with contextlib.suppress(Exception):  # a failed write reads nothing any more
                await asyncio.wrap_future(w)
        if self.ranks is not None:
            await self.ranks.call(Settle(rkv.request_id))  # a rank that is gone reads nothing either
        rkv.released = True
        await self._forget(rkv)

    # --- scheduler side: engine thread ----------------------------------------------------------------
    def holds_blocks(self, seq: Sequence) -> bool:
        rkv = self.requests.get(seq.seq_id)
        return rkv is not None and not rkv.released

    def build_meta(self, out: SchedulerOutput) -> SaveMeta | None:
        """Which blocks each request ships this step: the blocks its chunk wrote (a chunk resends the
        block it started in, partly filled by the chunk before), plus, with its first chunk, prefix
        blocks this service had cached; never blocks the decode service already holds."""
        bs, writes = self.block_size, []
        for seq, n in out.scheduled:
            rkv = self.requests.get(seq.seq_id)
            if rkv is None or rkv.state is not S.HELD:
                continue
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            first = max(0 if rkv.first_chunk else start // bs, rkv.skip_blocks)
            last = -(-end // bs)
            rkv.first_chunk = False
            if first < last:
                # per layer, the leading blocks of this write before the layer's window: not sent
                skip = tuple(max(0, min(f - first, last - first)) for f in rkv.first_needed)
                skip = skip if any(skip) else ()
                # per layer group, the source and destination blocks (one group: every layer's)
                srcs = [t[first:last] for t in (seq.block_table, *seq.group_tables)]
                dsts = [t[first:last] for t in (rkv.block_ids, *rkv.group_block_ids)]
                for g, (src, dst) in enumerate(zip(srcs, dsts, strict=True)):
                    # a HOLE (a block released before its layers' windows, here or in the decode
                    # service's reservation) may only be where none of the group's layers sends
                    lo = min(skip[layer] for layer in self.group_layers[g]) if skip else 0
                    if HOLE in src[lo:] or HOLE in dst[lo:]:
                        raise ValueError(
                            f"request {seq.seq_id}: a released block (HOLE) among the blocks a layer sends "
                            f"(layer group {g}, blocks {first + lo}..{last - 1}: source {src[lo:]}, "
                            f"destination {dst[lo:]})"
                        )
                writes.append(LayerWrite(rkv, srcs[0], dsts[0], n, skip, srcs[1:], dsts[1:]))
        return SaveMeta(writes, self.num_layers - 1) if writes else None

    def rank_meta(self, meta: SaveMeta) -> list[SaveItem] | None:
        """The step's writes as the worker ranks post them (each its own heads)."""
        if self.ranks is None:
            return None
        items = []
        for w in meta.writes:
            rkv = w.rkv
            self._start_span(rkv)  # the ranks' writes carry the kv.transfer span too
            items.append(
                SaveItem(
                    rkv.request_id,
                    rkv.fence,
                    rkv.endpoint,
                    w.src,
                    w.dst,
                    rkv.traceparent,
                    w.skip,
                    w.group_src,
                    w.group_dst,
                )  # fmt: skip
            )
        return items

    def _start_span(self, rkv: OutgoingKV) -> None:
        """The transfer's span starts with its first write."""
        if rkv.span is trace.INVALID_SPAN:
            rkv.span = _tracer.start_span("kv.transfer", context=rkv.trace_ctx)
            rkv.traceparent = traceparent(span_ctx(rkv.span)) or rkv.traceparent

    # --- worker side: engine thread, inside the forward pass ------------------------------------------
    def save_layer(self, layer: int, meta: SaveMeta) -> None:
        """Layer `layer` of the step is in the cache: post its writes; the next layer computes while
        the bytes move."""
        assert self._loop is not None
        now = time.time_ns()
        for w in meta.writes:
            rkv = w.rkv
            if layer == 0:
                rkv.chunks.append([now, 0, w.tokens])
            if layer == meta.last_layer and rkv.chunks:
                rkv.chunks[-1][1] = now
            if rkv.state is not S.HELD:
                continue  # stopped meanwhile
            src, dst = layer_pairs(
                w.src, w.dst, w.skip, layer, self.group_of[layer], w.group_src, w.group_dst
            )
            if not dst:
                continue  # this layer's window starts after these blocks: nothing of them is read
            self._start_span(rkv)
            sender = self.sender_for(rkv.endpoint)
            for endpoint, heads in rkv.routes:
                coro = sender.send_layer(
                    endpoint, rkv.request_id, rkv.fence, layer, src, dst, rkv.traceparent, heads=heads
                )
                rkv.writes.append(asyncio.run_coroutine_threadsafe(_timed(coro, rkv.active), self._loop))
                rkv.written.append(endpoint)
            rkv.nbytes += len(dst) * rkv.block_bytes  # every rank's
            rkv.dst_blocks.update(dst)
            rkv.layers.add(layer)


async def _timed(coro: Coroutine[Any, Any, None], active: list[tuple[float, float]]) -> None:
    """Run one layer write, noting when it was in flight (for the active transfer time)."""
    t0 = time.perf_counter()
    try:
        await coro
    finally:
        active.append((t0, time.perf_counter()))
