"""The worker registry is not a trust root, and Redis coming back empty fails nothing (issue 31, "Security
round 2"), against a real Redis, prefill, decode and router:

- a worker entry written straight into Redis (a real service's entry copied with another URL, with its
  signature, without one, or signed with another secret) gets no call: the router ignores it, logs it
  once, and the prompts (token ids) go to the real services only. Before, the forged entries — the
  least loaded, first in order — received the signed /internal/generate and /internal/prefill calls;
- after a decode service has been restarted once, an empty Redis restart fails no request (before, the
  requests in the second or so until the services registered again got 503 "no decode service is
  available" when the router had not read the registry for 10 s: it kept its last list for 10 s after
  that list was read, not after the registry went empty).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from common.cluster.state import ClusterState, connect
from common.security.identity import WorkerIdentity
from common.security.secret import InternalSecret
from router.workers import WorkerPool
from tests.support.cluster import Cluster, Proc, free_port, get_json, wait_until

pytestmark = pytest.mark.services
FLAGS = ("--threads", "1", "--kv-cache-mb", "64")
PREFIX = "splitserve:"
WORDS = ["alpha", "bravo", "delta", "kilo", "lima", "oscar", "tango"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path_factory.mktemp("logs")))
    try:
        c.start("prefill", *FLAGS)
        c.start("decode", *FLAGS)
        c.start("router")
        c.wait_routed()
        yield c, redis
    finally:
        c.stop()
        redis.stop()


class Trap(ThreadingHTTPServer):
    """An HTTP server that records every request it gets and answers 503 (busy: a router moves on)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []  # (method, path, body bytes)
        trap = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                self.rfile.read(n)
                trap.seen.append((self.command, self.path, n))
                body = b'{"error": {"message": "busy", "code": 503}}'
                self.send_response(503)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _any

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def trap() -> Iterator[Trap]:
    server = Trap()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def role(c: Cluster, name: str) -> list[Proc]:
    return [p for p in c.procs if p.role == name and p.popen.poll() is None]


def complete(router: Proc, prompt: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=120)


def words(n: int, seed: int) -> str:
    """A prompt of about n tokens no earlier request shared (no prefix-cache hit tilts the placement)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def forge(redis_url: str, real: dict[str, str], trap_url: str) -> list[tuple[str, str]]:
    """Entries next to the real ones, each a copy of `real[role]`'s aimed at the trap: its signature
    kept (the URL changed), no signature, and one signed with another secret. Idle, with the most free
    blocks and ids that sort first: the router's first choice if it trusted them. (role, id) each."""
    idle = {"running": 0, "waiting": 0, "queued_tokens": 0, "queue_wait_s": 0, "free_blocks": 10**6}
    other = InternalSecret(b"not-the-cluster-secret-at-all!!")

    async def main() -> list[tuple[str, str]]:
        r = connect(redis_url)
        made = []
        try:
            for role_, worker_id in real.items():
                h = await r.hgetall(f"{PREFIX}worker:{worker_id}")
                cap = json.loads(h["capacity"])
                fake = {**h, "url": trap_url, "load": json.dumps({**idle, "total_blocks": 10**6})}
                ident = WorkerIdentity(f"a-other-{role_}", role_, trap_url, h["kv_endpoint"], "x", cap)
                entries = {
                    f"a-copied-{role_}": fake,
                    f"a-unsigned-{role_}": {k: v for k, v in fake.items() if k != "sig"},
                    f"a-other-{role_}": {**fake, "incarnation": "x", "sig": ident.sign(other)},
                }
                for worker_id_, mapping in entries.items():
                    await r.hset(f"{PREFIX}worker:{worker_id_}", mapping=mapping)
                    await r.sadd(f"{PREFIX}workers:{role_}", worker_id_)
                    made.append((role_, worker_id_))
        finally:
            await r.aclose()
        return made

    return asyncio.run(main())


def unforge(redis_url: str, made: list[tuple[str, str]]) -> None:
    async def main() -> None:
        r = connect(redis_url)
        try:
            for role_, worker_id in made:
                await r.delete(f"{PREFIX}worker:{worker_id}")
                await r.srem(f"{PREFIX}workers:{role_}", worker_id)
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_worker_entry_written_into_redis_gets_no_call(stack, trap) -> None:  # type: ignore[no-untyped-def]
    c, redis = stack
    router = role(c, "router")[0]
    real = {name: get_json(role(c, name)[0].url + "/health")["worker_id"] for name in ("prefill", "decode")}
    made = forge(redis.url, real, trap.url)
    try:
        # short prompts stay on the decode service (local), long ones go through a prefill service
        # (split); several in flight at once, so that load alone would also spread them
        prompts = [words(8, i) for i in range(4)] + [words(80, 100 + i) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: complete(router, p), prompts))
        assert [a.status_code for a in answers] == [200] * len(prompts), [a.text for a in answers]
        assert trap.seen == [], "a forged registry entry was called"
        with open(router.log_path) as f:
            log = f.read()
        for _, worker_id in made:
            entry = f"registry entry {worker_id!r}"
            lines = [ln for ln in log.splitlines() if entry in ln and "ignored" in ln]
            assert len(lines) == 1, (worker_id, lines)  # logged once per worker, however often it is read
        assert "ignored: unsigned" in log and "ignored: forged" in log
    finally:
        unforge(redis.url, made)


def registered(redis_url: str) -> set[str]:
    async def main() -> set[str]:
        state = ClusterState.from_url(redis_url)
        try:
            return {w.id for r in ("prefill", "decode") for w in await state.registry.alive(r)}
        finally:
            await state.close()

    return asyncio.run(main())


def test_an_empty_redis_restart_fails_no_request(stack) -> None:  # type: ignore[no-untyped-def]
    c, redis = stack
    router = role(c, "router")[0]
    # the sequence: a decode service restarted once (same address and worker id, a new
    # incarnation: the router signs its calls for the new process) ...
    old = role(c, "decode")[0]
    port = int(old.url.rsplit(":", 1)[1])
    c.stop(old)
    c.start("decode", *FLAGS, port=port)
    c.wait_routed()
    assert complete(router, words(8, 1000)).status_code == 200
    # ... and then a quiet spell: nothing routed for longer than the router keeps a list it cannot
    # confirm (what made the restart's requests fail: the list had aged out before Redis went empty)
    time.sleep(WorkerPool.STALE_S + 1)
    redis.restart()  # the same port, empty
    answers: list[tuple[float, int, str]] = []
    t0 = time.monotonic()
    for i in range(16):  # across the services' re-registration (a heartbeat or so), and after it
        r = complete(router, words(8 if i % 2 else 80, 2000 + i))
        failed = r.text[:120] if r.status_code != 200 else ""
        answers.append((round(time.monotonic() - t0, 2), r.status_code, failed))
        time.sleep(0.2)
    assert [s for _, s, _ in answers] == [200] * 16, answers
    wait_until(lambda: len(registered(redis.url)) == 2, 5, "both services to register again")
