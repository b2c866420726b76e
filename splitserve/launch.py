"""Starting services: one per process (`splitserve prefill|decode|router`), or a whole local
deployment (`splitserve up`): embedded Redis, N prefill, M decode and the router, each its own process."""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.config import EngineConfig, ServiceConfig

INT_FIELDS = {
    "block_size",
    "kv_cache_memory_mb",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_threads",
    "fair_quantum_tokens",
    "fair_bulk_prefill_tokens",
    "tensor_parallel_size",
}
ENGINE_FLAGS = {  # flag -> EngineConfig field
    "--model": "model",
    "--device": "device",
    "--dtype": "dtype",
    "--attention-backend": "attention_backend",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--block-size": "block_size",
    "--kv-cache-mb": "kv_cache_memory_mb",
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--policy": "policy",
    "--preemption-mode": "preemption_mode",
    "--tenant-weights": "tenant_weights",
    "--fair-quantum-tokens": "fair_quantum_tokens",
    "--fair-bulk-prefill-tokens": "fair_bulk_prefill_tokens",
    "--fair-burst-s": "fair_burst_s",
    "--threads": "num_threads",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--kv-cache-dtype": "kv_cache_dtype",
}


def parse_tenant_weights(text: str) -> dict[str, float]:
    """--tenant-weights "a=3,b=1" -> {"a": 3.0, "b": 1.0}: positive weights; a tenant not named weighs 1
    ("=2" names the tenant of requests that name none)."""
    weights: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not (math.isfinite(weight) and weight > 0) or name in weights:
            raise argparse.ArgumentTypeError(
                f"expected tenant=weight[,tenant=weight...] with positive weights, each tenant once; "
                f"got {text!r}"
            )
        weights[name] = weight
    return weights


def _tenant_weights_text(text: str) -> str:
    """`up`: check --tenant-weights here, pass it on to the services as given."""
    parse_tenant_weights(text)
    return text


def add_service_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help=f"default: $SPLITSERVE_PORT, else {default_port}")
    p.set_defaults(role_port=default_port)
    p.add_argument(
        "--advertise-host",
        default=None,
        help="address registered for other services to reach this one (default: --host)",
    )
    p.add_argument("--worker-id", default=None)
    p.add_argument("--redis-url", default=None, help="Redis for the registry and request records")
    p.add_argument("--kv-port", type=int, default=None, help="decode: KV receiver port (default: any free)")
    p.add_argument("--ssl-certfile", default=None, help="serve the internal API over HTTPS (PEM chain)")
    p.add_argument("--ssl-keyfile", default=None, help="the private key of --ssl-certfile")
    p.add_argument("--max-queue", type=int, default=None)
    p.add_argument("--lease-s", type=float, default=None, help="transfer-ledger lease TTL (default 5 s)")
    p.add_argument(
        "--kv-backend",
        choices=["auto", "nixl", "tcp", "torch_dist"],
        default=None,
        help="decode: how prefill services write KV here (default auto: nixl where it imports)",
    )
    for flag, field in ENGINE_FLAGS.items():
        kind: Callable[[str], Any] = str
        if field in INT_FIELDS:
            kind = int
        elif field in ("gpu_memory_utilization", "fair_burst_s"):
            kind = float
        elif field == "tenant_weights":
            kind = parse_tenant_weights
        p.add_argument(flag, dest=f"engine_{field}", type=kind, default=None)


def _given(args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    return {
        k.removeprefix(prefix): v for k, v in vars(args).items() if k.startswith(prefix) and v is not None
    }


def service_configs(args: argparse.Namespace) -> tuple[ServiceConfig, EngineConfig]:
    """The service and engine configs of `splitserve prefill|decode`: flags, then SPLITSERVE_* env,
    then defaults (the port's default depends on the role)."""
    from common.config import EngineConfig, ServiceConfig

    svc_fields = {
        k: v
        for k, v in _given(args).items()
        if k
        in {
            "host",
            "advertise_host",
            "port",
            "worker_id",
            "redis_url",
            "kv_port",
            "max_queue",
            "kv_backend",
            "lease_s",
            "ssl_certfile",
            "ssl_keyfile",
        }
    }
    if "port" not in svc_fields and not os.environ.get("SPLITSERVE_PORT"):
        svc_fields["port"] = args.role_port  # the role's own port (8101 prefill, 8201 decode)
    return ServiceConfig(role=args.command, **svc_fields), EngineConfig(**_given(args, "engine_"))


def run_service(args: argparse.Namespace) -> int:
    """`splitserve prefill|decode`: one service in this process (flags override SPLITSERVE_* env).

    SIGTERM (or Ctrl-C) drains it: it leaves the registry and refuses new work at once, the server
    waits up to drain_timeout_s for the requests in progress, ends the rest (a router migrates those)
    and the process exits 0."""
    import asyncio

    import uvicorn

    from common.runtime.http_server import server_config
    from common.security.secret import InternalSecret, SecretError

    cfg, engine_cfg = service_configs(args)
    try:  # before loading the model: a service others can reach must check who calls it
        InternalSecret.from_env().require_for_bind(cfg.host, f"the {cfg.role} service")
    except SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "decode":
        from decode_service.app import create_app
    else:
        from prefill_service.app import create_app
    app = create_app(cfg, engine_cfg)
    service = app.state.service

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                asyncio.get_running_loop().create_task(service.drain())
            super().handle_exit(sig, frame)

    grace = max(1, math.ceil(cfg.drain_timeout_s))
    config = server_config(
        app,
        cfg.host,
        cfg.port,
        ssl_certfile=cfg.ssl_certfile,
        ssl_keyfile=cfg.ssl_keyfile,
        log_level="warning",
        timeout_graceful_shutdown=grace,
    )
    # uvicorn raises the signal again once it stopped; a drained service then exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    DrainingServer(config).run()
    return 0


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url}: not healthy after {timeout_s:.0f} s")


DRAIN_WAIT_S = 45.0  # `up` waits this long for its services to drain (their default drain_timeout_s: 30)
BACKOFF_S = (1.0, 30.0)  # a service that exits is started again after 1 s, doubling up to 30 s
STABLE_S = 60.0  # ... and the wait starts over once it ran this long


def supervise(procs: list[subprocess.Popen], commands: list[list[str]]) -> None:
    """Start every service that exits again, after a backoff that doubles while it keeps exiting;
    returns only when interrupted (KeyboardInterrupt: Ctrl-C, or SIGTERM in `up`)."""
    wait = [BACKOFF_S[0]] * len(procs)
    started = [time.monotonic()] * len(procs)
    while True:
        time.sleep(0.5)
        for i, p in enumerate(procs):
            if p.poll() is None:
                continue
            now = time.monotonic()
            if now - started[i] > STABLE_S:
                wait[i] = BACKOFF_S[0]
            name = " ".join(commands[i][3:5])
            print(f"{name} exited with {p.returncode}; starting it again in {wait[i]:.0f} s", file=sys.stderr)
            time.sleep(wait[i])
            procs[i] = subprocess.Popen(commands[i])
            started[i], wait[i] = time.monotonic(), min(2 * wait[i], BACKOFF_S[1])


def up(args: argparse.Namespace) -> int:
    """`splitserve up`: everything on this machine; a service that exits is started again (with
    backoff); Ctrl-C or SIGTERM drains and stops them all."""
    from common.cluster.redis_server import RedisServer
    from common.security.secret import ensure_for_children

    ensure_for_children()  # one internal secret for this deployment's processes, unless one is given
    redis = None
    redis_url = args.redis_url
    if redis_url is None:
        redis = RedisServer()
        redis.start()
        redis_url = redis.url
    procs: list[subprocess.Popen] = []
    commands: list[list[str]] = []
    me = [sys.executable, "-m", "splitserve"]
    engine_flags = [
        x
        for f, field in ENGINE_FLAGS.items()
        if (v := getattr(args, f"engine_{field}")) is not None
        for x in (f, str(v))
    ]
    threads = ["--threads", str(args.threads_per_service)] if args.threads_per_service else []
    if args.kv_backend:
        threads += ["--kv-backend", args.kv_backend]

    def stop(*_: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()  # the services drain (up to their drain_timeout_s) and exit 0
        deadline = time.monotonic() + DRAIN_WAIT_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        if redis is not None:
            redis.stop()

    def on_sigterm(*_: Any) -> None:
        raise KeyboardInterrupt  # one shutdown path for Ctrl-C and SIGTERM

    signal.signal(signal.SIGTERM, on_sigterm)
    # Ctrl-C even when started with SIGINT ignored (a background job of a non-interactive shell
    # inherits that, and Python then leaves it ignored): `kill -INT` must stop `up` either way
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        port = args.base_port
        services = [("prefill", i) for i in range(args.prefill)] + [("decode", i) for i in range(args.decode)]
        for role, i in services:
            port += 1
            cmd = [
                *me,
                role,
                "--port",
                str(port),
                "--redis-url",
                redis_url,
                "--worker-id",
                f"{role}-{i}",
                *engine_flags,
                *threads,
            ]
            commands.append(cmd)
            procs.append(subprocess.Popen(cmd, start_new_session=False))
            print(f"  {role}-{i}: http://127.0.0.1:{port}", flush=True)
        for (role, i), p in zip(services, procs, strict=True):
            _wait_healthy(f"http://127.0.0.1:{args.base_port + 1 + services.index((role, i))}", p)
        router_cmd = [*me, "router", "--host", args.host, "--port", str(args.port), "--redis-url", redis_url]
        # The router tokenizes for the model the services load: their flag, else their environment's
        # SPLITSERVE_MODEL (the router reads SPLITSERVE_ROUTER_MODEL, which a user setting only the
        # first would leave at the default: another tokenizer than the services', silently).
        served = args.engine_model or os.environ.get("SPLITSERVE_MODEL")
        if served:
            router_cmd += ["--model", served]
        commands.append(router_cmd)
        procs.append(subprocess.Popen(router_cmd))
        url = f"http://{args.host}:{args.port}"
        _wait_healthy(url, procs[-1])
        print(
            f"\nsplitserve is up: {url}  (redis {redis_url})\n\ntry:\n  curl {url}/v1/chat/completions "
            '-H \'content-type: application/json\' \\\n    -d \'{"model": "default", "temperature": 0, '
            '"messages": [{"role": "user", "content": "What is the capital of France?"}]}\'\n',
            flush=True,
        )
        supervise(procs, commands)
        return 0
    except KeyboardInterrupt:
        print("\nshutting down", file=sys.stderr)
        return 0
    finally:
        stop()


def run_router(args: argparse.Namespace) -> int:
    """`splitserve router`: the OpenAI-compatible front door (flags override SPLITSERVE_ROUTER_* env)."""
    from router.app import serve
    from router.config import RouterConfig

    given = {
        k: v
        for k, v in vars(args).items()
        if v is not None
        and k
        in {
            "host",
            "port",
            "redis_url",
            "model",
            "local_prefill_threshold",
            "routing",
            "prefix_weight",
            "load_weight",
            "decode_urls",
            "prefill_urls",
            "transfer_failure_policy",
            "max_migrations",
            "decode_stall_s",
            "max_decode_queue",
            "start_timeout_s",
            "require_api_key",
            "api_keys_file",
            "allow_unauthenticated",
            "ssl_certfile",
            "ssl_keyfile",
            "internal_ca_file",
            "max_body_bytes",
            "log_content",
        }
    }
    from common.security.secret import SecretError

    try:
        serve(RouterConfig(**given))
    except (SecretError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def add_parsers(sub: Any) -> None:
    r = sub.add_parser("router", help="run the router (OpenAI API)")
    r.add_argument("--host", default=None)
    r.add_argument("--port", type=int, default=None)
    r.add_argument("--redis-url", default=None, help="worker registry and request records")
    r.add_argument("--model", default=None, help="the model the services serve (for its tokenizer)")
    r.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=None,
        help="prompts shorter than this many tokens are prefilled on the decode service",
    )
    r.add_argument(
        "--routing",
        choices=["prefix_aware", "least_loaded"],
        default=None,
        help="prefix_aware (default): weigh the prompt blocks each service holds against its load; "
        "least_loaded: load alone",
    )
    r.add_argument(
        "--prefix-weight",
        type=float,
        default=None,
        help="prefix_aware: cost of a prompt block to compute (1)",
    )
    r.add_argument(
        "--load-weight",
        type=float,
        default=None,
        help="prefix_aware: cost of a queued prompt block or a running sequence (1)",
    )
    r.add_argument(
        "--transfer-failure-policy",
        choices=["retry", "recompute", "fail"],
        default=None,
        help="when a prefill or its KV transfer fails (default retry on another prefill service)",
    )
    r.add_argument(
        "--max-migrations", type=int, default=None, help="moves to another decode service per request (3)"
    )
    r.add_argument(
        "--decode-stall-s", type=float, default=None, help="seconds of silence that fail a decode stream (15)"
    )
    r.add_argument(
        "--max-decode-queue", type=int, default=None, help="503 once every decode has this many waiting"
    )
    r.add_argument(
        "--start-timeout-s",
        type=float,
        default=None,
        help="503 for a request that cannot get its first token this soon (default: no limit)",
    )
    r.add_argument(
        "--require-api-key",
        action="store_true",
        default=None,
        help="every call but /health needs an API key, even before one exists (splitserve keys create)",
    )
    r.add_argument("--api-keys-file", default=None, help="static API keys, one per line (docs/security.md)")
    r.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="serve without API keys on an address other machines can reach",
    )
    r.add_argument("--ssl-certfile", default=None, help="serve HTTPS: certificate chain (PEM)")
    r.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: private key")
    r.add_argument("--internal-ca-file", default=None, help="CA bundle for the services' HTTPS")
    r.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (8 MiB)")
    r.add_argument(
        "--log-content",
        action="store_true",
        default=None,
        help="put prompts and completions in spans (off: they are the users' data)",
    )
    r.add_argument("--decode-urls", default=None, help="comma-separated; instead of the registry")
    r.add_argument("--prefill-urls", default=None, help="comma-separated; instead of the registry")
    r.set_defaults(func=run_router)
    for role, port in (("prefill", 8101), ("decode", 8201)):
        p = sub.add_parser(role, help=f"run one {role} service")
        add_service_flags(p, port)
        p.set_defaults(func=run_service)
    u = sub.add_parser("up", help="run Redis, prefill, decode and the router on this machine")
    u.add_argument("--prefill", type=int, default=1, help="number of prefill services")
    u.add_argument("--decode", type=int, default=1, help="number of decode services")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8000, help="router port")
    u.add_argument("--base-port", type=int, default=8100, help="services listen on base+1, base+2, ...")
    u.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
    u.add_argument("--threads-per-service", type=int, default=None)
    u.add_argument("--kv-backend", choices=["auto", "nixl", "tcp", "torch_dist"], default=None)
    for flag, field in ENGINE_FLAGS.items():
        if flag != "--threads":
            check = _tenant_weights_text if field == "tenant_weights" else str
            u.add_argument(flag, dest=f"engine_{field}", type=check, default=None)
    u.set_defaults(func=up, engine_num_threads=None)
