"""Benchmarks and tests start their services on ports found free a moment earlier; on a busy machine
another process can take one in between. Stack (bench/serving.py) and the tests' Cluster
(tests/support/cluster.py) then start again on fresh ports instead of failing a benchmark run minutes in,
or a test at random. Real processes and real binds (tests/support/port_server.py)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

import bench.serving as serving
import tests.support.cluster as cluster
import tests.support.up as up_support
from bench.serving import PortTaken, Stack
from tests.support.cluster import Cluster

SERVER = "tests.support.port_server"


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process (here: this one) holds: bound, not listening, so a health check on it is
    refused at once (a listener would hold each check for its whole timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_a_taken_port_is_port_taken_and_a_picked_one_is_picked_again(
    tmp_path, taken: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    stack = Stack(str(tmp_path))
    try:
        with pytest.raises(PortTaken, match="address already in use"):
            stack.start("port-server", port=taken, module=SERVER, timeout_s=30)
        assert not stack.procs  # the child that failed is forgotten
        # the port picked for it is taken before it binds: picked again, once
        picks = iter([taken])
        free = serving.free_ports
        monkeypatch.setattr(serving, "free_ports", lambda n: next(picks, None) or free(n))
        url = stack.start("port-server", module=SERVER, timeout_s=30)
        assert not url.endswith(f":{taken}") and len(stack.procs) == 1
        # a block of ports (a sim-fleet's) likewise
        picks = iter([taken])
        base = stack.start_block(1, "port-server", module=SERVER, timeout_s=30)
        assert base != taken and len(stack.procs) == 2
    finally:
        stack.stop()


def test_a_block_whose_later_port_is_taken_starts_again_on_fresh_ports(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A sim-fleet's first service answers while a later one fails to bind (and takes the process
    down): start_block must wait for every port of the block, see the exit as PortTaken and start again
    (a bench fleet run once waited 2 minutes on a dead block, then failed)."""
    stack = Stack(str(tmp_path))
    first = serving.free_ports(3)
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 2))  # the block's last port, taken
        picks = iter([first])
        free = serving.free_ports
        monkeypatch.setattr(serving, "free_ports", lambda n: next(picks, None) or free(n))
        try:
            base = stack.start_block(3, "port-server", "--ports", "3", module=SERVER, timeout_s=30)
            assert base != first and len(stack.procs) == 1  # the first block's process is forgotten
        finally:
            stack.stop()


def test_the_tests_cluster_picks_a_taken_port_again(
    tmp_path, taken: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    c = Cluster(None, str(tmp_path))
    try:
        with pytest.raises(PortTaken, match="address already in use"):
            c.start("port-server", port=taken, module=SERVER, timeout_s=30)
        assert not c.procs
        picks = iter([taken])
        free = cluster.free_port
        monkeypatch.setattr(cluster, "free_port", lambda: next(picks, None) or free())
        proc = c.start("port-server", module=SERVER, timeout_s=30)
        assert not proc.url.endswith(f":{taken}") and c.procs == [proc]
    finally:
        c.stop()


def test_up_is_started_again_when_it_refuses_a_taken_port(
    tmp_path, taken: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """`splitserve up` checks its ports before it starts anything and refuses a taken one; the tests'
    start_up (tests/support/up.py) then starts it again on fresh ports."""
    picks = iter([taken])
    monkeypatch.setattr(up_support, "free_port", lambda: next(picks, None) or cluster.free_port())
    args = ["--prefill", "0", "--decode", "1", "--threads-per-service", "1"]
    proc, port = up_support.start_up(args, tmp_path / "up.log")
    try:
        text = (tmp_path / "up.log").read_text()
        assert port != taken and proc.poll() is None, text  # up on the second ports
        assert "splitserve is up" in text and "is taken" not in text, text
    finally:
        proc.terminate()  # up stops what it started
        proc.wait(timeout=60)


@pytest.fixture
def echo() -> Iterator[int]:
    """A port whose listener reads a request and sends its first line back: what a health check gets
    when the kernel connects it to itself (TCP self-connect: a check of a port nobody listens on yet,
    from an ephemeral source port equal to it), and the port is then held (the child cannot bind it)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(conn.recv(4096).split(b"\r\n", 1)[0] + b"\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        t.join()
        server.close()


def test_a_health_check_answered_with_its_own_request_is_not_up(tmp_path, echo: int) -> None:  # type: ignore[no-untyped-def]
    """A fresh-clone run failed `bench soak` with http.client.BadStatusLine: GET /health HTTP/1.1 (a
    health check connected to itself). It is a port not listened on yet: the child exits on the taken
    port and the start is PortTaken (picked again when the port was not given), never that error."""
    stack = Stack(str(tmp_path))
    try:
        with pytest.raises(PortTaken, match="address already in use"):
            stack.start("port-server", port=echo, module=SERVER, timeout_s=30)
    finally:
        stack.stop()
    c = Cluster(None, str(tmp_path))
    try:
        with pytest.raises(PortTaken, match="address already in use"):
            c.start("port-server", port=echo, module=SERVER, timeout_s=30)
    finally:
        c.stop()
