"""`splitserve up` as a test starts it: on ports found free a moment earlier, and again on fresh ones
when one was taken — refused by `up`'s own check before it starts anything (splitserve/launch.py
`_check_free`), or taken later, before the process meant for it bound it (the router binds its port
only after the services are ready). Without this a port another process took in between failed a test
at random (`--base-port` was once a free port + 100, never checked)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.serving import PortTaken, exited, free_ports, on_fresh_ports
from tests.support.cluster import free_port

PORTS = 16  # service ports after --base-port: more than any test's services, those autoscale adds too
READY = "splitserve is up"  # what up prints once every process it started serves


def start_up(
    args: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """`splitserve up --port P --base-port B <args>` logging (stdout and stderr) to log_path; the process
    and its router port, once up says it is up, or exited for any reason but a taken port (PortTaken
    when a port was taken on every try). Up to READY, not only past up's own port check: another
    process can take the router's port in the seconds the services take to start, before it binds."""

    def once() -> tuple[subprocess.Popen[bytes], int]:
        port, base = free_port(), free_ports(PORTS + 1)
        cmd = [sys.executable, "-m", "splitserve", "up", "--port", str(port), "--base-port", str(base)]
        with open(log_path, "w") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen([*cmd, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                code = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if READY in log_path.read_text():
                    return proc, port
                continue
            error = exited("up", code, log_path.read_text())
            if isinstance(error, PortTaken):
                raise error  # again, on fresh ports
            return proc, port  # exited for another reason: the test says what it expected
        return proc, port  # slow to start: the test's own wait says so

    return on_fresh_ports(once)
