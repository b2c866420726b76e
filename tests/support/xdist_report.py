"""A pytest plugin (tests/conftest.py loads it): what a pytest-xdist worker that goes down says.

A worker's stdout is /dev/null (execnet keeps the real one for its channel) and its stderr is captured
while a test runs, so a worker that dies mid-test says nothing by itself. The controller reports only
"node down: Not properly terminated". Three things make it say more:

- **A test past its timeout.** pytest-timeout's "thread" method writes its report (the captured output
  and every thread's stack) to the terminal, which in a worker is that /dev/null, then ends the process
  with os._exit(1). In a worker this plugin takes over the timer. At the timeout it writes the test's
  name, its captured output and log (the last lines), and every thread's stack to the worker's own
  stderr, then exits the same way. A backstop, faulthandler's watchdog, prints the stacks and exits
  30 s later should the timer thread never get the GIL.
- **A signal.** A worker prints every thread's stack on SIGTERM, SIGHUP or SIGINT, then goes on as it
  would have.
- **How the process ended.** The controller says whether it exited (the status; 1 is pytest-timeout's),
  was killed (the signal) or still runs (its channel to pytest broke).

Three workers went down silently in full runs, each in the KV-index tests; the one whose end was
recorded had exited with status 1. That was pytest-timeout: a stop() that never returned (what caused
it: common/runtime/tasks.py). tests/unit/test_xdist_report.py shows what such a timeout prints now.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

TAIL_LINES = 200  # of each of the test's captured stdout, stderr and log
BACKSTOP_S = 30.0  # after the timeout: faulthandler's watchdog, if the timer thread got no GIL

_stderr_fd: int | None = None  # a worker's own stderr, as it was before output capture


def pytest_configure(config: pytest.Config) -> None:
    global _stderr_fd
    if not os.environ.get("PYTEST_XDIST_WORKER") or sys.__stderr__ is None:
        return
    # a copy of stderr as it is now, before output capture replaces fd 2 (as pytest's own faulthandler
    # does); kept open for the process's life
    _stderr_fd = os.dup(sys.__stderr__.fileno())
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        faulthandler.register(sig, file=_stderr_fd, all_threads=True, chain=True)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's thread method with its report on the worker's stderr (see the module doc);
    anything else (not a worker, another method) is pytest-timeout's own."""
    if _stderr_fd is None or settings.method != "thread":
        return None
    timeout = float(settings.timeout)
    timer = threading.Timer(timeout, _timed_out, (item, timeout))
    timer.name = f"timeout {item.nodeid}"
    timer.daemon = True
    faulthandler.dump_traceback_later(timeout + BACKSTOP_S, exit=True, file=_stderr_fd)

    def cancel() -> None:
        timer.cancel()
        timer.join()
        faulthandler.cancel_dump_traceback_later()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # what pytest-timeout's cancel hook calls
    timer.start()
    return True


def _tail(text: str) -> str:
    lines = text.splitlines()
    cut = len(lines) - TAIL_LINES
    return "\n".join(([f"[... {cut} earlier lines]"] if cut > 0 else []) + lines[-TAIL_LINES:])


def _timed_out(item: pytest.Item, timeout: float) -> None:
    assert _stderr_fd is not None
    fd = _stderr_fd
    sections: list[tuple[str, str]] = []
    try:
        capman = item.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.suspend_global_capture(in_=True)
            out, err = capman.read_global_capture()
            sections += [("captured stdout", out), ("captured stderr", err)]
        logging_plugin = item.config.pluginmanager.getplugin("logging-plugin")
        handler = getattr(logging_plugin, "report_handler", None)
        if handler is not None:
            sections.append(("captured log", handler.stream.getvalue()))
    except Exception as e:  # the report goes out without them
        sections.append(("reading the captured output failed", repr(e)))
    text = f"\n{'+' * 20} Timeout: {item.nodeid} ran past {timeout:g} s; this worker ends {'+' * 20}\n"
    for title, body in sections:
        if body.strip():
            text += f"{'~' * 20} {title} {'~' * 20}\n{_tail(body)}\n"
    text += f"{'~' * 20} every thread's stack (the timer's own included) {'~' * 20}\n"
    os.write(fd, text.encode(errors="replace"))
    faulthandler.dump_traceback(file=fd, all_threads=True)
    os.write(fd, f"{'+' * 20} Timeout {'+' * 20}\n".encode())
    os._exit(1)  # as pytest-timeout does: the test may be stuck where nothing else can stop it


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    if not error:
        return
    popen = getattr(getattr(getattr(node, "gateway", None), "_io", None), "popen", None)
    if popen is None:
        return
    try:
        rc = popen.wait(timeout=5)
    except subprocess.TimeoutExpired:
        rc = None
    if rc is None:
        how = "still running 5 s later: its channel to pytest broke"
    elif rc < 0:
        how = f"killed by signal {-rc}" + (
            f" ({signal.Signals(-rc).name})" if -rc in signal.valid_signals() else ""
        )
    else:
        how = f"exited with status {rc}"
        if rc == 1:
            how += " (how pytest-timeout ends a worker: look for 'Timeout' above)"
    sys.stderr.write(f"pytest-xdist worker (pid {popen.pid}) went down: {how}\n")
