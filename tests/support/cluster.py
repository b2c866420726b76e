"""Real service processes on 127.0.0.1 for integration tests: start, wait healthy, stop (no orphans)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from bench.serving import NOT_UP, exited, on_fresh_ports
from common.cluster.state import ClusterState
from common.security.internal_auth import SignedCalls
from common.security.secret import InternalSecret

# The cluster secret of every test (tests/conftest.py puts it in the environment): calls a test makes to
# a service's /internal/ API itself sign with `internal_auth` (httpx `auth=`), as the router does.
INTERNAL_SECRET = "splitserve-tests-internal-secret-3f9a"
internal_auth = SignedCalls(InternalSecret(INTERNAL_SECRET.encode()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str) -> Any:
    # https: the tests' self-signed certificates (tests/integration/test_tls.py checks verification itself)
    ctx = ssl._create_unverified_context() if url.startswith("https:") else None
    with urllib.request.urlopen(url, timeout=5, context=ctx) as r:
        return json.loads(r.read())


@dataclass
class Proc:
    role: str
    url: str
    popen: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


@dataclass
class Cluster:
    redis_url: str | None
    log_dir: str
    # what every process it starts serves; None: the test environment's (the tiny model, tests/conftest.py)
    model: str | None = None
    procs: list[Proc] = field(default_factory=list)

    def start(
        self,
        role: str,
        *flags: str,
        timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
        port: int | None = None,
        module: str = "splitserve",
    ) -> Proc:
        """Start a service process and wait until it is healthy; `env` adds to its environment. Another
        `module` runs as `python -m <module> --port P <flags>` (`role` names its log; no Redis flag).
        A port picked here that another process takes before the child binds it (two test workers, and
        everything else on the machine, pick ports at once) is picked again, up to PORT_TRIES times."""
        return on_fresh_ports(
            lambda: self._start(role, flags, timeout_s, env, port or free_port(), module), given=bool(port)
        )

    def _start(
        self,
        role: str,
        flags: tuple[str, ...],
        timeout_s: float,
        env: dict[str, str] | None,
        port: int,
        module: str,
    ) -> Proc:
        program = [role] if module == "splitserve" else []
        cmd = [sys.executable, "-m", module, *program, "--port", str(port), *flags]
        if self.redis_url and module == "splitserve":
            cmd += ["--redis-url", self.redis_url]
        log_path = f"{self.log_dir}/{role}-{port}.log"
        log = open(log_path, "w")  # noqa: SIM115 - lives as long as the process
        # NIXL: loopback
        model = {"SPLITSERVE_MODEL": self.model, "SPLITSERVE_ROUTER_MODEL": self.model} if self.model else {}
        full_env = {
            **os.environ,
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
            **model,
            **(env or {}),
        }
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        scheme = "https" if "--ssl-certfile" in flags else "http"
        proc = Proc(role, f"{scheme}://127.0.0.1:{port}", popen, log_path)
        self.procs.append(proc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                self.procs.remove(proc)
                raise exited(role, proc.popen.returncode, proc.log_tail())
            try:
                get_json(proc.url + "/health")
                return proc
            except NOT_UP:  # refused, or a check connected to itself (bench/serving.py)
                time.sleep(0.3)
        raise RuntimeError(f"{role} not healthy after {timeout_s} s:\n{proc.log_tail()}")

    def stop(self, proc: Proc | None = None) -> None:
        for p in [proc] if proc else list(self.procs):
            if p.popen.poll() is None:
                p.popen.terminate()
                try:
                    p.popen.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()
            self.procs.remove(p)

    def wait_routed(self, timeout_s: float = 15.0) -> None:
        """Wait until each of this cluster's routers routes on (at least) as many decode and prefill
        services as the cluster runs: a router reads the registry at most every 0.25 s, and a service
        is registered before its /health answers."""
        running = [p for p in self.procs if p.popen.poll() is None]
        decode, prefill = (sum(p.role == r for p in running) for r in ("decode", "prefill"))
        for router in (p for p in running if p.role == "router"):
            wait_router_sees(router, decode=decode, prefill=prefill, timeout_s=timeout_s)

    def wait_blocks_free(self, proc: Proc, timeout_s: float = 10.0) -> dict[str, Any]:
        """Poll /health until every KV block is free again; returns the last health record."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = get_json(proc.url + "/health")
            if h["free_blocks"] == h["total_blocks"] and h["running"] == 0 and h["waiting"] == 0:
                return h
            if time.monotonic() > deadline:
                return h
            time.sleep(0.1)


def wait_router_sees(router: Proc, decode: int = 1, prefill: int = 0, timeout_s: float = 15.0) -> None:
    """Wait until the router's worker pool (its /health) holds at least this many services of each role."""

    def sees() -> bool:
        try:
            h = get_json(router.url + "/health")
        except OSError:  # 503 while it cannot route at all
            return False
        return bool(h["decode_workers"] >= decode and h["prefill_workers"] >= prefill)

    wait_until(sees, timeout_s, f"the router to see {decode} decode and {prefill} prefill services")


def wait_until(cond: Any, timeout_s: float, what: str) -> None:
    """Poll cond() every 50 ms; AssertionError naming `what` past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def leases_left(redis_url: str) -> int:
    """Transfer leases still in Redis (0 once every transfer let go of its blocks)."""

    async def count() -> int:
        state = ClusterState.from_url(redis_url)
        try:
            return await state.leases.count()
        finally:
            await state.close()

    return asyncio.run(count())
