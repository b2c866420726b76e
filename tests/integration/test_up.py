"""`splitserve up` (what `make run` starts): everything comes up, answers, a service that dies is
started again, and SIGTERM or Ctrl-C takes every process down with it, embedded Redis included.

The SIGTERM run serves the real SmolLM2, as `make run` does, and must answer the question right: the
suite's one check of the real model's text through every process. The Ctrl-C run serves the tiny model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import httpx
import psutil
import pytest
import redis

from tests.support.tiny_model import real_model_path
from tests.support.up import start_up

pytestmark = pytest.mark.services


@pytest.mark.parametrize(
    "sig",
    [pytest.param(signal.SIGTERM, marks=pytest.mark.real_model), signal.SIGINT],
    ids=["sigterm", "ctrl-c"],
)
def test_up_serves_and_shuts_down_cleanly(tmp_path, sig) -> None:  # type: ignore[no-untyped-def]
    real = sig == signal.SIGTERM
    env = {**os.environ}
    if real:
        env["SPLITSERVE_MODEL"] = env["SPLITSERVE_ROUTER_MODEL"] = real_model_path()
    else:  # a model set for the services only: up must give the router the same one
        del env["SPLITSERVE_ROUTER_MODEL"]
    children: list[psutil.Process] = []
    args = [
        "--threads-per-service",
        "1",
        "--kv-cache-mb",
        "64",
        "--tool-call-parser",
        "mistral",
    ]  # passed on to the router (its model card says it)
    # GPU placement, checked in the environment each child gets (no GPU here: they run on CPU)
    args += [] if real else ["--devices", "0,1", "--redis-data", str(tmp_path / "redis")]
    proc, port = start_up(args, tmp_path / "up.log", env)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while "splitserve is up" not in (tmp_path / "up.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4, "redis, prefill, decode and router run as their own processes"
        text = (tmp_path / "up.log").read_text()
        for name in ("prefill-0", "decode-0", "router"):  # each process as it becomes healthy
            assert f"  {name}: ready at http://" in text, text
        if not real:
            devices = {
                role: c.environ().get("CUDA_VISIBLE_DEVICES")
                for c in children
                for role in ("prefill", "decode", "router")
                if role in c.cmdline()[3:4]
            }
            assert devices == {"prefill": "0", "decode": "1", "router": None}, devices
            # --redis-data: the embedded Redis keeps an append-only file there (tests/integration/
            # test_redis_persistence.py restarts one and finds the keys)
            assert "kept in" in text and any((tmp_path / "redis").rglob("*.aof*")), text
            # the embedded Redis has a generated password: refused without it, in no command line
            m = re.search(r"\(redis (redis://:([^@]+)@127\.0\.0\.1:(\d+)/0)\)", text)
            assert m, text
            url, password, redis_port = m.groups()
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=int(redis_port)).ping()
            assert redis.Redis.from_url(url).ping()
            assert not [c.cmdline() for c in children if any(password in a for a in c.cmdline())]
            assert "redis: redis://:***@" in text  # the start-up line masks it
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=60,
            json={
                "model": "default",
                "temperature": 0,
                "max_tokens": 16,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
        )
        assert r.status_code == 200, r.text
        if real:
            assert "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        served = os.path.basename(env["SPLITSERVE_MODEL"])
        cards = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [m["id"] for m in cards] == [served] and cards[0]["tool_call_parser"] == "mistral"
        if sig == signal.SIGTERM:  # once: a service that dies is started again
            (decode,) = [c for c in children if "decode" in c.cmdline()]
            decode.kill()
            deadline = time.monotonic() + 120
            while not any("decode" in c.cmdline() and c.pid != decode.pid for c in _children(proc)):
                assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
                time.sleep(0.5)
            assert "exited with -9; starting it again" in (tmp_path / "up.log").read_text()
            children = _children(proc)
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=90)  # up waits up to DRAIN_WAIT_S (45 s) for its services
        except subprocess.TimeoutExpired:
            pytest.fail("up did not stop within 90 s of the signal:\n" + (tmp_path / "up.log").read_text())
        assert code == 0, (tmp_path / "up.log").read_text()
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"orphans left behind: {[p.cmdline() for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in children:
            if c.is_running():
                c.kill()


def _children(proc: subprocess.Popen) -> list[psutil.Process]:
    out = []
    for c in psutil.Process(proc.pid).children(recursive=True):
        try:
            c.cmdline()
            out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


def test_up_stops_with_one_line_when_a_service_cannot_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A model the services refuse (here: 5 ranks cannot shard the tiny model) stops `up` at once: each
    service says why in one line, `up` names the one it waited for, nothing is restarted, no traceback."""
    args = ["--threads-per-service", "1", "--kv-cache-mb", "64", "--tensor-parallel-size", "5"]
    proc, _ = start_up(args, tmp_path / "up.log", cwd=tmp_path)
    assert proc.wait(timeout=180) == 1, (tmp_path / "up.log").read_text()
    out = (tmp_path / "up.log").read_text()  # stdout and stderr
    assert "error: prefill-0: tensor_parallel_size=5 does not divide" in out, out
    assert "error: prefill-0 exited with code 2 before it was ready" in out, out
    assert "Traceback" not in out and "starting it again" not in out, out


class Up:
    """`splitserve up` with `flags` in a process of its own, logging to tmp_path/up.log."""

    def __init__(self, tmp_path, *flags: str) -> None:  # type: ignore[no-untyped-def]
        self.log_path = tmp_path / "up.log"
        self.proc, port = start_up(["--threads-per-service", "1", *flags], self.log_path)
        self.url = f"http://127.0.0.1:{port}"

    def text(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, what: str, cond, timeout_s: float = 120) -> None:  # type: ignore[no-untyped-def]
        """Poll cond while up runs; its log in the failure."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert self.proc.poll() is None and time.monotonic() < deadline, f"{what}:\n{self.text()}"
            time.sleep(0.3)

    def workers(self) -> tuple[int, int]:
        """(prefill, decode) services the router routes on; (-1, -1) while it does not answer."""
        try:
            h = httpx.get(self.url + "/health", timeout=5).json()
            return int(h.get("prefill_workers", 0)), int(h.get("decode_workers", 0))
        except (httpx.HTTPError, ValueError):
            return -1, -1

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def test_up_autoscale_adds_a_decode_service_under_pressure_and_removes_it_after(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`up --autoscale`: the planner acting on up's own services. A TPOT target no CPU can meet makes
    traffic put decode over target: a second decode service starts and the router routes to it; when the
    traffic stops, the role stays under target long enough and the newest decode service drains away."""
    up = Up(tmp_path, "--kv-cache-mb", "64", "--autoscale", "--autoscale-interval-s", "1",
            "--autoscale-cooldown-s", "2", "--autoscale-down-after-s", "3", "--autoscale-window-s", "3",
            "--tpot-target-s", "0.000001", "--max-decode", "2", "--max-prefill", "1")  # fmt: skip
    url, text, wait_for = up.url, up.text, up.wait_for

    try:
        wait_for("up", lambda: "splitserve is up" in text())
        body = {"model": "default", "prompt": "Count with me:", "max_tokens": 24, "temperature": 0}
        # Traffic until the second decode service is routed, not just started: on a loaded machine its
        # start takes seconds, and a planner that sees no traffic meanwhile rightly retires it again
        # before it ever registers (a CI run under load did exactly that).
        deadline = time.monotonic() + 180
        while up.workers()[1] != 2:
            assert up.proc.poll() is None and time.monotonic() < deadline, f"no second decode:\n{text()}"
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        decisions = [
            # raw_decode: another process's log line can land on the end of a long decision line
            json.JSONDecoder().raw_decode(line.split("autoscale: ", 1)[1])[0]
            for line in text().splitlines()
            if "autoscale: {" in line
        ]
        assert any(d["decode"] == 2 and "over target" in d["reason"] for d in decisions), decisions
        wait_for("the second decode service stopped", lambda: "decode-1: stopping (autoscale)" in text())
        wait_for("one decode service left", lambda: up.workers()[1] == 1)
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        up.stop()


def test_up_autoscale_with_the_forecast_law_adds_what_the_arrivals_need(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`up --autoscale --law forecast`: nothing recorded yet (its first day), so the arrivals the router
    counts are over the forecast, and the capacity table's row for their rate (2 decode services) is what
    the law asks for: a second decode service starts, for the arrivals alone (latency targets no run
    misses). The law records the arrivals per minute in up's Redis."""
    table = tmp_path / "capacity.json"
    table.write_text(json.dumps({"rows": [{"rate_rps": 1000, "prefill": 1, "decode": 2}]}))
    up = Up(tmp_path, "--kv-cache-mb", "64", "--autoscale", "--autoscale-interval-s", "1",
            "--law", "forecast", "--capacity-table", str(table), "--ttft-target-s", "100",
            "--tpot-target-s", "100", "--max-decode", "2", "--max-prefill", "1")  # fmt: skip
    try:
        up.wait_for("up", lambda: "splitserve is up" in up.text())
        body = {"model": "default", "prompt": "Count with me:", "max_tokens": 4, "temperature": 0}
        deadline = time.monotonic() + 180
        while up.workers()[1] != 2:
            assert up.proc.poll() is None and time.monotonic() < deadline, f"no second decode:\n{up.text()}"
            assert httpx.post(up.url + "/v1/completions", json=body, timeout=60).status_code == 200
        decisions = [
            json.JSONDecoder().raw_decode(line.split("autoscale: ", 1)[1])[0]
            for line in up.text().splitlines()
            if "autoscale: {" in line
        ]
        asked = [d for d in decisions if d["decode"] == 2]
        assert asked and "over the forecast" in asked[0]["reason"], decisions
        assert asked[0]["inputs"]["forecast_rps"] is None and asked[0]["inputs"]["seen_rps"] > 0
        assert asked[0]["inputs"]["extra"] == {"prefill": 0, "decode": 0}  # not the latency net
    finally:
        up.stop()


def test_up_autoscale_moves_a_service_to_the_other_role_without_a_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`up --autoscale` at its budget: a TTFT target no CPU can meet puts prefill over target, and the
    budget (3) lets it grow only if decode gives one up: the newest decode service changes role in place
    (POST /internal/role: same process, same worker id, a new incarnation), and the router routes it as a
    prefill service."""
    up = Up(tmp_path, "--kv-cache-mb", "32", "--prefill", "1", "--decode", "2", "--autoscale",
            "--autoscale-interval-s", "1", "--autoscale-cooldown-s", "2", "--autoscale-window-s", "3",
            "--ttft-target-s", "0.000001", "--tpot-target-s", "100", "--max-prefill", "2",
            "--max-decode", "2", "--budget", "3")  # fmt: skip
    try:
        up.wait_for("up", lambda: "splitserve is up" in up.text())
        pids = {c.pid for c in psutil.Process(up.proc.pid).children(recursive=True)}
        # a prompt long enough for the split route (the router's local-prefill threshold)
        body = {"model": "default", "prompt": "Tell me a story. " * 20, "max_tokens": 4, "temperature": 0}
        deadline = time.monotonic() + 180
        while up.workers() != (2, 1):
            assert up.proc.poll() is None and time.monotonic() < deadline, f"no move:\n{up.text()}"
            assert httpx.post(up.url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert "decode-1: switching decode -> prefill (autoscale)" in up.text()
        up.wait_for("the switch to answer", lambda: "decode-1: now prefill" in up.text(), 60)
        assert "prefill-1: starting" not in up.text() and "decode-1: stopping" not in up.text(), up.text()
        assert {c.pid for c in psutil.Process(up.proc.pid).children(recursive=True)} == pids, (
            "no process replaced"
        )
        assert httpx.post(up.url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        up.stop()
