"""`splitserve up`'s wait for a service's /health (splitserve/launch.py `_wait_healthy`): a port that
something else answers on, not over HTTP, is said to be taken (what tests/support/up.py retries on fresh
ports), not a traceback; a process that exits first is said to have exited."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from splitserve.launch import StartupFailed, _wait_healthy


def test_a_port_answered_by_something_else_is_taken() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo_once() -> None:  # answers a request with its own first line, as a line-echo server would
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(4096).split(b"\r\n")[0] + b"\r\n\r\n")

    thread = threading.Thread(target=echo_once, daemon=True)
    thread.start()
    # a process that runs until its stdin closes
    waiting = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with pytest.raises(StartupFailed, match=r"decode-0: http://127.0.0.1:\d+ is taken \("):
            _wait_healthy("decode-0", f"http://127.0.0.1:{port}", waiting, 20.0)
    finally:
        assert waiting.stdin is not None
        waiting.stdin.close()
        waiting.wait(10)
        server.close()
        thread.join(5)


def test_a_process_that_exits_first_has_exited() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait()
    with pytest.raises(StartupFailed, match="exited with code 3"):
        _wait_healthy("prefill-0", "http://127.0.0.1:9", gone, 20.0)
