"""Prefix-aware routing end to end: real prefill and decode processes publish KV events to a real Redis,
a real router follows them, and a chat's next turn goes where its history already is."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from tests.support.cluster import Cluster, get_json

pytestmark = pytest.mark.services
SERVICE_FLAGS = ("--threads", "1", "--kv-cache-mb", "64")
SYSTEM = (
    "You are a patient tutor in astronomy. Answer every question in two plain sentences, with one "
    "concrete example, and never use lists. Keep the whole conversation in mind and refer back to "
    "earlier answers when that helps the student."
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):  # type: ignore[no-untyped-def]
    cluster = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    try:
        cluster.start("prefill", *SERVICE_FLAGS, "--worker-id", "prefix-p0")
        for name in ("prefix-d0", "prefix-d1"):
            cluster.start("decode", *SERVICE_FLAGS, "--worker-id", name)
        router = cluster.start("router", "--local-prefill-threshold", "24")
        yield cluster, router
    finally:
        cluster.stop()


def chat(router_url: str, messages: list[dict[str, str]]) -> tuple[httpx.Response, str]:
    body = {"model": "default", "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r, r.json()["choices"][0]["message"]["content"]


def hit(route: str, name: str) -> int:
    m = re.search(rf"(?:^|; ){name}=(\d+) blocks", route)
    return int(m.group(1)) if m else 0


def kv_index_figures(router_url: str) -> dict[str, float]:
    """The router's KV index health from /metrics: {events_applied, resyncs, errors, ...}."""
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    found = re.finditer(r"^splitserve_router_kv_index_(\w+) (\S+)$", text, re.MULTILINE)
    return {m.group(1): float(m.group(2)) for m in found}


def index_events_applied(router_url: str) -> float:
    return kv_index_figures(router_url).get("events_applied", 0.0)


def settle_index(router_url: str, before: float, quiet_s: float = 0.5, timeout_s: float = 20) -> None:
    """Wait until the router's KV index has applied new events and none came for `quiet_s` (the services
    flush every 0.1 s and the router polls every 0.05 s; a loaded CI machine can take longer)."""
    deadline = time.monotonic() + timeout_s
    last, since = index_events_applied(router_url), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = index_events_applied(router_url)
        if now != last:
            last, since = now, time.monotonic()
        elif last > before and time.monotonic() - since >= quiet_s:
            return
    raise AssertionError(f"the router's KV index did not settle: {before} -> {last} events applied")


def test_a_chats_next_turn_goes_where_its_history_is(stack, tiny) -> None:  # type: ignore[no-untyped-def]
    cluster, router = stack
    model, tok = tiny
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why do stars twinkle?"}]
    applied_before = index_events_applied(router.url)
    first, answer = chat(router.url, messages)
    assert first.headers["x-splitserve-route"].startswith("split")
    rec1 = get_json(f"{router.url}/v1/requests/{first.headers['x-request-id']}")
    settle_index(router.url, applied_before)  # the services' KV events reach the router's index

    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And planets?"}]
    second, text = chat(router.url, messages)
    route = second.headers["x-splitserve-route"]
    rec2 = get_json(f"{router.url}/v1/requests/{second.headers['x-request-id']}")
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)  # as the router does
    n_prompt = len(ids)
    # the decode service that served turn one holds its prompt (and answer) blocks: placed there again
    assert rec2["decode_id"] == rec1["decode_id"], (rec1, rec2)
    decode_hit = hit(route, "prefix_hit")
    assert decode_hit >= rec1["prompt_tokens"] // 16 - 1, route
    assert rec2["prefix_hit_blocks"] == decode_hit
    if route.startswith("split"):  # the prefill service holds turn one's prompt: it computes the rest
        assert hit(route, "prefill_prefix_hit") > 0 and rec2["prefill_prefix_hit_blocks"] > 0
        # only the blocks the decode service lacked moved
        assert rec2["transfer_bytes"] < rec1["transfer_bytes"]
    else:
        assert "reason=cached_prefix" in route and n_prompt - decode_hit * 16 < 24
    # and the answer is the plain engine's, token for token
    want = LLMEngine(model, tok, EngineConfig(max_num_seqs=1)).generate(
        [ids], SamplingParams(max_tokens=12, ignore_eos=True)
    )[0]
    assert text == want.text

    # what SLO-aware admission predicts from: the services measure their own speed and publish it
    prefill = next(p for p in cluster.procs if p.role == "prefill")
    load = get_json(prefill.url + "/health")
    assert load["prefill_tps"] > 0 and load["queued_tokens"] == 0, load
    # and a prompt step's time as fixed + per token once its steps differ in size (0 until then), with the
    # most tokens a step takes: how many steps a queue costs
    assert load["prefill_step_ms"] >= 0 and load["prefill_ms_per_token"] >= 0, load
    assert load["step_tokens"] > 0, load
    assert load["decode_step_fixed_ms"] >= 0 and load["decode_ms_per_seq"] >= 0, load

    metrics = httpx.get(f"{router.url}/metrics").text
    reused = re.search(r'splitserve_router_prefix_blocks_total\{kind="reused",role="decode"\} (\S+)', metrics)
    assert reused is not None and float(reused.group(1)) >= decode_hit, metrics[-2000:]
    # the index's own health: it loaded each worker's snapshot and applied their events
    index = kv_index_figures(router.url)
    assert index["events_applied"] > 0 and index["resyncs"] >= 2 and index["errors"] == 0, index
