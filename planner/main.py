"""`splitserve planner`: read the signals every --interval-s, decide, log the decision with its inputs
(one JSON line), hand it to the actuator. The only actuator so far is the dry run: it says what it would
do (starting and stopping `splitserve up` workers, or patching Kubernetes replicas, is still to come)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any

from planner.policy import Decision, Planner, PlannerConfig
from planner.signals import SignalReader, describe

log = logging.getLogger("splitserve.planner")


def config_from_args(args: argparse.Namespace) -> PlannerConfig:
    """The planner's settings from `splitserve planner`'s flags, or `up --autoscale`'s (which add the
    autoscale_* timings)."""
    given = {f: getattr(args, f) for f in ("ttft_target_s", "tpot_target_s", "budget")}
    for role in ("prefill", "decode"):
        given |= {f"min_{role}": getattr(args, f"min_{role}"), f"max_{role}": getattr(args, f"max_{role}")}
    timings = {"cooldown_s": "autoscale_cooldown_s", "down_stable_s": "autoscale_down_after_s"}
    timings["window_s"] = "autoscale_window_s"
    given |= {k: getattr(args, a) for k, a in timings.items() if getattr(args, a, None) is not None}
    return PlannerConfig(**given)


class DryRun:
    """Says what it would do; changes nothing."""

    def __init__(self) -> None:
        self.applied: tuple[int, int] | None = None

    def apply(self, d: Decision) -> None:
        if (d.prefill, d.decode) != self.applied:
            log.info("dry run: would run %d prefill and %d decode workers", d.prefill, d.decode)
            self.applied = (d.prefill, d.decode)


async def run(config: PlannerConfig, reader: SignalReader, interval_s: float, rounds: int | None) -> Decision:
    planner, actuator = Planner(config), DryRun()
    decision: Decision | None = None
    done = 0
    try:
        while rounds is None or done < rounds:
            signals = await reader.read()
            decision = planner.step(signals, time.monotonic())
            line: dict[str, Any] = {**decision.as_log(), "signals": describe(signals)}
            print(json.dumps(line, sort_keys=True), flush=True)  # the decision log: stdout, one line each
            actuator.apply(decision)
            done += 1
            if rounds is None or done < rounds:
                await asyncio.sleep(interval_s)
    finally:
        await reader.close()
    assert decision is not None
    return decision


def main(args: argparse.Namespace) -> int:
    from common.runtime.logs import configure_logging

    configure_logging(args.log_level, args.log_format, process="planner")
    if not args.redis_url:
        print("error: --redis-url / SPLITSERVE_REDIS_URL: where the worker registry is", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reader = SignalReader(args.redis_url, args.router_url, args.api_key)
    try:
        asyncio.run(run(config, reader, args.interval_s, args.rounds))
    except KeyboardInterrupt:
        return 0
    return 0
