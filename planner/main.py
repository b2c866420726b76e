"""`splitserve planner`: read the signals every --interval-s, decide, hand the decision to the actuator,
log it with its inputs and what the actuator reports (one JSON line). Actuators: the dry run (says what it
would do) and Kubernetes (planner/kube.py: the Deployments' replicas); `splitserve up --autoscale`
(splitserve/autoscale.py) acts on `up`'s own workers."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any, Protocol

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


class Actuator(Protocol):
    async def start(self) -> None: ...
    async def apply(self, d: Decision) -> dict[str, Any]: ...  # what it did, for the decision log
    async def close(self) -> None: ...


class DryRun:
    """Says what it would do; changes nothing."""

    def __init__(self) -> None:
        self.applied: tuple[int, int] | None = None

    async def start(self) -> None:
        return None

    async def apply(self, d: Decision) -> dict[str, Any]:
        if (d.prefill, d.decode) != self.applied:
            log.info("dry run: would run %d prefill and %d decode workers", d.prefill, d.decode)
            self.applied = (d.prefill, d.decode)
        return {}

    async def close(self) -> None:
        return None


async def run(
    config: PlannerConfig,
    reader: SignalReader,
    interval_s: float,
    rounds: int | None,
    actuator: Actuator | None = None,
) -> Decision:
    planner, actuator = Planner(config), actuator or DryRun()
    decision: Decision | None = None
    done = 0
    try:
        await actuator.start()
        while rounds is None or done < rounds:
            signals = await reader.read()
            decision = planner.step(signals, time.monotonic())
            actuated = await actuator.apply(decision)
            line: dict[str, Any] = {**decision.as_log(), "signals": describe(signals)}
            if actuated:
                line["actuator"] = actuated
            print(json.dumps(line, sort_keys=True), flush=True)  # the decision log: stdout, one line each
            done += 1
            if rounds is None or done < rounds:
                await asyncio.sleep(interval_s)
    finally:
        await reader.close()
        await actuator.close()
    assert decision is not None
    return decision


def actuator_from_args(args: argparse.Namespace, config: PlannerConfig) -> Actuator:
    """The --actuator chosen; ValueError names a missing setting."""
    if args.actuator == "dry-run":
        return DryRun()
    if args.actuator != "kubernetes":  # from SPLITSERVE_PLANNER_ACTUATOR, which argparse does not check
        raise ValueError(
            f"--actuator / SPLITSERVE_PLANNER_ACTUATOR: dry-run or kubernetes, not {args.actuator}"
        )
    from planner.kube import KubeActuator, KubeTarget

    target = KubeTarget.from_args(args.namespace, args.prefill_deployment, args.decode_deployment,
                                  args.kube_api, args.kube_token_file, args.kube_ca_file)  # fmt: skip
    return KubeActuator(target, {"prefill": config.min_prefill, "decode": config.min_decode})


def main(args: argparse.Namespace) -> int:
    from common.runtime.logs import configure_logging

    configure_logging(args.log_level, args.log_format, process="planner")
    if not args.redis_url:
        print("error: --redis-url / SPLITSERVE_REDIS_URL: where the worker registry is", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        actuator = actuator_from_args(args, config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reader = SignalReader(args.redis_url, args.router_url, args.api_key)
    try:
        asyncio.run(run(config, reader, args.interval_s, args.rounds, actuator))
    except KeyboardInterrupt:
        return 0
    return 0
