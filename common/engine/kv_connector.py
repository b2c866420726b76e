"""What the engine asks of a service's KV connector (common/connector/): the engine side of requests
whose KV comes from, or goes to, another service. Called on the engine thread only.

At start-up: bind(kv_cache)
Scheduler side, between steps:
  holds_blocks(seq)   a finished sequence's blocks are still used by a transfer: keep them parked
  build_meta(out)     this step's transfer work (which blocks of which request go where), or None
  rank_meta(meta)     with tensor parallelism: what the other ranks need of it (they post their own writes)
Worker side, inside the forward pass:
  save_layer(i, meta) layer i of this step's tokens is in the cache: ship what meta says of it
"""

from __future__ import annotations

from typing import Any

from common.engine.scheduler import SchedulerOutput
from common.engine.sequence import Sequence
from common.kv.kv_cache import PagedKVCache
from common.protocol import KVCompat


class KVConnector:
    """No remote KV: the offline engine, benchmarks. Services pass their role's connector."""

    # With tensor parallelism: what each worker rank runs to move its own KV shard (a service's
    # kv_transfer.ranks.RankTransfer, set before the engine starts); None: no remote KV.
    rank_transfer: Any = None

    def bind(self, kv: PagedKVCache) -> None:
        """The engine's KV cache, once it is allocated (block size, layers, bytes per block)."""

    def bind_ranks(self, ranks: Any, compat: KVCompat) -> None:
        """The engine's preflight record and its tensor-parallel worker ranks (None: one rank)."""

    def holds_blocks(self, seq: Sequence) -> bool:
        return False

    def build_meta(self, out: SchedulerOutput) -> Any | None:
        return None

    def rank_meta(self, meta: Any) -> Any | None:
        """The part of a step's transfer metadata the other tensor-parallel ranks act on (picklable);
        None: they have nothing to do."""
        return None

    def save_layer(self, layer: int, meta: Any) -> None:
        raise AssertionError("save_layer without transfer metadata")
