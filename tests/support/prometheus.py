"""The real Prometheus and promtool for tests, fetched once into a cache the tests own.

No PyPI wheel carries Prometheus. Debian's `prometheus` package (2.42, with promtool) does: `tools()`
downloads it with `apt-get download` (nothing is installed: no root needed, no dpkg database touched) and
unpacks it with `dpkg -x` into ~/.cache/splitserve/prometheus (or $SPLITSERVE_PROMETHEUS_DIR). When the
machine's package lists do not know the package (a container whose lists were deleted), apt reads fresh
lists into a temporary folder next to the cache instead of the system's. Both binaries are Go programs
that need nothing but libc.

Where apt or the network is missing, `tools()` raises `Unavailable` with the reason and the tests skip.
A prefetched copy works too: put `prometheus` and `promtool` in $SPLITSERVE_PROMETHEUS_DIR (or its
usr/bin/ or bin/)."""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

PACKAGE = "prometheus"
FETCH_TIMEOUT_S = 300


class Unavailable(Exception):
    """Prometheus could not be found nor fetched; str(e) says why (a skip reason)."""


@dataclass(frozen=True)
class Tools:
    prometheus: Path
    promtool: Path
    version: str  # e.g. "2.42.0+ds"


def cache_dir() -> Path:
    if os.environ.get("SPLITSERVE_PROMETHEUS_DIR"):
        return Path(os.environ["SPLITSERVE_PROMETHEUS_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "splitserve" / "prometheus"


def _find(root: Path) -> Tools | None:
    for d in (root / "usr/bin", root / "bin", root):
        prom, tool = d / "prometheus", d / "promtool"
        if prom.is_file() and tool.is_file() and os.access(prom, os.X_OK) and os.access(tool, os.X_OK):
            r = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                first = (r.stdout or r.stderr).split("\n", 1)[0]  # "promtool, version 2.42.0+ds (...)"
                version = first.split("version ", 1)[-1].split(" ", 1)[0]
                return Tools(prom, tool, version)
    return None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One fetch at a time across processes (parallel pytest runs share the cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)


def _download(work: Path) -> Path:
    """Debian's prometheus .deb into `work`, through the system's package lists or, failing that, lists
    apt reads into `work` (no system state changes either way)."""
    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        raise Unavailable("no apt-get/dpkg on this machine to fetch Debian's prometheus package")
    r = _run(["apt-get", "-q", "download", PACKAGE], work)
    if r.returncode != 0:
        own = [
            "-o", f"Dir::State::Lists={work / 'lists'}",
            "-o", f"Dir::Cache={work / 'cache'}",
            "-o", "Debug::NoLocking=1",
        ]  # fmt: skip
        for sub in ("lists/partial", "cache/archives/partial"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        up = _run(["apt-get", "-q", *own, "update"], work)
        r = _run(["apt-get", "-q", *own, "download", PACKAGE], work)
        if r.returncode != 0:
            raise Unavailable(
                f"apt-get download {PACKAGE} failed (no network, or no Debian/Ubuntu repository with it): "
                f"{(r.stderr or up.stderr).strip()[-400:]}"
            )
    debs = sorted(work.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise Unavailable(f"apt-get download {PACKAGE} left no .deb")
    return debs[-1]


@functools.cache
def _tools_or_why() -> Tools | Unavailable:
    try:
        return _fetch()
    except (Unavailable, OSError, subprocess.SubprocessError) as e:
        return e if isinstance(e, Unavailable) else Unavailable(f"fetching Prometheus failed: {e!r}")


def tools() -> Tools:
    """prometheus and promtool, fetched on first use; `Unavailable` if that cannot be done here (the
    answer is kept for the session: a failed fetch is not retried by every test)."""
    got = _tools_or_why()
    if isinstance(got, Unavailable):
        raise got
    return got


def _fetch() -> Tools:
    root = cache_dir()
    found = _find(root)
    if found:
        return found
    with _locked(root.parent / f".{root.name}.lock"):
        found = _find(root)  # another process fetched it meanwhile
        if found:
            return found
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root.parent, prefix=f".{root.name}-fetch-") as tmp:
            work = Path(tmp)
            deb = _download(work)
            unpacked = work / "root"
            r = _run(["dpkg", "-x", str(deb), str(unpacked)], work)
            if r.returncode != 0:
                raise Unavailable(f"dpkg -x {deb.name} failed: {r.stderr.strip()[-400:]}")
            if _find(unpacked) is None:
                raise Unavailable(f"{deb.name} holds no working prometheus and promtool")
            if root.exists():
                shutil.rmtree(root)
            unpacked.rename(root)
        found = _find(root)
        if found is None:
            raise Unavailable(f"{root}: prometheus/promtool do not run")
        return found


class Prometheus:
    """A real Prometheus server on 127.0.0.1 with `config` (prometheus.yml text) in `workdir`, which
    also holds its TSDB and log and any rule files the config names (relative to it)."""

    def __init__(self, binary: Path, workdir: Path, config: str, port: int) -> None:
        self.workdir, self.port = workdir, port
        self.url = f"http://127.0.0.1:{port}"
        (workdir / "prometheus.yml").write_text(config)
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the process
        self.popen = subprocess.Popen(
            [
                str(binary),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            cwd=workdir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.popen.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {timeout_s} s:\n{self.log_tail()}")

    def api(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"/api/v1/{path} {params}: {r.status_code} {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def value(self, expr: str) -> float:
        """The single value of `expr` (one series expected)."""
        result = self.query(expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])

    def wait_scraped_after(self, t: float, timeout_s: float = 30.0) -> None:
        """Until every target's last successful scrape started after Unix time `t`."""
        deadline = time.monotonic() + timeout_s
        while True:
            targets = self.targets()
            fresh = [x for x in targets if x["health"] == "up" and _unix(x["lastScrape"]) > t]
            if targets and len(fresh) == len(targets):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"targets not scraped since {t}: {targets}")
            time.sleep(0.2)

    def wait_evaluated_after(self, t: float, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Until every rule group was evaluated after Unix time `t`; returns the groups."""
        deadline = time.monotonic() + timeout_s
        while True:
            groups = self.api("rules")["groups"]
            if groups and all(_unix(g["lastEvaluation"]) > t for g in groups):
                return list(groups)
            if time.monotonic() > deadline:
                raise AssertionError(f"rules not evaluated since {t}: {groups}")
            time.sleep(0.2)

    def log_tail(self, n: int = 30) -> str:
        self._log.flush()
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-n:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


def _unix(rfc3339: str) -> float:
    """Prometheus' timestamps ("2026-01-01T10:00:00.123456789Z", or "0001-01-01T00:00:00Z" for never)."""
    from datetime import datetime

    text = rfc3339.rstrip("Z")
    whole, _, frac = text.partition(".")
    stamp = datetime.fromisoformat(whole + "+00:00").timestamp()
    return stamp + (float("0." + frac) if frac else 0.0)


# ---- Grafana dashboards ----

# Grafana's own variables, as the test queries substitute them: a rate window that spans the whole test
GRAFANA_VARS = {"__rate_interval": "5m", "__interval": "15s", "__range": "5m"}


def dashboard_targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel, rows' nested panels included."""
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", ""), t["expr"]))

    walk(dashboard.get("panels", []))
    return out


def substitute(expr: str, dashboard: dict[str, Any]) -> str:
    """`expr` with Grafana's variables ($__rate_interval, ...) and the dashboard's template variables
    replaced (an "All"-capable variable by `.*`, others by their current value), as Grafana sends it."""
    values = dict(GRAFANA_VARS)
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "datasource":
            continue
        current = var.get("current", {}).get("value")
        if var.get("includeAll") or current in (None, "$__all", ["$__all"]):
            values[var["name"]] = ".*"
        else:
            values[var["name"]] = current if isinstance(current, str) else "|".join(current)
    for name in sorted(values, key=len, reverse=True):  # $__range before $__r..., $job_id before $job
        v = values[name]
        expr = expr.replace("${" + name + "}", v).replace("[[" + name + "]]", v).replace("$" + name, v)
    if "$" in expr:
        raise AssertionError(f"unknown variable left in {expr!r}")
    return expr
