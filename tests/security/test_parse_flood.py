"""Nothing CPU-heavy on the router's loop (issue 31, point 1), against real processes: Redis, a decode
service on the tiny model, a router with API keys required.

While one key floods /tokenize with 5 MiB chat bodies (150,000 small messages: 1.3 s of validation,
template rendering and length checking each, on a quiet machine), another key's `/health` and small
completions keep their p99 latency within 100 ms of what it was unloaded, measured first in the same
test; and a key limited to RPM requests per minute gets exactly RPM of a burst of 2 x RPM sent during the
flood. Before the preparation pool (router/prep.py), each flood body held the router's event loop for
over a second: /health waited behind it (p99 above 1 s), and Redis deadlines fired late, letting a
rate-limited key's requests through unmetered.

The flood runs in a process of its own (its sending and JSON would otherwise share this process' GIL
with the latency probe), bounded: FLOOD_SENDERS requests at a time, at most FLOOD_MAX requests and
FLOOD_MAX_S seconds, and it stops as soon as the test closes its stdin. The margin is the issue's own,
100 ms over the unloaded p99: on a quiet 2-core machine the loaded p99 was within ~10 ms of it, the
code without the pool misses it by more than a second, so noise on a shared machine has room while the
property still means something. p99 is taken by nearest rank over SAMPLES requests of each kind (with
100, one outlier is forgiven).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from common.cluster.state import connect
from router.auth.keys import KeyStore, Limits
from tests.support.cluster import Cluster, free_port, wait_until

pytestmark = pytest.mark.services

SAMPLES = 100  # of /health and of small completions, unloaded and again under the flood
MARGIN_S = 0.100  # the issue's: p99 under the flood at most this much above the unloaded p99
RPM = 6  # the limited key's budget: one more request every 10 s, so a burst well within that gets RPM
FLOOD_SENDERS = 4  # the flooding key's requests at a time (within its share of the pool: no 429 loop)
FLOOD_MAX, FLOOD_MAX_S = 200, 40.0  # bounds on the flood, whatever the test does
PROBE_MAX_S = 20.0  # a probe stops early past this (the code without the pool: seconds per request)

FLOOD = r"""
import json, sys, threading, time, httpx
url, key = sys.argv[1], sys.argv[2]
senders, most, most_s = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hi"}] * 150_000}).encode()
stop, lock, statuses, sent = threading.Event(), threading.Lock(), {}, [0]
end = time.monotonic() + most_s
def send():
    with httpx.Client(timeout=120, headers={"Authorization": "Bearer " + key,
                                            "Content-Type": "application/json"}) as c:
        while not stop.is_set() and time.monotonic() < end:
            with lock:
                if sent[0] >= most:
                    return
                sent[0] += 1
            status = c.post(url + "/tokenize", content=body).status_code
            with lock:
                first = not statuses
                statuses[status] = statuses.get(status, 0) + 1
            if first:
                print("answered", flush=True)
threads = [threading.Thread(target=send) for _ in range(senders)]
for t in threads:
    t.start()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
for t in threads:
    t.join()
print(json.dumps({"statuses": statuses, "stopped": stop.is_set()}), flush=True)
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path_factory.mktemp("logs")))
    try:
        c.start("decode", "--threads", "1", "--kv-cache-mb", "64")
        router = c.start("router", "--require-api-key", "--local-prefill-threshold", "100000")
        # a pool of one worker and one waiting place (one key: one of the two), 3 refusals a minute
        small = c.start(
            "router",
            "--require-api-key",
            env={
                "SPLITSERVE_ROUTER_PARSE_WORKERS": "1",
                "SPLITSERVE_ROUTER_PARSE_QUEUE": "1",
                "SPLITSERVE_ROUTER_REFUSALS_PER_MINUTE": "3",
            },
        )
        c.wait_routed()
        keys = asyncio.run(_keys(redis.url))
        yield redis, router, small, keys
    finally:
        c.stop()
        redis.stop()


async def _keys(url: str) -> dict[str, str]:
    r = connect(url)
    try:
        store = KeyStore(r)
        made = {
            "flood": await store.create("flood", "mallory"),
            "victim": await store.create("victim", "alice"),
            "limited": await store.create("limited", "bob", limits=Limits(rpm=RPM)),
            "a": await store.create("a", "a"),
            "b": await store.create("b", "b"),
            "c": await store.create("c", "c"),
            "refused": await store.create("refused", "r", limits=Limits(rpm=10)),
            "capped": await store.create("capped", "r", limits=Limits(max_concurrent=2)),
            "rpm_only": await store.create("rpm_only", "r", limits=Limits(rpm=100)),
            "ops": await store.create("ops", "ops", scopes=("admin",)),
        }
        return {name: secret for name, (secret, _) in made.items()}
    finally:
        await r.aclose()


def big_chat() -> bytes:
    """A /tokenize body of 150,000 small messages (5 MiB): seconds of parse work, refused as too long."""
    return json.dumps(
        {"model": "default", "messages": [{"role": "user", "content": "hi"}] * 150_000}
    ).encode()


def post(url: str, key: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(
        url + path,
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=120,
    )


def parse_jobs(router, ops: str) -> float:  # type: ignore[no-untyped-def]
    """The router's splitserve_router_parse_jobs gauge: large requests in its pool."""
    text = httpx.get(router.url + "/metrics", headers={"Authorization": f"Bearer {ops}"}, timeout=30).text
    line = next(ln for ln in text.splitlines() if ln.startswith("splitserve_router_parse_jobs "))
    return float(line.split()[1])


def p99(samples: list[float]) -> float:
    """Nearest rank."""
    ordered = sorted(samples)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


def probe(client: httpx.Client, url: str, n: int = SAMPLES) -> tuple[list[float], list[float], list[str]]:
    """n of /health and of a small completion, alternating (fewer if that takes over PROBE_MAX_S):
    (health latencies, completion latencies, the answers that were not 200)."""
    health: list[float] = []
    completion: list[float] = []
    failed: list[str] = []
    end = time.monotonic() + PROBE_MAX_S
    for _ in range(n):
        if time.monotonic() > end:
            break
        t0 = time.perf_counter()
        r = client.get(url + "/health")
        health.append(time.perf_counter() - t0)
        if r.status_code != 200:
            failed.append(f"/health {r.status_code} {r.text[:120]}")
        t0 = time.perf_counter()
        r = client.post(
            url + "/v1/completions",
            json={"model": "default", "prompt": "hello there", "max_tokens": 2, "temperature": 0},
        )
        completion.append(time.perf_counter() - t0)
        if r.status_code != 200:
            failed.append(f"completion {r.status_code} {r.text[:120]}")
    return health, completion, failed


def burst(url: str, key: str, n: int) -> list[int]:
    """n small completions of `key` at once: their statuses."""

    def one(_: int) -> int:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "default", "prompt": "hi", "max_tokens": 1, "temperature": 0},
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        return r.status_code

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_a_parse_flood_does_not_slow_other_keys_or_unmeter_limits(stack) -> None:  # type: ignore[no-untyped-def]
    _, router, _, keys = stack
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {keys['victim']}"}) as client:
        probe(client, router.url, 10)  # warm: connections, the decode service's first steps
        health0, completion0, failed0 = probe(client, router.url)
        assert not failed0, failed0

        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, router.url, keys["flood"], str(FLOOD_SENDERS), str(FLOOD_MAX),
             str(FLOOD_MAX_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert flood.stdout is not None and flood.stdin is not None
            # the flood is under way: its first body has been answered and the others are in flight
            assert flood.stdout.readline().strip() == "answered", "the flood got no answer"
            t0 = time.monotonic()
            statuses = burst(router.url, keys["limited"], 2 * RPM)
            burst_s = time.monotonic() - t0
            health1, completion1, failed1 = probe(client, router.url)
            flooding = flood.poll() is None  # still flooding when the measurement ended
        finally:
            # stdin closed: the flood stops sending; the requests it has in flight are answered
            out, _ = flood.communicate(input="", timeout=120)
    summary = json.loads(out.strip().splitlines()[-1])
    report = (
        f"/health p99 {p99(health0) * 1000:.1f} ms unloaded, {p99(health1) * 1000:.1f} ms under the flood; "
        f"completions p99 {p99(completion0) * 1000:.1f} ms, {p99(completion1) * 1000:.1f} ms; "
        f"{len(health1)} samples under the flood, which answered {summary['statuses']}; the limited key's "
        f"burst {sorted(statuses)} in {burst_s:.1f} s; not 200 under the flood: {len(failed1)} {failed1[:2]}"
    )
    print(report)
    # the flood did real work during the measurement: its bodies were refused after their parse (400)
    assert flooding and summary["stopped"] and summary["statuses"].get("400", 0) >= 2, report
    assert not failed1, report
    assert p99(health1) <= p99(health0) + MARGIN_S, report
    assert p99(completion1) <= p99(completion0) + MARGIN_S, report
    # the limited key: exactly its budget (the burst ended long before one more request was refilled)
    assert burst_s < 60 / RPM, f"the burst took {burst_s:.1f} s: the bucket refilled during it"
    assert sorted(statuses) == [200] * RPM + [429] * RPM, statuses


def test_the_pool_is_bounded_per_key_and_in_all(stack) -> None:  # type: ignore[no-untyped-def]
    """One worker, one waiting place: a key's second large body while its first is prepared gets 429 at
    once, another key's takes the waiting place, and a third body gets 503 with Retry-After; the two
    let in are answered (400: too long for the context, found by the worker)."""
    _, _, small, keys = stack
    body = big_chat()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, small.url, keys["a"], "/tokenize", body)
        wait_until(lambda: parse_jobs(small, keys["ops"]) >= 1, 30, "key a's body in the pool")
        again = post(small.url, keys["a"], "/tokenize", body)
        second = pool.submit(post, small.url, keys["b"], "/tokenize", body)
        wait_until(lambda: parse_jobs(small, keys["ops"]) >= 2, 30, "key b's body in the pool")
        third = post(small.url, keys["c"], "/tokenize", body)
        answers = [first.result(), second.result()]
    assert again.status_code == 429 and again.json()["error"]["code"] == "rate_limit_exceeded", again.text
    assert third.status_code == 503 and "Retry-After" in third.headers, third.text
    for r in answers:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    wait_until(lambda: parse_jobs(small, keys["ops"]) == 0, 30, "the pool to be empty")
    assert post(small.url, keys["c"], "/tokenize", body).status_code == 400  # and it serves again


def test_requests_refused_after_their_parse_are_charged(stack) -> None:  # type: ignore[no-untyped-def]
    """Each refused request costs one of the key's requests and one of its 3 refusals a minute; once
    those are spent, the key's requests get 429 before any parsing, a valid one too."""
    redis, _, small, keys = stack
    bad = json.dumps({"model": "default", "prompt": "hi", "stop": "x" * 300}).encode()
    for _ in range(3):
        r = post(small.url, keys["refused"], "/v1/completions", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    good = json.dumps({"model": "default", "prompt": "hi", "max_tokens": 1}).encode()
    r = post(small.url, keys["refused"], "/v1/completions", good)
    assert r.status_code == 429 and "refused" in r.json()["error"]["message"], r.text
    assert int(r.headers["Retry-After"]) >= 1

    async def requests_left() -> float:
        client = connect(redis.url)
        try:
            key_id = keys["refused"].split("-")[2]
            return float(await client.hget(f"splitserve:ratelimit:{{{key_id}}}:buckets", "r"))
        finally:
            await client.aclose()

    assert asyncio.run(requests_left()) < 8, "the refused requests were not charged to the key's rpm"


def test_a_key_with_a_concurrency_limit_is_refused_when_its_limits_cannot_be_checked(stack) -> None:  # type: ignore[no-untyped-def]
    """Redis does not answer (stopped): a key capped in requests at once gets 503, not an uncounted
    request; a key with a rate alone is served unmetered, as before (docs/security.md)."""
    redis, router, _, keys = stack
    body = json.dumps({"model": "default", "prompt": "hello"}).encode()
    for name in ("capped", "rpm_only"):  # verified now: the key cache serves them while Redis is away
        assert post(router.url, keys[name], "/tokenize", body).status_code == 200
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        capped = post(router.url, keys["capped"], "/tokenize", body)
        rated = post(router.url, keys["rpm_only"], "/tokenize", body)
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    assert capped.status_code == 503 and "Retry-After" in capped.headers, capped.text
    assert "limits" in capped.json()["error"]["message"], capped.text
    assert rated.status_code == 200, rated.text


def test_large_requests_are_served_through_the_pool(stack) -> None:  # type: ignore[no-untyped-def]
    """Bodies over parse_inline_bytes (16 KiB) are parsed in a worker and served as before: several
    choices, a structured-output guide, /tokenize's count the prompt the completion was charged for."""
    _, router, _, keys = stack
    prompt = "hello world " * 3000  # 36 KB
    tok = post(router.url, keys["victim"], "/tokenize", json.dumps({"prompt": prompt}).encode())
    assert tok.status_code == 200, tok.text
    body = {"model": "default", "prompt": prompt, "n": 2, "max_tokens": 2, "temperature": 0}
    r = post(router.url, keys["victim"], "/v1/completions", json.dumps(body).encode())
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 2 and out["usage"]["prompt_tokens"] == 2 * tok.json()["count"], out["usage"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    r = post(router.url, keys["victim"], "/v1/chat/completions", json.dumps(chat).encode())
    assert r.status_code == 200, r.text
    chat["response_format"]["json_schema"]["schema"] = {"type": "bogus"}  # type: ignore[index]
    r = post(router.url, keys["victim"], "/v1/chat/completions", json.dumps(chat).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
