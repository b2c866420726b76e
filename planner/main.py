"""`splitserve planner`: read the signals every --interval-s, decide (--law: reactive, planner/policy.py, or
forecast, planner/forecast.py), hand the decision to the actuator, log it with its inputs and what the
actuator reports (one JSON line). Actuators: the dry run (says what it
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

from planner.forecast import CapacityTable, ForecastConfig, ForecastPlanner, RateLog, RedisRateLog
from planner.policy import Decision, Planner, PlannerConfig, Signals
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


class Law(Protocol):
    async def start(self) -> None: ...
    async def step(self, signals: Signals | None, now: float) -> Decision: ...


class Reactive:
    """The reactive law (planner/policy.py)."""

    def __init__(self, config: PlannerConfig) -> None:
        self.planner = Planner(config)

    async def start(self) -> None:
        return None

    async def step(self, signals: Signals | None, now: float) -> Decision:
        return self.planner.step(signals, now)


class Forecast:
    """The forecast law (planner/forecast.py), its rate log kept in Redis: read at the start (a restarted
    planner keeps yesterday), each read's minutes written after each decision. The log's clock is the
    wall clock (a day from 00:00 UTC)."""

    def __init__(self, law: ForecastPlanner, redis: Any, prefix: str) -> None:
        self.law = law
        self.store = RedisRateLog(redis, prefix, law.log)
        self._unsaved: set[tuple[int, int]] = set()

    async def start(self) -> None:
        try:
            minutes = await self.store.load(time.time())
            log.info("forecast law: %d minutes of arrivals read from Redis", minutes)
        except Exception as e:  # noqa: BLE001 - without it the law forecasts nothing yet: it says so
            log.warning(
                "forecast law: the arrivals log could not be read (%s): no forecast until it is recorded", e
            )

    async def step(self, signals: Signals | None, now: float) -> Decision:
        d = self.law.step(signals, now, time.time())
        self._unsaved.update(self.law.touched)
        if self._unsaved:
            try:
                await self.store.save(self._unsaved)
                self._unsaved.clear()
            except Exception as e:  # noqa: BLE001 - kept in memory and written with the next decision's
                log.warning("forecast law: the arrivals log could not be written (%s): retried next time", e)
        return d


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
    law: Law | None = None,
) -> Decision:
    law, actuator = law or Reactive(config), actuator or DryRun()
    decision: Decision | None = None
    done = 0
    try:
        await law.start()
        await actuator.start()
        while rounds is None or done < rounds:
            signals = await reader.read()
            decision = await law.step(signals, time.monotonic())
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


def forecast_from_args(
    args: argparse.Namespace, config: PlannerConfig, reads_router: bool
) -> ForecastPlanner | None:
    """The forecast law from --law forecast and its settings (None: the reactive law); ValueError says
    what is missing or wrong. `reads_router`: whether a router's arrivals counter is read (--router-url
    or --discover-routers), which it records."""
    law = getattr(args, "law", None) or "reactive"
    if law == "reactive":
        return None
    if law != "forecast":  # from SPLITSERVE_PLANNER_LAW, which argparse does not check
        raise ValueError(f"--law / SPLITSERVE_PLANNER_LAW: reactive or forecast, not {law}")
    if not args.capacity_table:
        raise ValueError(
            "--law forecast needs --capacity-table FILE: the workers each request rate needs (a profiling "
            "run measures it; `splitserve bench planner --planner-capacity-out FILE` writes the simulated "
            "fleet's)"
        )
    if not reads_router:
        raise ValueError(
            "--law forecast needs --router-url or --discover-routers: the routers' arrivals counter is "
            "what it records"
        )
    table = CapacityTable.load(args.capacity_table)
    fc = ForecastConfig(lead_s=args.forecast_lead_s)
    return ForecastPlanner(config, table, RateLog(args.forecast_period_s), fc)


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
    discover = bool(getattr(args, "discover_routers", False))
    try:
        config = config_from_args(args)
        actuator = actuator_from_args(args, config)
        forecast = forecast_from_args(args, config, bool(args.router_url) or discover)
        reader = SignalReader(  # refuses --router-url with --discover-routers
            args.redis_url, args.router_url, args.api_key, discover=discover,
            check_hostname=getattr(args, "router_tls_check_hostname", True),
        )  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    law = None if forecast is None else Forecast(forecast, reader.state.redis, reader.state.prefix)
    try:
        asyncio.run(run(config, reader, args.interval_s, args.rounds, actuator, law))
    except KeyboardInterrupt:
        return 0
    return 0
