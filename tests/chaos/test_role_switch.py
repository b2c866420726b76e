"""Chaos: role switches under load. Twelve streaming requests go through the router, four at a time,
over a real stack (Redis, two prefill and two decode services); while they generate, a decode service
is switched to prefill and a prefill service to decode (POST /internal/role, no restart). Every
accepted request must finish with the text of an unfaulted greedy run — 0 lost, 0 failed — its Redis
record must end, and afterwards no KV block is in use and no lease is left.

Two ways a switch ends what runs on a decode service: it waits for the streams to finish (a drain
timeout longer than they take), or it hands them back when the drain timeout runs out first (the
stream closes, the router migrates it to another decode service with no token lost or repeated).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.chaos.test_decode_and_prefill_faults import Stream, assert_clean, chat, metric, role
from tests.support.cluster import Cluster, Proc, get_json, internal_auth, wait_until

pytestmark = [pytest.mark.services, pytest.mark.chaos]
LEASE_S = 2.0
FLAGS = ("--threads", "1", "--kv-cache-mb", "128", "--lease-s", str(LEASE_S))
QUESTIONS = [
    "Write a short story about a lighthouse keeper and a storm.",
    "Explain how bread is made, step by step.",
    "Describe a walk through a forest in autumn.",
    "List the planets of the solar system with one fact about each.",
    "Tell me about the history of the bicycle.",
]
REQUESTS, CONCURRENCY, MAX_TOKENS = 12, 4, 120


# the second pair's drain timeout is shorter than a stream: a switch hands its streams back
SHORT_DRAIN = {"SPLITSERVE_DRAIN_TIMEOUT_S": "0.3"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):  # type: ignore[no-untyped-def]
    """procs 0, 1: prefill, decode (drain timeout 30 s); 2, 3: prefill, decode (SHORT_DRAIN); router."""
    c = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    try:
        for env in (None, SHORT_DRAIN):
            c.start("prefill", *FLAGS, env=env)
            c.start("decode", *FLAGS, env=env)
        c.start("router", "--local-prefill-threshold", "1", "--max-migrations", "3")  # every prompt split
        c.wait_routed()
        yield c
    finally:
        c.stop()


def answers(router: Proc) -> dict[str, str]:
    """The unfaulted greedy text of each question."""
    url = router.url + "/v1/chat/completions"
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        got = list(pool.map(lambda q: httpx.post(url, json=chat(q, MAX_TOKENS), timeout=120), QUESTIONS))
    return {q: r.json()["choices"][0]["message"]["content"] for q, r in zip(QUESTIONS, got, strict=True)}


def switch(p: Proc, to: str, out: dict[str, Any]) -> None:
    r = httpx.post(p.url + "/internal/role", json={"role": to}, auth=internal_auth, timeout=120)
    out[p.url] = (r.status_code, r.json())


def run_load(c: Cluster, decode: Proc, prefill: Proc, handed_back: bool) -> None:
    """The load, with `decode` switched to prefill and `prefill` to decode while it generates."""
    router = role(c, "router")[0]
    assert (decode.role, prefill.role) == ("decode", "prefill")
    want = answers(router)
    migrations = metric(router, "splitserve_router_migrations_total")
    streams = [Stream(router, chat(QUESTIONS[i % len(QUESTIONS)], MAX_TOKENS)) for i in range(REQUESTS)]
    switched: dict[str, Any] = {}
    switches = [
        threading.Thread(target=switch, args=(decode, "prefill", switched)),
        threading.Thread(target=switch, args=(prefill, "decode", switched)),
    ]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        done = [pool.submit(s.run) for s in streams]

        # mid-stream: the decode service generates some of the streams, others still wait. A
        # reservation waiting for its KV (parked) does not count: its prefill service is switched
        # too, which hands the prefill back, and the reservation ends at once, before the drain
        # timeout runs out (then nothing is left on the decode service to hand back)
        def generating() -> bool:
            h = get_json(decode.url + "/health")
            return any(s.chunks >= 2 for s in streams) and h["running"] - h["parked"] > 0

        wait_until(generating, 60, "the decode service to generate")
        for t in switches:
            t.start()
        for f in done:
            f.result(timeout=120)
    for t in switches:
        t.join(120)
    for url, (status, body) in switched.items():
        assert status == 200 and body["switched"], (url, body)
        pool_ = body["released"]
        assert pool_["free_blocks"] == pool_["total_blocks"] and pool_["leases_left"] == 0, (url, pool_)
        assert pool_["kv_released"] == 1 and pool_["stuck_requests"] == 0, (url, pool_)
    lost = [s for s in streams if s.status != 200 or s.errors]
    assert not lost, [(s.status, s.errors) for s in lost]
    for s in streams:
        assert s.text == want[s.body["messages"][0]["content"]], (
            "a stream's text differs from an unfaulted run"
        )
        rec = get_json(f"{router.url}/v1/requests/{s.request_id}")
        assert rec["state"] == "finished", rec
    ended = switched[decode.url][1]["released"]["ended_requests"]
    moved = metric(router, "splitserve_router_migrations_total") - migrations
    if handed_back:  # the drain timeout ran out: the router migrated each stream it ended
        assert moved >= ended > 0, (ended, moved)
    else:  # what ran on the switched decode service finished there
        assert ended == 0 and moved == 0, (ended, moved)
    for p, now in ((decode, "prefill"), (prefill, "decode")):
        assert get_json(p.url + "/health")["role"] == now
        p.role = now  # the cluster helper's view (assert_clean, wait_routed)
    c.wait_routed()
    assert_clean(c, c.redis_url or "")


def test_a_switch_lets_its_streams_finish(stack) -> None:  # type: ignore[no-untyped-def]
    run_load(stack, decode=stack.procs[1], prefill=stack.procs[0], handed_back=False)


def test_a_switch_past_its_drain_timeout_hands_streams_back(stack) -> None:  # type: ignore[no-untyped-def]
    run_load(stack, decode=stack.procs[3], prefill=stack.procs[2], handed_back=True)
