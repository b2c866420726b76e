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
        config = PlannerConfig(
            ttft_target_s=args.ttft_target_s,
            tpot_target_s=args.tpot_target_s,
            min_prefill=args.min_prefill,
            min_decode=args.min_decode,
            max_prefill=args.max_prefill,
            max_decode=args.max_decode,
            budget=args.budget,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reader = SignalReader(args.redis_url, args.router_url, args.api_key)
    try:
        asyncio.run(run(config, reader, args.interval_s, args.rounds))
    except KeyboardInterrupt:
        return 0
    return 0
