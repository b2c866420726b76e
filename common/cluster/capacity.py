"""A prefill worker's capacity from the speed figures it publishes in its registry load (measured by
common/engine/speed.py): read by the planner, which must not import the engine, and by the engine's own
StepSpeed and the simulated fleet (bench/fleet_model.py)."""

from __future__ import annotations

from typing import Any


def full_step_tps(fixed_ms: float, per_token_ms: float, step_tokens: int, prefill_tps: float) -> float:
    """Prompt tokens per second of a step filled to its token budget, by the fit of step time against
    tokens: what a worker computes when prompts queue (its capacity). `prefill_tps`, the recent steps'
    average, until the fit exists; that under-rates a worker whose steps have been small (mostly fixed
    cost)."""
    if per_token_ms > 0 and step_tokens > 0:
        return step_tokens / (fixed_ms + per_token_ms * step_tokens) * 1000.0
    return prefill_tps


def prefill_capacity(load: dict[str, Any]) -> float:
    """A prefill worker's prompt tokens per second at a full step, from its registry load (0: not measured
    yet)."""
    return full_step_tps(
        float(load.get("prefill_step_ms", 0.0)), float(load.get("prefill_ms_per_token", 0.0)),
        int(load.get("step_tokens", 0)), float(load.get("prefill_tps", 0.0)),
    )  # fmt: skip
