"""The scheduler's configuration: frozen, one per engine (the policy's knobs with the rest)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["fcfs", "priority", "fair", "static"]
PreemptionMode = Literal["auto", "swap", "recompute"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # per-step token budget (decode tokens + prefill chunks)
    policy: Policy = "fcfs"
    preemption_mode: PreemptionMode = "auto"
    num_swap_blocks: int = 0  # host-memory blocks available to swapped-out sequences
    aging_s: float = 1.0  # priority, fair: waiting this long gains one priority level
    # fair: tenant -> weight (a tenant not named weighs 1.0); the credit a weight-1 tenant gets per
    # round, in tokens (None: max_num_batched_tokens)
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    fair_quantum_tokens: int | None = None
    # fair: prefill tokens per step, all together, beside the request of a tenant that just arrived to
    # an empty queue, which goes whole (None: the step budget). A small figure keeps the steps a
    # flooding tenant fills short, so a sparse tenant's request that arrives during one soon starts.
    fair_bulk_prefill_tokens: int | None = None
    # fair: a tenant that leaves part of its share of max_num_seqs unused while it has nothing queued
    # earns slot time to run over its share later, up to this many seconds of the whole batch (0:
    # never; common/engine/policy/fair.py): a sparse tenant's few overlapping requests are not held to
    # its share.
    fair_burst_s: float = 2.0
    # The model's smallest sliding window (None: no layer slides). A prompt whose KV arrives from a
    # prefill service holds, in its sliding layers, only the blocks of their windows (the rest were not
    # sent): such a sequence's blocks are never offered to the prefix cache.
    kv_window: int | None = None
    # Cost model for choosing swap or recompute (seconds). Defaults are CPU-ish; the engine
    # passes measured figures.
    swap_s_per_block: float = 2e-5  # copy one block out (and again back in)
    recompute_s_per_token: float = 2e-4  # prefill one token again

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.fair_quantum_tokens is not None and self.fair_quantum_tokens < 1:
            raise ValueError("fair_quantum_tokens must be positive")
        if self.fair_bulk_prefill_tokens is not None and self.fair_bulk_prefill_tokens < 1:
            raise ValueError("fair_bulk_prefill_tokens must be positive")
        if not (math.isfinite(self.fair_burst_s) and self.fair_burst_s >= 0):
            raise ValueError("fair_burst_s must be a finite number of seconds, 0 or more")
        bad = {t: w for t, w in self.tenant_weights.items() if not (math.isfinite(w) and w > 0)}
        if bad:
            raise ValueError(f"tenant weights must be positive and finite: {bad}")
        # a copy: the caller's dict may change, this config does not
        object.__setattr__(self, "tenant_weights", dict(self.tenant_weights))

    @property
    def quantum(self) -> int:
        """fair: tokens of credit per round for a tenant of weight 1."""
        return self.fair_quantum_tokens or self.max_num_batched_tokens

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)
