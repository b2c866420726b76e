"""Chaos on a real stack (Redis, one prefill, two decode services, the router): a decode service
killed (SIGKILL), frozen (SIGSTOP) or drained (SIGTERM, shorter than the streams) while streams
generate on it, and the only prefill service killed in the middle of a prompt. Every accepted request
must finish with the text of an unfaulted greedy run — no token lost or repeated — and afterwards no
KV block is in use and no lease is left in Redis.

`make test` runs each scenario once; `make chaos` repeats them (CHAOS_ROUNDS, default 3 there).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from common.cluster.state import ClusterState
from tests.support.cluster import Cluster, Proc, free_port, get_json, leases_left, wait_until

pytestmark = [pytest.mark.services, pytest.mark.chaos]
ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "1"))
LEASE_S, STALL_S = 2.0, 3.0
# 16-token chunks: LONG_PROMPT takes ~100 prefill steps, long enough to fail in the middle of even on the
# tiny test model (each step is milliseconds)
FLAGS = ("--threads", "1", "--kv-cache-mb", "128", "--lease-s", str(LEASE_S))
FLAGS += ("--max-num-batched-tokens", "16")
DRAIN_S = 1.0
ENV = {"SPLITSERVE_DRAIN_TIMEOUT_S": str(DRAIN_S)}
MAX_TOKENS = 200  # streams of a few seconds on the tiny model: a fault lands while they generate
QUESTIONS = [
    "Write a short story about a lighthouse keeper and a storm.",
    "Explain how bread is made, step by step.",
    "Describe a walk through a forest in autumn.",
    "List the planets of the solar system with one fact about each.",
]
# ~1,500 tokens
LONG_PROMPT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(110))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):  # type: ignore[no-untyped-def]
    c = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    try:
        c.start("prefill", *FLAGS)
        c.start("decode", *FLAGS, env=ENV)
        c.start("decode", *FLAGS, env=ENV)
        c.start("router", "--decode-stall-s", str(STALL_S), "--max-migrations", "3")
        c.wait_routed()
        yield c
    finally:
        for p in c.procs:
            if p.popen.poll() is None:
                os.kill(p.popen.pid, signal.SIGCONT)
        c.stop()


def role(c: Cluster, name: str) -> list[Proc]:
    return [p for p in c.procs if p.role == name]


def chat(question: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "model": "default", "messages": [{"role": "user", "content": question}], "temperature": 0,
        "max_tokens": max_tokens, "ignore_eos": True,
    }  # fmt: skip


def complete(router: Proc, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(router.url + "/v1/chat/completions", json=body, timeout=180)


class Stream(threading.Thread):
    """One streaming request: its text, its chunk count as it goes, its errors, its logprobs."""

    def __init__(self, router: Proc, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.router, self.body = router, {**body, "stream": True}
        self.text, self.chunks, self.errors = "", 0, []  # type: ignore[var-annotated]
        self.logprobs: list[float] = []  # each token's, when the request asks for logprobs
        self.status, self.request_id, self.route = 0, "", ""

    def run(self) -> None:
        with httpx.stream("POST", self.router.url + "/v1/chat/completions", json=self.body, timeout=180) as r:
            self.status, self.request_id = r.status_code, r.headers.get("x-request-id", "")
            self.route = r.headers.get("x-splitserve-route", "")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    self.errors.append(event["error"]["message"])
                    continue
                choice = event["choices"][0]
                self.text += choice["delta"].get("content") or ""
                self.logprobs += [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
                self.chunks += 1


def reference(router: Proc, max_tokens: int = MAX_TOKENS) -> list[str]:
    """The unfaulted answers, asked all at once (greedy tokens do not depend on the batch)."""
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = [r.json() for r in pool.map(lambda q: complete(router, chat(q, max_tokens)), QUESTIONS)]
    return [a["choices"][0]["message"]["content"] for a in answers]


def busiest_decode(c: Cluster) -> Proc:
    return max(role(c, "decode"), key=lambda p: get_json(p.url + "/health")["running"])


def metric(router: Proc, name: str) -> float:
    text = httpx.get(router.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def assert_clean(c: Cluster, redis_url: str) -> None:
    """Nothing in use anywhere once every request ended: blocks, sequences, leases."""
    for p in role(c, "decode") + role(c, "prefill"):
        h = c.wait_blocks_free(p, timeout_s=LEASE_S * 4)
        assert h["free_blocks"] == h["total_blocks"] and h["running"] == h["waiting"] == 0, (p.url, h)
    deadline = time.monotonic() + LEASE_S * 4
    while leases_left(redis_url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leases_left(redis_url) == 0


def alive_decodes(redis_url: str) -> set[str]:
    async def alive() -> set[str]:
        state = ClusterState.from_url(redis_url)
        try:
            return {w.url for w in await state.registry.alive("decode")}
        finally:
            await state.close()

    return asyncio.run(alive())


def refuses_new_work(p: Proc) -> bool:
    """A draining service takes no new work: a new connection is refused (the listener closed), a
    connection accepted just as the server shut down is closed with no response, or a request on an
    open one gets a retryable 503 `draining`."""
    try:
        r = httpx.get(p.url + "/health", timeout=5)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True
    return r.status_code == 503 and r.json()["status"] == "draining"


def inject(c: Cluster, redis_url: str, victim: Proc, fault: str, streams: list[Stream]) -> None:
    """The fault, then every stream's end."""
    if fault == "kill":
        victim.popen.kill()
    elif fault == "term":
        victim.popen.terminate()
        wait_until(lambda: victim.url not in alive_decodes(redis_url), 2, "the drain to deregister it")
        assert refuses_new_work(victim)
    else:
        os.kill(victim.popen.pid, signal.SIGSTOP)
    try:
        for s in streams:
            s.join(180)
    finally:
        if fault == "stop":
            os.kill(victim.popen.pid, signal.SIGCONT)


def run_fault(c: Cluster, redis_url: str, fault: str) -> None:
    router = role(c, "router")[0]
    max_tokens = 3 * MAX_TOKENS if fault == "term" else MAX_TOKENS  # a drain of DRAIN_S cuts these short
    want = reference(router, max_tokens)
    before = metric(router, "splitserve_router_migrations_total")
    streams = [Stream(router, chat(q, max_tokens)) for q in QUESTIONS]
    for s in streams:
        s.start()
    wait_until(lambda: all(s.chunks >= 3 for s in streams), 120, "every stream to be generating")
    victim = busiest_decode(c)
    try:
        inject(c, redis_url, victim, fault, streams)
        for s, text in zip(streams, want, strict=True):
            assert s.status == 200 and not s.errors, (s.status, s.errors)
            assert s.text == text, "the migrated stream's text differs from an unfaulted run"
        assert metric(router, "splitserve_router_migrations_total") > before
        records = [get_json(f"{router.url}/v1/requests/{s.request_id}") for s in streams]
        migrated = [r for r in records if "migrating" in [state for state, _ in r["history"]]]
        assert migrated, "no record shows the migration"
        for rec in migrated:
            assert rec["state"] == "finished" and rec["migration_reason"] and rec["migrated_from"], rec
        if fault == "term":
            assert victim.popen.wait(DRAIN_S + 15) == 0, "a drained service exits 0"
    finally:
        if fault in ("kill", "term"):  # a spare again for the next scenario, whatever happened here
            if victim.popen.poll() is None:
                victim.popen.kill()
            c.procs.remove(victim)
            c.start("decode", *FLAGS, env=ENV)
            c.wait_routed()
    assert_clean(c, redis_url)


@pytest.mark.parametrize("fault", ["kill", "stop", "term"] * ROUNDS)
def test_a_failed_decode_service_loses_no_stream(stack, redis_url, fault) -> None:  # type: ignore[no-untyped-def]
    run_fault(stack, redis_url, fault)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_the_only_prefill_service_killed_mid_prompt_falls_back_to_decode(stack, redis_url, round_) -> None:  # type: ignore[no-untyped-def]
    router = role(stack, "router")[0]
    prefill = role(stack, "prefill")[0]
    body = {"model": "default", "prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0}
    result: dict[str, httpx.Response] = {}
    url = router.url + "/v1/completions"
    t = threading.Thread(target=lambda: result.update(r=httpx.post(url, json=body, timeout=180)))
    t.start()
    wait_until(lambda: get_json(prefill.url + "/health")["running"] > 0, 60, "the prefill to start")
    prefill.popen.kill()
    try:
        t.join(180)
        r = result["r"]
        assert r.status_code == 200, r.text
        assert r.headers["x-splitserve-route"] == "local; reason=prefill_failed"
        rec = get_json(f"{router.url}/v1/requests/{r.headers['x-request-id']}")
        assert rec["state"] == "finished" and rec["route"] == "local:prefill_failed", rec
    finally:
        stack.procs.remove(prefill)
        stack.start("prefill", *FLAGS)
        stack.wait_routed()
    assert_clean(stack, redis_url)


STORY = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "story": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "story"],
    "additionalProperties": False,
}


def featured(question: str) -> dict[str, Any]:
    """Seeded sampling, penalties, logprobs and a JSON schema: the state a migration must carry over."""
    return {
        **chat(question, 160), "ignore_eos": False, "temperature": 0.7, "seed": 42, "logprobs": True,
        "top_logprobs": 2, "frequency_penalty": 0.3, "presence_penalty": 0.2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}},
    }  # fmt: skip


def test_a_migration_carries_sampling_state_grammar_and_logprobs(stack, redis_url) -> None:  # type: ignore[no-untyped-def]
    """A decode service killed under seeded, penalised, schema-constrained streams with logprobs: each
    stream continues on another service with the same seed stream, penalty counts and grammar state,
    so its text is an unfaulted run's, it still validates, and every token has its logprob."""
    import jsonschema

    router = role(stack, "router")[0]
    want = [complete(router, featured(q)).json()["choices"][0] for q in QUESTIONS]
    before = metric(router, "splitserve_router_migrations_total")
    streams = [Stream(router, featured(q)) for q in QUESTIONS]
    for st in streams:
        st.start()
    wait_until(lambda: all(st.chunks >= 3 for st in streams), 120, "every stream to be generating")
    victim = busiest_decode(stack)
    try:
        inject(stack, redis_url, victim, "kill", streams)
        for st, ref in zip(streams, want, strict=True):
            assert st.status == 200 and not st.errors, (st.status, st.errors)
            assert st.text == ref["message"]["content"], "the migrated stream differs from an unfaulted run"
            jsonschema.validate(json.loads(st.text), STORY)
            ref_lps = [c["logprob"] for c in ref["logprobs"]["content"]]
            assert st.logprobs == pytest.approx(ref_lps, abs=1e-3)
        assert metric(router, "splitserve_router_migrations_total") > before
    finally:
        victim.popen.kill()
        stack.procs.remove(victim)
        stack.start("decode", *FLAGS, env=ENV)
        stack.wait_routed()
    assert_clean(stack, redis_url)


def test_a_decode_service_restarted_on_its_own_ports_is_used_at_once(stack, redis_url) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL, then the same ports again (what a container restart does): the next split request
    reaches it without a failed transfer — the prefill service drops its connection to the old
    process at first contact with the new incarnation. tcp: its sender does not watch an idle
    connection, so a stale one would take the next transfer (NIXL's control connection notices EOF)."""
    router = role(stack, "router")[0]
    victim = role(stack, "decode")[0]
    others = role(stack, "decode")[1:]
    port = int(victim.url.rsplit(":", 1)[1])
    kv_port = free_port()
    stack.procs.remove(victim)
    victim.popen.kill()
    victim.popen.wait()
    for o in others:  # only the restarted service takes decode work from here on
        stack.procs.remove(o)
        o.popen.terminate()
        o.popen.wait()
    tcp = ("--kv-port", str(kv_port), "--kv-backend", "tcp")
    first = stack.start("decode", *FLAGS, *tcp, env=ENV, port=port)
    want = reference(router)[:1]  # through the new process: the prefill service now knows it
    before = metric(router, "splitserve_router_transfer_failures_total")
    stack.procs.remove(first)
    first.popen.kill()
    first.popen.wait()
    again = stack.start("decode", *FLAGS, *tcp, env=ENV, port=port)
    assert get_json(again.url + "/health")["incarnation"] != ""
    stack.wait_routed()
    r = complete(router, chat(QUESTIONS[0]))
    assert r.status_code == 200 and r.headers["x-splitserve-route"].startswith("split")
    assert r.json()["choices"][0]["message"]["content"] == want[0]
    assert metric(router, "splitserve_router_transfer_failures_total") == before, "no transfer failed on it"
    stack.start("decode", *FLAGS, env=ENV)  # the stack's second decode service again
    stack.wait_routed()
    assert_clean(stack, redis_url)
