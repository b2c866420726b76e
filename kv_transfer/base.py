"""The KV-transfer interface: a prefill-side sender pushes one layer at a time into a decode-side receiver.

Every backend (tcp, nixl = UCX WRITE + notification, torch_dist = NCCL/gloo send/recv) implements these two
classes with the same guarantees:

- **Authentication**: before anything else, each control connection runs a mutual challenge-response
  (`control/auth.py`): both sides prove the cluster's internal secret without sending it. A failure is
  an `AuthError` on the sender, remembered like a refused preflight, and counted by the receiver.
- **Preflight**: the first contact between a sender and an endpoint exchanges `KVCompat` records; a mismatch
  is a `PreflightError` naming every differing field, remembered per endpoint (no retry storm), and counted
  by the receiver. Nothing is written before the preflight passed.
- **Fences**: before a layer lands, the receiver asks its owner `may_write(request_id, fence)`; a stale fence
  means the destination blocks may already belong to someone else, so the data is dropped, never written.
- **Arrival**: once a layer's bytes are in place the receiver tells its owner `layer_arrived(...)`; per
  (sender, endpoint) pair, a request's `kv_done` is delivered after all its layers arrived.
- **Ownership**: `send_layer` returns once the source blocks may be reused by the sender; it does not wait
  for the receiver to acknowledge. Delivery failure shows up as `TransferError` on a later call, or as a
  missing `kv_done` on the decode side (its lease expires).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from common.kv.kv_cache import PagedKVCache
from common.parallel.plan import HeadSlice
from common.protocol import KVCompat, KVDone

# TransferError is raised by every backend; it lives in common so that the connectors can raise it too
from common.protocol import TransferError as TransferError


class ReceiverOwner(Protocol):
    """Whom a receiver asks and tells about the blocks it writes into (the decode service's KV connector).
    Called on the event-loop thread."""

    def may_write(self, request_id: str, fence: int) -> bool:
        """Is this fence still current for the request's reserved blocks?"""

    def layer_arrived(self, request_id: str, fence: int, layer: int) -> None:
        """One layer write of (request, fence) is in place in the KV tensors."""

    def kv_done(self, msg: KVDone) -> None:
        """The sender says every layer of the request was written; at most once per received kv_done."""


class PreflightError(TransferError):
    """The receiver refused the pair: the two sides' KVCompat records differ (the message names every
    mismatching field), or the peer speaks another protocol version."""


class AuthError(PreflightError):
    """The first step of the preflight failed: the peer could not prove the cluster's internal secret, or
    it refused our proof (control.auth)."""


@dataclass
class ReceiverStats:
    bytes_received: int = 0  # raw KV bytes written into the cache (stale drops not included)
    layers_received: int = 0
    stale_drops: int = 0  # layers read and discarded because may_write() said the fence is stale
    preflight_refusals: int = 0
    auth_failures: int = 0  # connections that did not prove the internal secret; closed before anything else
    bad_messages: int = 0  # malformed or out-of-range headers; the connection is closed
    dones_received: int = 0


@dataclass
class SenderStats:
    bytes_sent: int = 0
    layers_sent: int = 0
    dones_sent: int = 0


class KVReceiver(ABC):
    """Decode side: owns the destination KV memory and lets senders write layers into reserved blocks."""

    def __init__(self, kv: PagedKVCache, compat: KVCompat, owner: ReceiverOwner) -> None:
        self.kv = kv
        self.compat = compat
        self.owner = owner
        self.stats = ReceiverStats()
        self.rank = 0  # the tensor-parallel rank whose KV shard `kv` is (0: no tensor parallelism)
        # this process's start: part of the advertised endpoint, and said in every preflight reply
        self.incarnation = uuid.uuid4().hex[:12]

    @abstractmethod
    async def start(self) -> str:
        """Begin accepting senders; returns the endpoint string to publish (e.g.
        "tcp://127.0.0.1:4711/3f2a9c01d4e5": the address and this receiver's incarnation)."""

    @abstractmethod
    async def wait_idle(self, request_id: str) -> None:
        """Return once no layer of `request_id` is being written into the KV tensors.

        A cancelled request must first make its fence stale (so `may_write` refuses further layers), then
        await this, and only then free its blocks: a layer accepted just before the cancel may still be
        landing, and the blocks must not be handed to another request under it.
        """

    @abstractmethod
    async def close(self) -> None:
        """Stop accepting and drop every connection. Idempotent."""


class KVSender(ABC):
    """Prefill side: pushes layers of local KV blocks into a remote receiver's blocks."""

    def __init__(self, kv: PagedKVCache, compat: KVCompat) -> None:
        self.kv = kv
        self.compat = compat
        self.stats = SenderStats()
        self.rank = 0  # the tensor-parallel rank whose KV shard `kv` is (0: no tensor parallelism)

    @abstractmethod
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
    ) -> None:
        """Copy layer `layer` (K and V) of local block `src_block_ids[i]` to remote block `dst_block_ids[i]`.
        `heads`: only those KV heads (heterogeneous tensor parallelism: the two shards hold different
        heads, common/parallel/plan.py); None: every head, both shards being the same heads.

        Returns when the source blocks may be reused. Raises PreflightError on an incompatible peer,
        TransferError when the peer cannot be reached or the connection breaks, ValueError on bad arguments.
        """

    @abstractmethod
    async def send_done(self, endpoint: str, msg: KVDone) -> None:
        """Tell the receiver that every layer of `msg.request_id` was sent (ordered after those layers)."""

    @abstractmethod
    async def close(self) -> None:
        """Close every peer connection. Idempotent."""
