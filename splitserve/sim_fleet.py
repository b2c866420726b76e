"""`splitserve sim-fleet`: many simulated prefill and decode services in one process.

Each is a whole service: its own PrefillService/DecodeService, sim engine thread, HTTP server on its own
port, KV receiver, heartbeat and registry entry; only the interpreter is shared. A service process is
~300 MB of imports (torch, FastAPI, the services), so 64 of them as processes would take ~19 GiB; in one
process each costs its engine's KV pool and bookkeeping (docs/simulation.md, "Scale on one box").
Prefill services listen on --port, --port + 1, ...; decode services on the ports after them. SIGTERM or
Ctrl-C drains every service (deregister, finish what runs) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

from common.config import EngineConfig, ServiceConfig
from splitserve.flags import add_log_flags, env_or, flag


def add_parser(sub: Any) -> None:
    from splitserve.launch import ENGINE_FLAGS, add_config_flag

    f = sub.add_parser(
        "sim-fleet",
        help="run many simulated prefill and decode services in one process (--engine sim)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    flag(f, "--prefill", type=int, default=1, help="simulated prefill services")
    flag(f, "--decode", type=int, default=1, help="simulated decode services")
    flag(f, "--port", type=int, default=9100, help="the first service's port; the others follow it")
    flag(f, "--host", default="127.0.0.1", help="bind address of every service")
    flag(f, "--redis-url", env="SPLITSERVE_REDIS_URL", default=env_or("SPLITSERVE_REDIS_URL"),
         shown_default=None, help="the worker registry the services join")  # fmt: skip
    flag(f, "--kv-backend", default="tcp", choices=["tcp", "nixl", "torch_dist", "auto"],
         help="how prefill services write KV into the decode services")  # fmt: skip
    for name, field in ENGINE_FLAGS.items():
        if field not in ("engine", "tensor_parallel_size", "device", "attention_backend"):
            add_config_flag(f, name, EngineConfig, field, "SPLITSERVE_", f"engine_{field}")
    add_log_flags(f)
    f.set_defaults(func=run)


def configs(args: argparse.Namespace) -> tuple[list[ServiceConfig], EngineConfig]:
    """One ServiceConfig per service (ports from --port, prefill first) and the shared sim EngineConfig."""
    given = {k.removeprefix("engine_"): v for k, v in vars(args).items() if k.startswith("engine_")}
    engine_cfg = EngineConfig(**{k: v for k, v in given.items() if v is not None}, engine="sim")
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    cfgs = [
        ServiceConfig(
            role=role,
            host=args.host,
            port=args.port + i,
            redis_url=args.redis_url,
            kv_backend=args.kv_backend,
            worker_id=f"{role}-sim-{args.host}-{args.port + i}",
        )
        for i, role in enumerate(roles)
    ]
    return cfgs, engine_cfg


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from splitserve.launch import _configure_logging

    if args.prefill < 0 or args.decode < 0 or args.prefill + args.decode < 1:
        print("error: --prefill and --decode: at least one service, none negative", file=sys.stderr)
        return 2
    try:
        cfgs, engine_cfg = configs(args)
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _configure_logging(args, f"sim-fleet-{args.port}")
    try:
        asyncio.run(serve(cfgs, engine_cfg))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


async def serve(cfgs: list[ServiceConfig], engine_cfg: EngineConfig) -> None:
    """Every service's HTTP server in this event loop until a signal; then each drains and stops."""
    import uvicorn

    from common.runtime.http_server import server_config
    from decode_service.app import create_app as decode_app
    from prefill_service.app import create_app as prefill_app

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the fleet handles signals for all of them
            yield

    servers: list[tuple[Any, Server]] = []
    for cfg in cfgs:
        app = (decode_app if cfg.role == "decode" else prefill_app)(cfg, engine_cfg)
        grace = max(1, int(cfg.drain_timeout_s))
        config = server_config(app, cfg.host, cfg.port, log_level="warning", timeout_graceful_shutdown=grace)
        servers.append((app.state.service, Server(config)))

    def stop() -> None:
        for service, server in servers:
            if not server.should_exit:
                asyncio.get_running_loop().create_task(service.drain())
                server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    await asyncio.gather(*(server.serve() for _, server in servers))
