"""One remote-KV request: the blocks, the fence, the lease and the state of one side of one transfer.

    decode side (IncomingKV)   RESERVED ──first write allowed──▶ RECEIVING ──kv_done, every layer──▶ ARRIVED
    prefill side (OutgoingKV)  HELD (computing, layers leave as they are computed) ──kv_done sent──▶ SENT
    either side                ──abort, failure, lost peer──▶ ENDED   (its fence is stale from then on)

The fence is the decode service's number for one reservation; both sides of a transfer carry it, so a
retry (a new reservation) never accepts a write or a kv_done meant for the attempt it replaced.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from opentelemetry import trace

from common.cluster.leases import LeaseTerm
from common.parallel.plan import Tally
from common.protocol import KVDone


class TransferState(StrEnum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    ARRIVED = "arrived"
    HELD = "held"
    SENT = "sent"
    ENDED = "ended"


@dataclass(eq=False)
class RemoteKV:
    request_id: str
    fence: int
    block_ids: list[int]  # decode: the reserved blocks; prefill: where they go on the decode service
    state: TransferState
    lease: LeaseTerm = field(default_factory=LeaseTerm)
    # layer groups 1.. (common/kv/layer_groups.py): their pages for the same blocks as block_ids
    group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def open(self) -> bool:
        """Still moving KV: neither delivered nor ended."""
        return self.state in (TransferState.RESERVED, TransferState.RECEIVING, TransferState.HELD)


@dataclass(eq=False)
class IncomingKV(RemoteKV):
    """A decode service's reservation."""

    num_cached_tokens: int = 0  # prompt tokens this service already held (prefix cache): not sent
    tally: Tally = field(default_factory=Tally)  # rank 0's layer writes in place and kv_dones heard
    ranks_done: set[int] = field(default_factory=set)  # ranks whose KV is complete (tensor parallelism)
    done: KVDone | None = None  # rank 0's last kv_done: the first token


@dataclass(eq=False)
class OutgoingKV(RemoteKV):
    """A prefill service's request whose KV goes to a decode service's reservation."""

    endpoint: str = ""  # the decode service's KV endpoint
    skip_blocks: int = 0  # leading destination blocks the decode service already holds
    # per layer, the first prompt block decoding reads (sliding-window layers: the window's; else 0)
    first_needed: tuple[int, ...] = ()
    routes: list[tuple[str, Any]] = field(default_factory=list)  # rank 0's (decode endpoint, heads) pairs
    block_bytes: int = 0  # K and V bytes of one block of one layer, every rank's heads together
    first_chunk: bool = True  # the first chunk also ships prefix blocks this service had cached
    # Written on the engine thread while the request computes; read on the event loop only after a
    # step boundary (its first token, or a Finish command) makes them final.
    writes: list[concurrent.futures.Future[Any]] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # the decode rank's endpoint of each of writes
    nbytes: int = 0
    dst_blocks: set[int] = field(default_factory=set)
    layers: set[int] = field(default_factory=set)
    # (start, end, tokens) per chunk, wall ns: from the layer-0 to the last-layer hook of its step
    chunks: list[list[int]] = field(default_factory=list)
    active: list[tuple[float, float]] = field(default_factory=list)  # perf_counter span of each write
    arrival_ns: int = field(default_factory=time.time_ns)
    trace_ctx: Any = None  # the request's span context: parent of kv.transfer
    traceparent: str | None = None  # the kv.transfer span's, once it started (else the request's)
    span: trace.Span = trace.INVALID_SPAN  # kv.transfer
    released: bool = False  # the transfer let go of the source blocks: the engine may free them

    def active_s(self) -> float:
        """Time at least one layer write was in flight: the union of the writes' intervals. Bandwidth
        is bytes over this, not over the wall time, which includes waiting for layers to compute."""
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.active):
            if b > end:
                total += b - max(a, end)
                end = b
        return total
