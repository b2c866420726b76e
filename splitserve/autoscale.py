"""`splitserve up --autoscale`: the planner (planner/policy.py) acting on `up`'s own workers. Every
--autoscale-interval-s it reads the signals (the registry, the router's histograms), decides, prints the
decision with its inputs as one JSON line, and hands `up` the worker counts to run: `up` starts services
to reach them and stops the newest first (SIGTERM: they drain, the router migrates what they still had)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from planner.main import config_from_args
from planner.policy import Planner
from planner.signals import SignalReader, describe


class Autoscaler:
    def __init__(self, args: argparse.Namespace, redis_url: str, router_url: str) -> None:
        self.planner = Planner(config_from_args(args))
        self.interval_s = args.autoscale_interval_s
        self.loop = asyncio.new_event_loop()  # the reader's Redis client lives on this one loop
        self.reader = SignalReader(redis_url, router_url, args.api_key)
        self.next_at = time.monotonic() + self.interval_s

    def tick(self) -> dict[str, int] | None:
        """The worker counts to run, when a decision is due; else None."""
        now = time.monotonic()
        if now < self.next_at:
            return None
        self.next_at = now + self.interval_s
        signals = self.loop.run_until_complete(self.reader.read())
        d = self.planner.step(signals, time.monotonic())
        line = {**d.as_log(), "signals": describe(signals)}
        print(f"  autoscale: {json.dumps(line, sort_keys=True)}", flush=True)
        return {"prefill": d.prefill, "decode": d.decode}
