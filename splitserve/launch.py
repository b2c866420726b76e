"""Starting services: one per process (`splitserve prefill|decode|router`), or a whole local
deployment (`splitserve up`): embedded Redis, N prefill, M decode and the router, each its own process.

Every flag has help text, the environment variable that sets the same thing, and its default
(`splitserve config --markdown` prints them all: docs/configuration.md). A bad flag, a bad variable
or a model that is not there is one line naming it, never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError

from common.config import EngineConfig, ServiceConfig
from router.config import RouterConfig
from splitserve.flags import add_law_flags, add_log_flags, config_errors, env_or, field_help, flag
from splitserve.placement import PlacementError, parse_devices, plan, spread, visible_gpus

if TYPE_CHECKING:
    from common.cluster.redis_server import RedisServer

ENGINE_FLAGS = {  # flag -> EngineConfig field (SPLITSERVE_<FIELD>)
    "--model": "model",
    "--device": "device",
    "--dtype": "dtype",
    "--attention-backend": "attention_backend",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--block-size": "block_size",
    "--kv-cache-mb": "kv_cache_memory_mb",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--kv-exact-prefill": "kv_exact_prefill",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--kv-offload-ram-gb": "kv_offload_ram_gb",
    "--kv-offload-disk-dir": "kv_offload_disk_dir",
    "--kv-offload-disk-gb": "kv_offload_disk_gb",
    "--kv-offload-load": "kv_offload_load",
    "--kv-offload-prefetch-wait-s": "kv_offload_prefetch_wait_s",
    "--kv-offload-disk-reads": "kv_offload_disk_reads",
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--max-model-len": "max_model_len",
    "--policy": "policy",
    "--preemption-mode": "preemption_mode",
    "--tenant-weights": "tenant_weights",
    "--fair-quantum-tokens": "fair_quantum_tokens",
    "--fair-bulk-prefill-tokens": "fair_bulk_prefill_tokens",
    "--fair-burst-s": "fair_burst_s",
    "--threads": "num_threads",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--engine": "engine",
    "--sim-profile": "sim_profile",
    "--sim-kv-block-bytes": "sim_kv_block_bytes",
    "--sim-seed": "sim_seed",
    "--sim-output-len": "sim_output_len",
}
SERVICE_FLAGS = {  # flag -> ServiceConfig field (SPLITSERVE_<FIELD>); decode-only ones in DECODE_FLAGS
    "--host": "host",
    "--port": "port",
    "--advertise-host": "advertise_host",
    "--worker-id": "worker_id",
    "--redis-url": "redis_url",
    "--served-model-name": "served_model_name",
    "--kv-backend": "kv_backend",
    "--max-queue": "max_queue",
    "--lease-s": "lease_s",
    "--drain-timeout-s": "drain_timeout_s",
    "--ssl-certfile": "ssl_certfile",
    "--ssl-keyfile": "ssl_keyfile",
}
DECODE_FLAGS = {"--kv-port": "kv_port"}
ROUTER_FLAGS = {  # flag -> RouterConfig field (SPLITSERVE_ROUTER_<FIELD>)
    "--host": "host",
    "--port": "port",
    "--advertise-host": "advertise_host",
    "--redis-url": "redis_url",
    "--model": "model",
    "--served-model-name": "served_model_name",
    "--chat-template": "chat_template",
    "--tool-call-parser": "tool_call_parser",
    "--max-model-len": "max_model_len",
    "--api-key": "api_key",
    "--api-keys-file": "api_keys_file",
    "--require-api-key": "require_api_key",
    "--allow-unauthenticated": "allow_unauthenticated",
    "--local-prefill-threshold": "local_prefill_threshold",
    "--routing": "routing",
    "--prefix-weight": "prefix_weight",
    "--load-weight": "load_weight",
    "--transfer-failure-policy": "transfer_failure_policy",
    "--max-migrations": "max_migrations",
    "--decode-stall-s": "decode_stall_s",
    "--max-decode-queue": "max_decode_queue",
    "--start-timeout-s": "start_timeout_s",
    "--request-timeout-s": "request_timeout_s",
    "--default-max-tokens": "default_max_tokens",
    "--slo-ttft-ms": "slo_ttft_ms",
    "--slo-tpot-ms": "slo_tpot_ms",
    "--max-body-bytes": "max_body_bytes",
    "--max-connections": "max_connections",
    "--log-content": "log_content",
    "--ssl-certfile": "ssl_certfile",
    "--ssl-keyfile": "ssl_keyfile",
    "--internal-ca-file": "internal_ca_file",
    "--decode-urls": "decode_urls",
    "--prefill-urls": "prefill_urls",
}
# `up` passes these on to the router as well as the services (the router tokenizes for the services'
# model, answers under its name and checks lengths against its context)
SHARED_WITH_ROUTER = ("--model", "--served-model-name", "--max-model-len")
# given once per served model (router, up): `--model A --model B --served-model-name a --served-model-name b`
REPEATED_FLAGS = ("--model", "--served-model-name", "--tool-call-parser")
REPEATED_HELP = " (up, router: once per model, several models in the same order)"


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


def add_config_flag(
    p: argparse.ArgumentParser,
    name: str,
    model: type[Any],
    field: str,
    env_prefix: str,
    dest: str,
    default: Any = None,
    repeat: bool = False,
) -> None:
    """A flag that sets one settings field: its type, choices, help and default come from the field
    (`default`: the one shown, where the command decides it). `repeat`: given once per value (a list)."""
    help_text, field_default = field_help(model, field)
    default = field_default if default is None else default
    annotation = model.model_fields[field].annotation
    kwargs: dict[str, Any] = {"dest": dest, "help": help_text, "shown_default": default}
    choices, kind = _literal_args(annotation), _base_type(annotation)
    if repeat:
        kwargs.update(action="append", metavar=name.removeprefix("--").upper().replace("-", "_"))
        kwargs["help"] = help_text + REPEATED_HELP
    elif field == "tenant_weights":
        kwargs["type"] = parse_tenant_weights
    elif choices:
        kwargs["choices"] = choices
    elif kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
    elif kind in (int, float):
        kwargs["type"] = kind
    elif kind is list:
        kwargs["help"] += " (comma-separated)"
    flag(p, name, env=f"{env_prefix}{field.upper()}", **kwargs)


def _literal_args(annotation: Any) -> list[str]:
    if get_origin(annotation) is Literal:
        return [str(a) for a in get_args(annotation)]
    for a in get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ():
        if get_origin(a) is Literal:
            return [str(x) for x in get_args(a)]
    return []


def _base_type(annotation: Any) -> Any:
    """int for `int | None`, list for `Annotated[list[str], ...]`, ..."""
    if get_origin(annotation) in (Union, UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return get_origin(annotation) or annotation


def add_service_flags(p: argparse.ArgumentParser, role: str, default_port: int) -> None:
    flags = {**SERVICE_FLAGS, **(DECODE_FLAGS if role == "decode" else {})}
    for name, field in flags.items():  # the port's default depends on the role
        shown = default_port if field == "port" else None
        add_config_flag(p, name, ServiceConfig, field, "SPLITSERVE_", field, shown)
    p.set_defaults(role_port=default_port)
    for name, field in ENGINE_FLAGS.items():
        add_config_flag(p, name, EngineConfig, field, "SPLITSERVE_", f"engine_{field}")
    add_log_flags(p)


def _given(args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    return {
        k.removeprefix(prefix): v for k, v in vars(args).items() if k.startswith(prefix) and v is not None
    }


class ConfigError(Exception):
    """A bad flag or variable, already worded as the lines to print."""


def service_configs(args: argparse.Namespace) -> tuple[ServiceConfig, EngineConfig]:
    """The service and engine configs of `splitserve prefill|decode`: flags, then SPLITSERVE_* env,
    then defaults (the port's default depends on the role). ConfigError: one line per bad value."""
    fields = set(SERVICE_FLAGS.values()) | set(DECODE_FLAGS.values())
    svc_fields = {k: v for k, v in _given(args).items() if k in fields}
    if "port" not in svc_fields and not os.environ.get("SPLITSERVE_PORT"):
        svc_fields["port"] = args.role_port  # the role's own port (8101 prefill, 8201 decode)
    try:
        return ServiceConfig(role=args.command, **svc_fields), engine_config(args)
    except ValidationError as e:
        names = {v: k for k, v in {**SERVICE_FLAGS, **DECODE_FLAGS}.items()}
        raise ConfigError(config_errors(e, names, "SPLITSERVE_")) from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    try:
        return EngineConfig(**_given(args, "engine_"))
    except ValidationError as e:
        names = {v: k for k, v in ENGINE_FLAGS.items()}
        raise ConfigError(config_errors(e, names, "SPLITSERVE_")) from None


def check_model(model: str | None) -> None:
    """A model that is neither a path nor a hub id in the local Hugging Face cache stops a command
    before anything starts (one line)."""
    from common.text.model_info import ModelNotFoundError, resolve_model

    if model is None:
        return
    try:
        resolve_model(model)
    except ModelNotFoundError as e:
        raise ConfigError(f"error: --model / SPLITSERVE_MODEL: {e}") from None


def _configure_logging(args: argparse.Namespace, process: str) -> None:
    from common.runtime.logs import configure_logging

    configure_logging(args.log_level, args.log_format, process=process)


def run_service(args: argparse.Namespace) -> int:
    """`splitserve prefill|decode`: one service in this process (flags override SPLITSERVE_* env).

    SIGTERM (or Ctrl-C) drains it: it leaves the registry and refuses new work at once, the server
    waits up to drain_timeout_s for the requests in progress, ends the rest (a router migrates those)
    and the process exits 0."""
    import asyncio

    from common.security.secret import InternalSecret, SecretError

    try:
        cfg, engine_cfg = service_configs(args)
        check_model(engine_cfg.model)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    _configure_logging(args, cfg.worker_name)
    from kv_transfer import resolve_backend

    try:  # before loading the model: a service others can reach must check who calls it
        InternalSecret.from_env().require_for_bind(cfg.host, f"the {cfg.role} service")
        resolve_backend(cfg.kv_backend)  # a transfer library that is not there: say so before the model loads
    except (SecretError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from common.runtime.http_server import server_config
    from splitserve.roles import RoleHost  # every service can switch role (POST /internal/role)

    try:
        app = RoleHost(cfg, engine_cfg)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:  # the model cannot be served
        print(f"error: {cfg.worker_name}: {e}", file=sys.stderr)
        return 2

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                asyncio.get_running_loop().create_task(app.drain())
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


class StartupFailed(Exception):
    """A process of `up` exited or timed out before it was healthy (its own output says why)."""


def _wait_healthy(
    name: str, url: str, proc: subprocess.Popen, timeout_s: float, start: float | None = None
) -> float:
    """Seconds from `start` (the process's start) until url/health answers 200; StartupFailed if the
    process exits or time runs out."""
    start = time.monotonic() if start is None else start
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise StartupFailed(
                f"{name} exited with code {proc.returncode} before it was ready (its output is above)"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.3)
        except http.client.HTTPException as e:  # an answer, but not HTTP: another process has the port
            raise StartupFailed(
                f"{name}: {url} is taken (something that is not a splitserve service answers there: "
                f"{type(e).__name__}); another process took the port after `up` found it free"
            ) from e
    raise StartupFailed(f"{name} was not ready after {timeout_s:.0f} s (--startup-timeout)")


DRAIN_WAIT_S = 45.0  # `up` waits this long for its services to drain (their default drain_timeout_s: 30)
BACKOFF_S = (1.0, 30.0)  # a service that exits is started again after 1 s, doubling up to 30 s
STABLE_S = 60.0  # ... and the wait starts over once it ran this long


@dataclass
class Child:
    """One process `up` runs and restarts."""

    name: str  # "prefill-0", "router"
    role: str
    cmd: list[str]
    env: dict[str, str] | None
    proc: subprocess.Popen
    started: float = dataclasses.field(default_factory=time.monotonic)
    wait: float = BACKOFF_S[0]
    url: str = ""  # a service's address ("" for Redis-less children)


def supervise(children: list[Child], tick: Callable[[], None] | None = None) -> None:
    """Start every child that exits again, after a backoff that doubles while it keeps exiting; `tick`
    runs every half second (the autoscaler may add and remove children). Returns only when interrupted
    (KeyboardInterrupt: Ctrl-C, or SIGTERM in `up`)."""
    while True:
        time.sleep(0.5)
        if tick is not None:
            tick()
        for c in list(children):
            if c.proc.poll() is None:
                continue
            if time.monotonic() - c.started > STABLE_S:
                c.wait = BACKOFF_S[0]
            print(
                f"{c.name} exited with {c.proc.returncode}; starting it again in {c.wait:.0f} s",
                file=sys.stderr,
            )
            time.sleep(c.wait)
            c.proc = subprocess.Popen(c.cmd, env=c.env)
            c.started, c.wait = time.monotonic(), min(2 * c.wait, BACKOFF_S[1])


def role_moves(children: list[Child], wanted: dict[str, int]) -> list[tuple[Child, str]]:
    """The services that change role in place for `wanted` (role -> count): when one role is to grow
    and the other to shrink, min(growth, shrinkage) of the shrinking role's newest, to the other."""
    have = {role: [c for c in children if c.role == role] for role in ("prefill", "decode")}
    for grow, shrink in (("prefill", "decode"), ("decode", "prefill")):
        n = min(wanted[grow] - len(have[grow]), len(have[shrink]) - wanted[shrink])
        if n > 0:
            return [(c, grow) for c in have[shrink][::-1][:n]]
    return []


def switch_role(c: Child, role: str, role_at: int, timeout_s: float = 180.0) -> None:
    """Ask service `c` to become `role` without a restart (POST /internal/role, signed with the
    deployment's secret); `up` counts it in its new role at once, and a restart runs it as that role.
    The call drains what runs (up to the service's drain timeout), so it goes on a thread; if the switch
    is refused or fails, the process is stopped and `supervise` starts it again in its new role."""
    import threading

    import httpx

    from common.security.internal_auth import SignedCalls
    from common.security.secret import InternalSecret

    old = c.role
    c.role, c.cmd = role, [*c.cmd[:role_at], role, *c.cmd[role_at + 1 :]]
    print(f"  {c.name}: switching {old} -> {role} (autoscale)", flush=True)

    def call() -> None:
        why = ""
        try:
            auth = SignedCalls(InternalSecret.from_env())
            r = httpx.post(c.url + "/internal/role", json={"role": role}, auth=auth, timeout=timeout_s)
            if r.status_code not in (200, 202):
                why = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}"
        if why:
            print(f"  {c.name}: the switch failed ({why}); restarting it as {role}", flush=True)
            c.proc.terminate()
        else:
            print(f"  {c.name}: now {role}", flush=True)

    threading.Thread(target=call, name=f"switch-{c.name}", daemon=True).start()


def _up_plan(args: argparse.Namespace, models: int = 1) -> list[dict[str, str]]:
    """Each service's own environment additions (every model's prefill services, then every model's
    decode services): CUDA_VISIBLE_DEVICES, and its share of the GPU memory when services share a
    device. PlacementError for an impossible plan."""
    n = models * (args.prefill + args.decode)
    tp = args.engine_tensor_parallel_size or EngineConfig().tensor_parallel_size
    devices = args.devices
    if devices is None and args.prefill_devices is None and args.decode_devices is None:
        gpus = visible_gpus()
        if gpus is None:  # no GPU: nothing to place
            return [{} for _ in range(n)]
        devices = spread(gpus, n, tp)
    placed = plan(
        models * args.prefill, models * args.decode, tp, devices, args.prefill_devices, args.decode_devices
    )
    assert placed is not None
    util = args.engine_gpu_memory_utilization or EngineConfig().gpu_memory_utilization
    out = []
    for p in placed:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(p.devices)}
        if p.share > 1 and args.engine_gpu_memory_utilization is None:
            env["SPLITSERVE_GPU_MEMORY_UTILIZATION"] = f"{util / p.share:.4f}"
        out.append(env)
    return out


def up(args: argparse.Namespace) -> int:
    """`splitserve up`: everything on this machine; a service that exits is started again (with
    backoff); Ctrl-C or SIGTERM drains and stops them all. Several `--model`s: each gets its own
    --prefill and --decode services, and the router serves them all."""
    try:
        models, names = _up_models(args)
        for m in models:  # every service would refuse a bad value: say it once, here
            check_model(engine_config(argparse.Namespace(**{**vars(args), "engine_model": m})).model)
        placement = _up_plan(args, len(models))
        if args.api_key is not None:
            from router.auth.keys import api_key_entry

            api_key_entry(args.api_key)
        if args.chat_template is not None:
            from common.text.model_info import read_chat_template

            read_chat_template(args.chat_template)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except (PlacementError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _configure_logging(args, "up")
    from common.security.secret import ensure_for_children

    ensure_for_children()  # one internal secret for this deployment's processes, unless one is given
    for name, value in (("SPLITSERVE_LOG_LEVEL", args.log_level), ("SPLITSERVE_LOG_FORMAT", args.log_format)):
        if value is not None:  # every child logs the same way
            os.environ[name] = value
    redis: RedisServer | None = None
    redis_url = args.redis_url
    children: list[Child] = []
    retiring: list[Child] = []  # stopped by the autoscaler, still draining
    me = [sys.executable, "-m", "splitserve"]
    engine_flags = [
        x
        for f, field_name in ENGINE_FLAGS.items()
        if (v := getattr(args, f"engine_{field_name}")) is not None
        and field_name not in ("enable_prefix_caching", "model")  # the model: per service
        for x in (f, str(v) if not isinstance(v, dict) else args.tenant_weights_text)
    ]
    if args.engine_enable_prefix_caching is not None:
        engine_flags.append(
            "--enable-prefix-caching" if args.engine_enable_prefix_caching else "--no-enable-prefix-caching"
        )
    extra = ["--threads", str(args.threads_per_service)] if args.threads_per_service else []
    if args.kv_backend:
        extra += ["--kv-backend", args.kv_backend]

    def stop(*_: Any) -> None:
        everyone = [c.proc for c in children + retiring]
        for p in everyone:
            if p.poll() is None:
                p.terminate()  # the services drain (up to their drain_timeout_s) and exit 0
        deadline = time.monotonic() + DRAIN_WAIT_S
        for p in everyone:
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
    ports = iter(range(args.base_port + 1, 65536))
    index = {"prefill": 0, "decode": 0}

    def start_service(role: str, place: dict[str, str], redis_url: str, m: int = 0) -> tuple[Child, str]:
        """A `role` service of the m-th model."""
        port, i = next(ports), index[role]
        index[role] += 1
        cmd = [*me, role, "--port", str(port), "--worker-id", f"{role}-{i}"]
        cmd += [*engine_flags, *extra]
        model = models[m]
        cmd += ["--model", model] if model is not None else []
        cmd += ["--served-model-name", names[m]] if names else []
        # the Redis URL through the environment: it carries the password, a flag would show in `ps`
        env = {**os.environ, **place, "SPLITSERVE_REDIS_URL": redis_url}
        url = f"http://127.0.0.1:{port}"
        child = Child(f"{role}-{i}", role, cmd, env, subprocess.Popen(cmd, env=env), url=url)
        where = f" on GPU {place['CUDA_VISIBLE_DEVICES']}" if place else ""
        print(f"  {child.name}: starting at {url}{where}", flush=True)
        return child, url

    try:
        # every model's prefill services, then every model's decode services (the order _up_plan places)
        roles = [(role, k) for role in ("prefill", "decode") for k in range(len(models))
                 for _ in range(getattr(args, role))]  # fmt: skip
        _check_free(args.host, args.port, "--port")
        for k in range(len(roles)):  # an old stack still draining there would answer our health checks
            _check_free("127.0.0.1", args.base_port + 1 + k, "--base-port")
        if redis_url is None:
            redis = _start_redis(args.redis_data)
            redis_url = redis.url
            kept = f"kept in {args.redis_data}" if args.redis_data else "not kept: --redis-data DIR keeps it"
            print(f"  redis: {_masked(redis_url)}, password generated ({kept})", flush=True)
        urls = []
        for (role, k), place in zip(roles, placement, strict=True):
            child, url = start_service(role, place, redis_url, k)
            children.append(child)
            urls.append(url)
        for child, url in zip(list(children), urls, strict=True):
            took = _wait_healthy(child.name, url, child.proc, args.startup_timeout, child.started)
            print(f"  {child.name}: ready at {url} ({took:.1f} s)", flush=True)
        router_cmd = [*me, "router", "--host", args.host, "--port", str(args.port)]
        # The router tokenizes for the models the services load: their flags, else their environment's
        # SPLITSERVE_MODEL (the router reads SPLITSERVE_ROUTER_MODEL, which a user setting only the
        # first would leave at the default: another tokenizer than the services', silently).
        for served in models:
            served = served or os.environ.get("SPLITSERVE_MODEL")
            router_cmd += ["--model", served] if served else []
        for name in names:
            router_cmd += ["--served-model-name", name]
        if args.engine_max_model_len:
            router_cmd += ["--max-model-len", str(args.engine_max_model_len)]
        if args.chat_template:
            router_cmd += ["--chat-template", args.chat_template]
        for parser in args.tool_call_parser or []:
            router_cmd += ["--tool-call-parser", parser]
        # secrets through the environment: a flag would show in the process list
        router_env = {**os.environ, "SPLITSERVE_ROUTER_REDIS_URL": redis_url}
        if args.api_key is not None:
            router_env["SPLITSERVE_ROUTER_API_KEY"] = args.api_key
        router = Child(
            "router", "router", router_cmd, router_env, subprocess.Popen(router_cmd, env=router_env)
        )
        children.append(router)
        url = f"http://{args.host}:{args.port}"
        took = _wait_healthy("router", url, router.proc, args.startup_timeout)
        print(f"  router: ready at {url} ({took:.1f} s)", flush=True)
        auth = ' -H "Authorization: Bearer $SPLITSERVE_API_KEY"' if args.api_key is not None else ""
        print(
            f"\nsplitserve is up: {url}  (redis {redis_url})\n\ntry:\n  curl {url}/v1/chat/completions{auth} "
            '-H \'content-type: application/json\' \\\n    -d \'{"model": "default", "temperature": 0, '
            '"messages": [{"role": "user", "content": "What is the capital of France?"}]}\'\n',
            flush=True,
        )
        tick = None
        if args.autoscale:
            from splitserve.autoscale import Autoscaler

            scaler = Autoscaler(args, redis_url, f"http://127.0.0.1:{args.port}")
            assert redis_url is not None

            def tick() -> None:
                wanted = scaler.tick()
                if wanted is None:
                    return
                # one role up and the other down in the same decision (the budget binds): the newest
                # services of the role that shrinks change role in place (POST /internal/role) instead of
                # one draining away while a new one loads the model
                for c, new in role_moves(children, wanted):
                    switch_role(c, new, len(me))
                for role in ("prefill", "decode"):
                    mine = [c for c in children if c.role == role]
                    for _ in range(wanted[role] - len(mine)):
                        child, _url = start_service(role, {}, redis_url)
                        children.append(child)
                    for c in mine[wanted[role] :][::-1]:  # the newest first; it drains, then exits
                        print(f"  {c.name}: stopping (autoscale)", flush=True)
                        children.remove(c)
                        retiring.append(c)
                        c.proc.terminate()

        supervise(children, tick)
        return 0
    except StartupFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nshutting down", file=sys.stderr)
        return 0
    finally:
        stop()


def _up_models(args: argparse.Namespace) -> tuple[list[str | None], list[str]]:
    """`up`'s models (None: the services' SPLITSERVE_MODEL, else the default) and their served names
    (none given: each model's id, as the router and the services both default to). ConfigError for
    names that do not pair up with the models, or two models that would be served under one name."""
    models: list[str | None] = list(args.engine_model or [None])
    names: list[str] = list(args.served_model_name or [])
    if names and len(names) != len(models):
        raise ConfigError(
            f"error: --served-model-name: {len(names)} names for {len(models)} models: give one per --model, "
            "in the same order"
        )
    named = [str(n) for n in names or models]
    twice = sorted({str(n) for n in named if named.count(n) > 1})
    if twice:
        raise ConfigError(
            f"error: --model / --served-model-name: two models would be served as {', '.join(twice)}: give "
            "each --model its own --served-model-name"
        )
    return models, names


def _check_free(host: str, port: int, flag_name: str) -> None:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no owner
        try:
            s.bind((host, port))
        except OSError as e:
            raise StartupFailed(
                f"port {port} on {host} is taken ({e.strerror}): choose another {flag_name}"
            ) from None


def _start_redis(data_dir: str | None) -> RedisServer:
    from common.cluster.redis_server import RedisServer

    # a password of its own: any local user can reach 127.0.0.1, and this Redis holds the API keys and
    # the worker registry (docs/security.md)
    redis = RedisServer(data_dir=data_dir, password=secrets.token_urlsafe(24))
    redis.start()
    return redis


def _masked(url: str) -> str:
    """A redis:// URL with its password replaced, for logs."""
    return re.sub(r"^(rediss?://[^:/@]*:)[^@]*@", r"\1***@", url)


def run_router(args: argparse.Namespace) -> int:
    """`splitserve router`: the OpenAI-compatible front door (flags override SPLITSERVE_ROUTER_* env)."""
    from common.security.secret import SecretError
    from router.app import serve

    fields = set(ROUTER_FLAGS.values())
    try:
        config = RouterConfig(**{k: v for k, v in _given(args).items() if k in fields})
    except ValidationError as e:
        print(
            config_errors(e, {v: k for k, v in ROUTER_FLAGS.items()}, "SPLITSERVE_ROUTER_"), file=sys.stderr
        )
        return 2
    try:
        for model in config.model:
            check_model(model)
    except ConfigError as e:
        print(str(e).replace("SPLITSERVE_MODEL", "SPLITSERVE_ROUTER_MODEL"), file=sys.stderr)
        return 2
    _configure_logging(args, "router")
    try:
        serve(config)
    except (SecretError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def add_parsers(sub: Any) -> None:
    r = sub.add_parser(
        "router", help="run the router (OpenAI API)", description="The OpenAI-compatible router."
    )
    for name, field in ROUTER_FLAGS.items():
        add_config_flag(
            r, name, RouterConfig, field, "SPLITSERVE_ROUTER_", field, repeat=name in REPEATED_FLAGS
        )
    add_log_flags(r)
    r.set_defaults(func=run_router)
    for role, port in (("prefill", 8101), ("decode", 8201)):
        p = sub.add_parser(role, help=f"run one {role} service", description=f"One {role} service.")
        add_service_flags(p, role, port)
        p.set_defaults(func=run_service)
    add_up_parser(sub)
    from splitserve import sim_calibrate, sim_fleet

    sim_fleet.add_parser(sub)
    sim_calibrate.add_parser(sub)


def add_up_parser(sub: Any) -> None:
    u = sub.add_parser(
        "up",
        help="run Redis, prefill, decode and the router on this machine",
        description="Redis, prefill and decode services and the router on this machine, each its own "
        "process; a service that exits is started again; Ctrl-C drains and stops them all. Engine flags "
        "go to every service.",
    )

    def from_env(name: str, env: str, kind: Any, fallback: Any, help_text: str) -> None:
        """An `up` flag whose variable `up` reads itself (no settings class does)."""
        value = env_or(env, kind)
        flag(u, name, env=env, type=kind, default=fallback if value is None else value,
             shown_default=fallback, help=help_text)  # fmt: skip

    from_env("--prefill", "SPLITSERVE_UP_PREFILL", int, 1, "number of prefill services")
    from_env("--decode", "SPLITSERVE_UP_DECODE", int, 1, "number of decode services")
    from_env("--host", "SPLITSERVE_ROUTER_HOST", str, "127.0.0.1", "the router's bind address")
    from_env("--port", "SPLITSERVE_ROUTER_PORT", int, 8000, "the router's port")
    flag(u, "--base-port", type=int, default=8100, help="services listen on base+1, base+2, ...")
    flag(u, "--redis-url", help="use this Redis instead of an embedded one")
    from_env(
        "--redis-data",
        "SPLITSERVE_REDIS_DATA",
        str,
        None,
        "the embedded Redis keeps its data (API keys, limits, usage) in this folder (append-only file, "
        "fsync every second): keys survive a restart; default: nothing kept",
    )
    from_env(
        "--startup-timeout",
        "SPLITSERVE_STARTUP_TIMEOUT",
        float,
        600.0,
        "seconds each process gets to become healthy (a large model loads for minutes)",
    )
    from_env(
        "--devices",
        "SPLITSERVE_DEVICES",
        _devices,
        None,
        "GPUs for the services, comma-separated: each service takes --tensor-parallel-size consecutive "
        "ones, prefill services first (default: every visible GPU, spread; none on a machine without one)",
    )
    flag(u, "--prefill-devices", type=_devices, help="the prefill services' GPUs (instead of --devices)")
    flag(u, "--decode-devices", type=_devices, help="the decode services' GPUs (instead of --devices)")
    flag(u, "--threads-per-service", type=int, help="torch CPU threads per service (--threads)")
    add_config_flag(u, "--kv-backend", ServiceConfig, "kv_backend", "SPLITSERVE_", "kv_backend")
    add_config_flag(u, "--served-model-name", ServiceConfig, "served_model_name", "SPLITSERVE_",
                     "served_model_name", repeat=True)  # fmt: skip
    add_config_flag(
        u, "--chat-template", RouterConfig, "chat_template", "SPLITSERVE_ROUTER_", "chat_template"
    )
    add_config_flag(u, "--tool-call-parser", RouterConfig, "tool_call_parser", "SPLITSERVE_ROUTER_",
                     "tool_call_parser", repeat=True)  # fmt: skip
    add_config_flag(u, "--api-key", RouterConfig, "api_key", "SPLITSERVE_ROUTER_", "api_key")
    for name, field in ENGINE_FLAGS.items():
        if name != "--threads":
            repeat = name in REPEATED_FLAGS
            add_config_flag(u, name, EngineConfig, field, "SPLITSERVE_", f"engine_{field}", repeat=repeat)
    flag(u, "--autoscale", action="store_true",
         help="the planner sets how many prefill and decode services run (docs/operations.md)")  # fmt: skip
    flag(u, "--autoscale-interval-s", type=float, default=10.0, help="--autoscale: seconds between decisions")
    flag(
        u,
        "--autoscale-cooldown-s",
        type=float,
        default=30.0,
        help="--autoscale: seconds between changes of a role",
    )
    flag(u, "--autoscale-down-after-s", type=float, default=120.0,
         help="--autoscale: a role stays this long under target before it loses a service")  # fmt: skip
    flag(u, "--autoscale-window-s", type=float, default=45.0,
         help="--autoscale: a role's pressure is the highest seen over this many seconds")  # fmt: skip
    flag(
        u,
        "--ttft-target-s",
        type=float,
        default=1.0,
        help="--autoscale: p90 time to first token to keep under",
    )
    flag(
        u,
        "--tpot-target-s",
        type=float,
        default=0.05,
        help="--autoscale: p90 time per output token to keep under",
    )
    for role in ("prefill", "decode"):
        flag(u, f"--min-{role}", type=int, default=1, help=f"--autoscale: {role} services at least")
        flag(u, f"--max-{role}", type=int, default=4, help=f"--autoscale: {role} services at most")
    flag(u, "--budget", type=int, default=8, help="--autoscale: prefill + decode services at most")
    add_law_flags(u)
    add_log_flags(u)
    u.set_defaults(func=_up_defaults, engine_num_threads=None)


def _devices(text: str) -> list[str]:
    try:
        return parse_devices(text)
    except PlacementError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _up_defaults(args: argparse.Namespace) -> int:
    if args.prefill < 0 or args.decode < 1:
        print("error: --decode must be at least 1 and --prefill at least 0", file=sys.stderr)
        return 2
    if args.autoscale and (args.devices or args.prefill_devices or args.decode_devices):
        print("error: --autoscale places no GPUs yet: leave out --devices", file=sys.stderr)
        return 2
    if len(args.engine_model or ()) > 1 and (args.autoscale or args.chat_template is not None):
        print("error: --autoscale and --chat-template serve one model: give one --model", file=sys.stderr)
        return 2
    parsers, served = args.tool_call_parser or [], max(1, len(args.engine_model or ()))
    if len(parsers) not in (0, 1, served):
        print(f"error: {len(parsers)} --tool-call-parser for {served} model(s): give one for all, or one per "
              "--model in the same order", file=sys.stderr)  # fmt: skip
        return 2
    try:
        RouterConfig._known_parsers(parsers)  # the router's own check, before anything starts
    except ValueError as e:
        print(f"error: --tool-call-parser: {e}", file=sys.stderr)
        return 2
    if args.autoscale:
        from planner.main import config_from_args, forecast_from_args

        try:  # the planner's settings, checked before anything starts (up runs the router it reads)
            forecast_from_args(args, config_from_args(args), reads_router=True)
        except ValueError as e:
            print(f"error: --autoscale: {e}", file=sys.stderr)
            return 2
    args.tenant_weights_text = (
        ",".join(f"{k}={v}" for k, v in args.engine_tenant_weights.items())
        if args.engine_tenant_weights
        else None
    )
    return up(args)
