"""What the KV offload tier tests share: requests run one at a time over an engine with tiers, and a
tier's figures."""

from __future__ import annotations

from collections.abc import Callable

from common.engine.llm_engine import LLMEngine
from common.kv.tiers import TierStats
from common.sampling_params import SamplingParams

WAIT_S = 30  # how long a test waits for the tiers' writer to catch up


def run_in_turn(
    engine: LLMEngine,
    prompts: list[list[int]],
    order: list[int],
    params: SamplingParams,
    before: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """The requests `order` names, one at a time; before each, the tiers' writes are done (a condition,
    not a sleep) and `before(i)` may inject a fault. The block manager's integrity is checked after."""
    outs = []
    for i, p in enumerate(order):
        if engine.kv_offload is not None:
            assert engine.kv_offload.store.wait_idle(WAIT_S), "the tier writer never caught up"
        if before is not None:
            before(i)
        outs.append(engine.generate([prompts[p]], params)[0].token_ids)
    engine.block_manager.check_integrity()
    return outs


def tier(engine: LLMEngine, name: str) -> TierStats:
    """The figures of the engine's `name` tier ("ram" or "disk")."""
    assert engine.kv_offload is not None
    return next(t for t in engine.kv_offload.stats().tiers if t.tier == name)
