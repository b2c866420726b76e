"""tests/support/xdist_report.py: a pytest-xdist worker whose test runs past its timeout says so, with
the test's name, its captured output and every thread's stack, on the run's stderr (pytest-timeout's own
report goes to a worker's /dev/null). Runs pytest on a throwaway test file, with this plugin alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run in a worker
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.support.xdist_report"]
    cmd += ["-c", os.devnull, "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "basetemp")]
    cmd += ["-o", "timeout_method=thread", *args]  # --basetemp: the outer run's temp dirs are not rotated
    return subprocess.run(
        cmd + ["test_hangs.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


HANGS = """
    import logging
    import sys
    import threading
    import pytest

    def wait_for_ever_in_a_named_function():
        threading.Event().wait()

    @pytest.mark.timeout(30)
    def test_quick():  # runs first: a test within its timeout is untouched
        pass

    @pytest.mark.timeout(2)
    def test_hangs():
        print("said on stdout before hanging")
        print("said on stderr", file=sys.stderr)
        logging.getLogger("t").warning("logged before hanging")
        wait_for_ever_in_a_named_function()
"""


def test_a_worker_past_its_timeout_names_the_test_and_prints_its_output_and_stacks(tmp_path: Path) -> None:
    proc = _run_pytest(tmp_path, HANGS, "-n", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed, 1 passed" in out, out
    assert "Timeout: test_hangs.py::test_hangs ran past 2 s; this worker ends" in out, out
    for said in ("said on stdout before hanging", "said on stderr", "logged before hanging"):
        assert said in out, (said, out)
    assert "wait_for_ever_in_a_named_function" in out, out  # the stuck thread's stack
    assert "went down: exited with status 1 (how pytest-timeout ends a worker" in out, out


def test_without_xdist_pytest_timeout_reports_as_before(tmp_path: Path) -> None:
    """Outside a worker the plugin leaves the timer to pytest-timeout (its report reaches the terminal)."""
    proc = _run_pytest(tmp_path, HANGS, "-v")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "test_quick PASSED" in out, out
    assert "Timeout" in out and "wait_for_ever_in_a_named_function" in out, out
    assert "this worker ends" not in out, out
