"""What the engine asks of a service's KV connector (common/connector/): the engine side of requests
whose KV comes from, or goes to, another service. Called on the engine thread only.

At start-up: bind(kv_cache)
Scheduler side, between steps:
  holds_blocks(seq)   a finished sequence's blocks are still used by a transfer: keep them parked
  build_meta(out)     this step's transfer work (which blocks of which request go where), or None
Worker side, inside the forward pass:
  save_layer(i, meta) layer i of this step's tokens is in the cache: ship what meta says of it
"""

from __future__ import annotations

from typing import Any

from common.engine.scheduler import SchedulerOutput
from common.engine.sequence import Sequence
from common.kv.kv_cache import PagedKVCache


class KVConnector:
    """No remote KV: the offline engine, benchmarks. Services pass their role's connector."""

    def bind(self, kv: PagedKVCache) -> None:
        """The engine's KV cache, once it is allocated (block size, layers, bytes per block)."""

    def holds_blocks(self, seq: Sequence) -> bool:
        return False

    def build_meta(self, out: SchedulerOutput) -> Any | None:
        return None

    def save_layer(self, layer: int, meta: Any) -> None:
        raise AssertionError("save_layer without transfer metadata")
