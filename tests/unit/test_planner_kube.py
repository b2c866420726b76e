"""The Kubernetes actuator (planner/kube.py) against a small Kubernetes API of our own: HTTPS on
127.0.0.1 with a certificate made here by openssl, the scale subresource and the Deployment GET only. It
checks the bearer token, the method and the patch content type, applies resourceVersion (409 on a stale
one), answers 403 for a verb its RBAC does not allow, 404 for an unknown Deployment, and can be told to
answer any status or to hang. The actuator reads at start, patches only on change, survives each error
and recovers, re-reads a rotated token, never goes below the floor; `planner.main.run` drives it end to
end."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from planner.kube import KubeActuator, KubeTarget
from planner.main import actuator_from_args, run
from planner.policy import Decision, Planner, PlannerConfig, RoleSignals, Signals
from splitserve.cli import build_parser

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
NS = "serving"
PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+?)(/scale)?$")
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


@dataclass
class FakeKube:
    """The API's state, shared with the handler threads; the test changes it between rounds."""

    token: str
    replicas: dict[str, int]
    version: dict[str, int] = field(default_factory=dict)
    forbid: set[str] = field(default_factory=set)  # verbs RBAC refuses: "get", "patch"
    answer: int | None = None  # every call answers this status
    hang: threading.Event | None = None  # set: every call waits for it
    patches: list[tuple[str, int, str]] = field(default_factory=list)  # (name, replicas, content type)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, dict[str, Any]]:
        if self.hang is not None:
            self.hang.wait(30)
        if headers.get("Authorization") != f"Bearer {self.token}":
            return status(401, "Unauthorized")
        if self.answer is not None:
            return status(self.answer, f"injected {self.answer}")
        m = PATH.match(path)
        if not m:
            return status(404, "the server could not find the requested resource")
        ns, name, scale = m.groups()
        verb = method.lower()
        if verb in self.forbid:
            who = f"system:serviceaccount:{NS}:planner"
            return status(403, f'deployments.apps "{name}" is forbidden: User "{who}" cannot {verb} resource '
                          '"deployments/scale" in API group "apps"')  # fmt: skip
        with self.lock:
            if ns != NS or name not in self.replicas:
                return status(404, f'deployments.apps "{name}" not found')
            if method == "PATCH":
                if not scale:
                    return status(405, "only the scale is patched here")
                kind = headers.get("Content-Type", "")
                if kind not in PATCH_TYPES:
                    return status(415, f"the body of the request was in an unknown format: {kind}")
                patch = json.loads(body)
                version = patch.get("metadata", {}).get("resourceVersion")
                if version is not None and version != str(self.version.get(name, 1)):
                    return status(409, f'Operation cannot be fulfilled on deployments.apps "{name}": '
                                  "the object has been modified")  # fmt: skip
                n = patch["spec"]["replicas"]
                if not isinstance(n, int) or n < 0:
                    return status(422, "spec.replicas: Invalid value")
                self.replicas[name] = n
                self.version[name] = self.version.get(name, 1) + 1
                self.patches.append((name, n, kind))
            elif method != "GET":
                return status(405, "method not allowed")
            n, meta = (
                self.replicas[name],
                {"name": name, "namespace": ns, "resourceVersion": str(self.version.get(name, 1))},
            )
            if scale:
                return 200, {"kind": "Scale", "apiVersion": "autoscaling/v1", "metadata": meta,
                             "spec": {"replicas": n}, "status": {"replicas": n}}  # fmt: skip
            ready = max(0, n - 1)  # one pod still starting, say
            return 200, {"kind": "Deployment", "metadata": meta, "spec": {"replicas": n},
                         "status": {"replicas": n, "readyReplicas": ready}}  # fmt: skip


def status(code: int, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("kube-tls")
    crt, key = d / "ca.crt", d / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kubernetes",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True,
    )  # fmt: skip
    return crt, key


@pytest.fixture
def kube(cert: tuple[Path, Path], tmp_path: Path) -> Iterator[tuple[FakeKube, KubeTarget]]:
    fake = FakeKube(token="token-1", replicas={"llm-prefill": 1, "llm-decode": 2})

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            code, doc = fake.handle(self.command, self.path, self.headers, body)
            data = json.dumps(doc).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (a hang it timed out on)
                pass

        do_GET = do_PATCH = do_PUT = _serve

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    token = tmp_path / "token"
    token.write_text("token-1\n")
    target = KubeTarget(
        api=f"https://127.0.0.1:{server.server_address[1]}",
        token_file=token,
        ca_file=cert[0],
        namespace=NS,
        deployments={"prefill": "llm-prefill", "decode": "llm-decode"},
        timeout_s=1.0,
    )
    try:
        yield fake, target
    finally:
        if fake.hang is not None:
            fake.hang.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def decide(prefill: int, decode: int) -> Decision:
    return Decision(0.0, prefill, decode, "made up for the test", {"made up": True})


FLOORS = {"prefill": 1, "decode": 1}


def test_reads_at_start_and_patches_only_on_change(kube: tuple[FakeKube, KubeTarget]) -> None:
    fake, target = kube

    async def go() -> list[dict[str, Any]]:
        a = KubeActuator(target, FLOORS)
        await a.start()
        assert a.spec == {"prefill": 1, "decode": 2}  # what the Deployments ask for, before any decision
        out = [await a.apply(decide(1, 2)), await a.apply(decide(3, 2)), await a.apply(decide(3, 2))]
        out.append(await a.apply(decide(2, 3)))
        await a.close()
        return out

    same, up, again, moved = asyncio.run(go())
    assert same["prefill"] == {"deployment": "llm-prefill", "wanted": 1, "spec": 1, "replicas": 1, "ready": 0}
    assert up["prefill"]["patched_from"] == 1 and up["prefill"]["spec"] == 3
    assert (up["prefill"]["replicas"], up["prefill"]["ready"]) == (3, 2)  # what runs, for the decision log
    assert "patched_from" not in again["prefill"] and "patched_from" not in again["decode"]
    assert [(n, r) for n, r, _ in fake.patches] == [("llm-prefill", 3), ("llm-prefill", 2), ("llm-decode", 3)]
    assert {kind for _, _, kind in fake.patches} == {"application/merge-patch+json"}
    assert moved["decode"]["spec"] == 3 and fake.replicas == {"llm-prefill": 2, "llm-decode": 3}


@pytest.mark.parametrize("kind", ["403", "404", "409", "500", "timeout"])
def test_survives_each_api_error_logs_it_once_and_recovers(
    kube: tuple[FakeKube, KubeTarget], kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake, target = kube
    target = dataclasses.replace(target, timeout_s=0.3)
    caplog.set_level(logging.INFO, logger="splitserve.planner")

    def fail() -> None:
        if kind == "timeout":
            fake.hang = threading.Event()
        elif kind == "403":
            fake.forbid = {"patch"}  # RBAC without patch: the reads still work
        else:
            fake.answer = int(kind)

    def heal() -> None:
        if fake.hang is not None:
            fake.hang.set()
            fake.hang = None
        fake.forbid, fake.answer = set(), None

    async def go() -> list[dict[str, Any]]:
        a = KubeActuator(target, FLOORS)
        await a.start()
        fail()
        out = [await a.apply(decide(2, 2)) for _ in range(3)]  # three rounds of the same failure
        heal()
        out.append(await a.apply(decide(2, 2)))
        await a.close()
        return out

    *failed, healed = asyncio.run(go())
    for report in failed:
        assert "error" in report["prefill"], report
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = {"timeout": "no answer within", "403": "cannot patch", "404": "injected 404",
                "409": "injected 409", "500": "injected 500"}[kind]  # fmt: skip
    assert any(expected in w for w in warnings), warnings  # the status and the API's own message
    # once per kind: three failed rounds, one warning per failing call, not three
    assert len(warnings) == len(set(warnings)), warnings
    assert healed["prefill"]["spec"] == 2 and fake.replicas["llm-prefill"] == 2  # the next round did it
    assert "error" not in healed["prefill"] and "error" not in healed["decode"]
    assert any("works again" in r.getMessage() for r in caplog.records)


def test_a_stale_resource_version_is_a_409_and_the_next_round_wins(kube: tuple[FakeKube, KubeTarget]) -> None:
    """Someone else changed the Deployment between the actuator's read and its patch."""
    fake, target = kube

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        a = KubeActuator(target, FLOORS)
        real_read = a.read

        async def read_then_someone_scales(role: str) -> tuple[int, str] | None:
            got = await real_read(role)
            if role == "prefill" and not fake.patches:
                with fake.lock:
                    fake.replicas["llm-prefill"] = 5
                    fake.version["llm-prefill"] = 7
            return got

        a.read = read_then_someone_scales  # type: ignore[method-assign]
        first = await a.apply(decide(3, 2))
        second = await a.apply(decide(3, 2))
        await a.close()
        return first, second

    first, second = asyncio.run(go())
    assert first["prefill"]["error"].startswith("409")
    assert second["prefill"]["patched_from"] == 5 and fake.replicas["llm-prefill"] == 3


def test_a_wrong_deployment_name_is_reported_and_never_crashes(
    kube: tuple[FakeKube, KubeTarget], caplog: pytest.LogCaptureFixture
) -> None:
    fake, target = kube
    wrong = KubeTarget(
        target.api, target.token_file, target.ca_file, NS, {"prefill": "nope", "decode": "llm-decode"}
    )

    async def go() -> dict[str, Any]:
        a = KubeActuator(wrong, FLOORS)
        await a.start()
        out = await a.apply(decide(2, 3))
        await a.close()
        return out

    out = asyncio.run(go())
    assert out["prefill"]["error"] == "could not read the scale"
    assert out["decode"]["spec"] == 3  # the other role still acts
    assert any('"nope" not found' in r.getMessage() and "404" in r.getMessage() for r in caplog.records)


def test_a_rotated_token_is_read_again(kube: tuple[FakeKube, KubeTarget]) -> None:
    fake, target = kube

    async def go() -> list[dict[str, Any]]:
        a = KubeActuator(target, FLOORS)
        out = [await a.apply(decide(2, 2))]
        fake.token = "token-2"  # the API now takes only the new token; the file still holds the old one
        out.append(await a.apply(decide(3, 2)))
        target.token_file.write_text("token-2\n")  # the kubelet rotated it
        out.append(await a.apply(decide(3, 2)))
        await a.close()
        return out

    ok, refused, rotated = asyncio.run(go())
    assert ok["prefill"]["spec"] == 2 and "error" in refused["prefill"]
    assert rotated["prefill"]["spec"] == 3 and fake.replicas["llm-prefill"] == 3


def test_never_below_the_floor(kube: tuple[FakeKube, KubeTarget], caplog: pytest.LogCaptureFixture) -> None:
    fake, target = kube

    async def go() -> dict[str, Any]:
        a = KubeActuator(target, {"prefill": 1, "decode": 2})
        out = await a.apply(decide(0, 1))  # below both floors: the policy never says this
        await a.close()
        return out

    out = asyncio.run(go())
    assert (out["prefill"]["wanted"], out["decode"]["wanted"]) == (1, 2)
    assert fake.replicas == {"llm-prefill": 1, "llm-decode": 2} and fake.patches == []
    assert any("below min_" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


def test_a_hold_keeps_what_runs_and_the_floor(kube: tuple[FakeKube, KubeTarget]) -> None:
    """A planner started during a metrics outage holds at the floor (policy.Planner._hold): that must not
    scale a running release down to its minimum; below the floor it still raises."""
    fake, target = kube
    fake.replicas = {"llm-prefill": 4, "llm-decode": 0}
    hold = Planner(PlannerConfig(min_prefill=1, min_decode=1)).step(None, 0.0)
    assert (hold.prefill, hold.decode) == (1, 1)

    async def go() -> dict[str, Any]:
        a = KubeActuator(target, FLOORS)
        out = await a.apply(hold)
        await a.close()
        return out

    out = asyncio.run(go())
    assert (out["prefill"]["wanted"], out["decode"]["wanted"]) == (4, 1)
    assert fake.replicas == {"llm-prefill": 4, "llm-decode": 1}
    assert [(n, r) for n, r, _ in fake.patches] == [("llm-decode", 1)]


class ScriptedSignals:
    """SignalReader's interface with signals made up for the test: as many workers as the fake API's
    Deployments ask for (pods up at once), TTFT 3x its target for `busy` reads, then well under it."""

    def __init__(self, fake: FakeKube, busy: int) -> None:
        self.fake, self.busy, self.reads, self.closed = fake, busy, 0, False

    async def read(self) -> Signals | None:
        self.reads += 1
        ttft = 3.0 if self.reads <= self.busy else 0.1
        p, d = self.fake.replicas["llm-prefill"], self.fake.replicas["llm-decode"]
        return Signals(time.monotonic(), RoleSignals(p, ttft), RoleSignals(d, 0.01, 0, 0.1))

    async def close(self) -> None:
        self.closed = True


def test_a_planner_run_sets_the_deployments(
    kube: tuple[FakeKube, KubeTarget], capsys: pytest.CaptureFixture[str]
) -> None:
    fake, target = kube
    config = PlannerConfig(min_prefill=1, min_decode=2, max_prefill=4, cooldown_s=0)
    reader = ScriptedSignals(fake, busy=2)
    actuator = KubeActuator(target, {"prefill": config.min_prefill, "decode": config.min_decode})
    last = asyncio.run(run(config, reader, 0.0, 3, actuator))  # type: ignore[arg-type]
    assert reader.closed and actuator.client is not None and actuator.client.is_closed
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3
    # 1 -> 2 under 3x TTFT pressure (at most twice per decision), 2 -> 4 (the max), where it stays: the
    # burst is remembered over the window
    assert [line["prefill"] for line in lines] == [2, 4, 4] and last.prefill == 4
    assert fake.replicas == {"llm-prefill": 4, "llm-decode": 2}
    assert [(n, r) for n, r, _ in fake.patches] == [("llm-prefill", 2), ("llm-prefill", 4)]
    for line in lines:  # every decision logged with its inputs and what the Deployments run
        assert line["signals"]["prefill"]["latency_s"] is not None and line["inputs"]
        assert line["actuator"]["prefill"]["replicas"] == line["prefill"]
        assert line["actuator"]["decode"] == {"deployment": "llm-decode", "wanted": 2, "spec": 2,
                                              "replicas": 2, "ready": 1}  # fmt: skip


def test_the_kubernetes_actuator_needs_to_know_where_the_api_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = PlannerConfig()
    args = build_parser().parse_args(["planner", "--actuator", "kubernetes", "--namespace", NS,
                                      "--prefill-deployment", "p", "--decode-deployment", "d"])  # fmt: skip
    with pytest.raises(ValueError, match="--kube-api"):
        actuator_from_args(args, config)
    args = build_parser().parse_args(["planner", "--actuator", "kubernetes", "--kube-api", "https://k:6443",
                                      "--kube-token-file", "/t", "--namespace", NS])  # fmt: skip
    with pytest.raises(ValueError, match="--prefill-deployment"):
        actuator_from_args(args, config)
    monkeypatch.setenv("SPLITSERVE_PLANNER_ACTUATOR", "kubernetess")
    with pytest.raises(ValueError, match="kubernetess"):  # a variable not understood is an error
        actuator_from_args(build_parser().parse_args(["planner"]), config)
    monkeypatch.setenv("SPLITSERVE_PLANNER_ACTUATOR", "kubernetes")
    monkeypatch.setenv("SPLITSERVE_PLANNER_PREFILL_DEPLOYMENT", "p")
    monkeypatch.setenv("SPLITSERVE_PLANNER_DECODE_DEPLOYMENT", "d")
    args = build_parser().parse_args(["planner", "--kube-api", "https://k:6443", "--namespace", NS])
    a = actuator_from_args(args, config)
    assert isinstance(a, KubeActuator) and a.target.deployments == {"prefill": "p", "decode": "d"}
    assert a.target.ca_file is None and a.target.api == "https://k:6443"  # explicit API: the system's CAs


def test_splitserve_planner_scales_the_deployments_from_a_real_registry(
    kube: tuple[FakeKube, KubeTarget], redis_url: str
) -> None:
    """The command itself, as the chart runs it: a real Redis whose registry holds no worker (an empty
    release), the fake API with prefill scaled to 0 and decode to 2: the floor brings prefill to 1
    (--min-prefill), decode stays at --min-decode 2, and the second round patches nothing."""
    fake, target = kube
    fake.replicas["llm-prefill"] = 0
    cmd = [sys.executable, "-m", "splitserve", "planner", "--actuator", "kubernetes"]
    cmd += ["--redis-url", redis_url]
    cmd += ["--kube-api", target.api, "--kube-token-file", str(target.token_file)]
    cmd += ["--kube-ca-file", str(target.ca_file), "--namespace", NS, "--min-decode", "2"]
    cmd += ["--prefill-deployment", "llm-prefill", "--decode-deployment", "llm-decode"]
    cmd += ["--rounds", "2", "--interval-s", "0.1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(d["prefill"], d["decode"]) for d in lines] == [(1, 2), (1, 2)]
    assert lines[0]["actuator"]["prefill"]["patched_from"] == 0
    assert "patched_from" not in lines[1]["actuator"]["prefill"]
    assert fake.replicas == {"llm-prefill": 1, "llm-decode": 2}
    assert [(n, r) for n, r, _ in fake.patches] == [("llm-prefill", 1)]
