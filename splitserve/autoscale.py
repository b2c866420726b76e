"""`splitserve up --autoscale`: the planner acting on `up`'s own workers, with its reactive law
(planner/policy.py) or, with `--law forecast`, the forecast law (planner/forecast.py, its arrivals log in
`up`'s Redis). Every --autoscale-interval-s it reads the signals (the registry, the router's histograms
and counters), decides, prints the decision with its inputs as one JSON line, and hands `up` the worker
counts to run: `up` starts services to reach them and stops the newest first (SIGTERM: they drain, the
router migrates what they still had)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from planner.main import Forecast, Law, Reactive, config_from_args, forecast_from_args
from planner.signals import SignalReader, describe


class Autoscaler:
    def __init__(self, args: argparse.Namespace, redis_url: str, router_url: str) -> None:
        config = config_from_args(args)
        self.interval_s = args.autoscale_interval_s
        self.loop = asyncio.new_event_loop()  # the reader's Redis client lives on this one loop
        self.reader = SignalReader(redis_url, router_url, args.api_key)
        forecast = forecast_from_args(args, config, reads_router=True)
        state = self.reader.state
        self.law: Law = (
            Reactive(config) if forecast is None else Forecast(forecast, state.redis, state.prefix)
        )
        self.loop.run_until_complete(self.law.start())
        self.next_at = time.monotonic() + self.interval_s

    def tick(self) -> dict[str, int] | None:
        """The worker counts to run, when a decision is due; else None."""
        now = time.monotonic()
        if now < self.next_at:
            return None
        self.next_at = now + self.interval_s
        signals = self.loop.run_until_complete(self.reader.read())
        d = self.loop.run_until_complete(self.law.step(signals, time.monotonic()))
        line = {**d.as_log(), "signals": describe(signals)}
        print(f"  autoscale: {json.dumps(line, sort_keys=True)}", flush=True)
        return {"prefill": d.prefill, "decode": d.decode}
