"""`splitserve up --autoscale`: the planner (planner/policy.py) acting on `up`'s own workers. Every
--autoscale-interval-s it reads the signals (the registry, the router's histograms), decides, prints the
decision with its inputs as one JSON line, and hands `up` the worker counts to run: `up` starts services
to reach them and stops the newest first (SIGTERM: they drain, the router migrates what they still had)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from planner.policy import Planner, PlannerConfig
from planner.signals import SignalReader, describe


class Autoscaler:
    def __init__(self, args: argparse.Namespace, redis_url: str, router_url: str) -> None:
        self.planner = Planner(
            PlannerConfig(
                ttft_target_s=args.ttft_target_s,
                tpot_target_s=args.tpot_target_s,
                min_prefill=args.min_prefill,
                max_prefill=args.max_prefill,
                min_decode=args.min_decode,
                max_decode=args.max_decode,
                budget=args.budget,
                cooldown_s=args.autoscale_cooldown_s,
                down_stable_s=args.autoscale_down_after_s,
                window_s=args.autoscale_window_s,
            )
        )
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
