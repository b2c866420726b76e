"""The whole request flow, every service a real process on 127.0.0.1, state in a real Redis, the tiny
test model (the real model's answer through `splitserve up` is tests/integration/test_up.py's), spoken
to with the official `openai` client and plain HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from tests.support.cluster import Cluster, get_json, internal_auth

pytestmark = pytest.mark.services
SERVICE_FLAGS = ("--threads", "1", "--kv-cache-mb", "64")
THRESHOLD = "12"  # prompts of fewer tokens are prefilled locally on the decode service
LONG = [  # split path
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three most important ideas in the history of science are, in my opinion,",
]
SHORT = ["The capital of France is", "1, 2, 3, 4,"]  # local path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):  # type: ignore[no-untyped-def]
    cluster = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    try:
        prefill = cluster.start("prefill", *SERVICE_FLAGS)
        decode_ = cluster.start("decode", *SERVICE_FLAGS)
        router = cluster.start("router", "--local-prefill-threshold", THRESHOLD)
        yield cluster, prefill, decode_, router
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack[3].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def engine_text(tiny, prompt: str, max_tokens: int) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1))
    out = engine.generate([tok.encode(prompt)], SamplingParams(max_tokens=max_tokens))[0]
    return out.text, len(out.token_ids)


def record(router_url: str, request_id: str) -> dict:
    return get_json(f"{router_url}/v1/requests/{request_id}")


@pytest.mark.parametrize(("prompts", "route"), [(LONG, "split"), (SHORT, "local")])
def test_greedy_matches_generate(stack, tiny, prompts, route) -> None:  # type: ignore[no-untyped-def]
    router = stack[3]
    kv = httpx.get(stack[2].url + "/internal/kv", auth=internal_auth, timeout=10)
    decode_backend = kv.json()["backend"]
    for prompt in prompts:
        r = httpx.post(
            router.url + "/v1/completions",
            timeout=120,
            json={"model": "default", "prompt": prompt, "max_tokens": 16, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-splitserve-route"].startswith(route)
        body = r.json()
        want_text, want_n = engine_text(tiny, prompt, 16)
        assert body["choices"][0]["text"] == want_text
        assert body["usage"]["completion_tokens"] == want_n
        rec = record(router.url, r.headers["x-request-id"])
        states = [s for s, _ in rec["history"]]
        expected = (
            ["queued", "reserved", "prefilling", "transferring", "decoding", "finished"]
            if route == "split"
            else ["queued", "reserved", "decoding", "finished"]
        )
        assert states == expected, rec
        if route == "split":  # what the KV transfer cost, written by the prefill service
            assert rec["transfer_bytes"] > 0 and rec["transfer_ms"] >= 0, rec
            assert rec["transfer_backend"] == decode_backend, rec
        else:
            assert "transfer_bytes" not in rec, rec
        stamps = [t for _, t in rec["history"]]
        assert stamps == sorted(stamps)
        assert rec["finish_reason"] == body["choices"][0]["finish_reason"]


def test_openai_client_chat_and_completions(client, tiny) -> None:  # type: ignore[no-untyped-def]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0)
    model, tok = tiny
    want = LLMEngine(model, tok, EngineConfig(max_num_seqs=1)).generate(
        [tok.encode(tok.apply_chat_template(msgs))], SamplingParams(max_tokens=24)
    )[0]
    assert chat.choices[0].message.content == want.text
    assert chat.choices[0].finish_reason == want.finish_reason
    assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="default",
        messages=msgs,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens
    comp = client.completions.create(model="default", prompt=LONG[0], max_tokens=8, temperature=0)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 8
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="default", prompt=LONG[0], max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == comp.choices[0].text
    assert [m.id for m in client.models.list().data]


def test_concurrent_streams_all_finish(stack) -> None:  # type: ignore[no-untyped-def]
    cluster, prefill, decode_, router = stack
    n, max_tokens = 64, 6

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, dict]:
        prompt = (LONG if i % 2 else SHORT)[i % 2] + f" ({i})"
        body = {
            "model": "default",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        tokens_text, usage, done = "", None, False
        async with c.stream("POST", router.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk["choices"]:
                    tokens_text += chunk["choices"][0]["text"]
        assert done and usage is not None
        return i, usage

    async def main() -> list[tuple[int, dict]]:
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    results = asyncio.run(main())
    assert len(results) == n
    for _, usage in results:
        assert usage["completion_tokens"] == max_tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + max_tokens
    for proc in (prefill, decode_):
        h = cluster.wait_blocks_free(proc)
        assert h["free_blocks"] == h["total_blocks"], f"{proc.role} holds blocks after the traffic: {h}"


BAD = [
    ("not json", "invalid_json"),
    ({"model": "no-such-model", "prompt": "hi"}, "model"),
    ({"model": "default"}, "prompt"),
    ({"model": "default", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "default", "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": "default", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "default", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": "default", "prompt": "hi", "n": 17}, "n"),
    ({"model": "default", "prompt": "hi", "max_tokens": 9000}, "context"),
]


@pytest.mark.parametrize(("body", "what"), BAD, ids=[w for _, w in BAD])
def test_bad_input_gets_openai_error(stack, body, what) -> None:  # type: ignore[no-untyped-def]
    router = stack[3]
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(
        router.url + "/v1/completions", headers={"content-type": "application/json"}, timeout=30, **kw
    )
    assert r.status_code == (404 if what == "model" else 400), r.text  # OpenAI: an unknown model is 404
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert what in json.dumps(err), err
    assert r.headers.get("x-request-id")


def test_no_decode_service_gives_503(stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.support.cluster import free_port

    cluster = Cluster(None, str(tmp_path))
    try:
        lonely = cluster.start(
            "router",
            "--decode-urls",
            f"http://127.0.0.1:{free_port()}",
            "--prefill-urls",
            f"http://127.0.0.1:{free_port()}",
        )
        r = httpx.post(lonely.url + "/v1/completions", json={"model": "default", "prompt": "hi"}, timeout=30)
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        assert r.json()["error"]["message"]
    finally:
        cluster.stop()


@pytest.mark.parametrize("prompt", [LONG[1], SHORT[1]], ids=["split", "local"])
def test_disconnect_cancels_and_frees_blocks(stack, prompt) -> None:  # type: ignore[no-untyped-def]
    cluster, prefill, decode_, router = stack
    # far more than the tiny model generates while the client reads 3 events: it leaves mid-stream
    body = {"model": "default", "prompt": prompt, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        request_id = r.headers["x-request-id"]
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break  # leaving the block drops the connection mid-stream
    for proc in (prefill, decode_):
        h = cluster.wait_blocks_free(proc)
        assert h["free_blocks"] == h["total_blocks"], f"{proc.role} kept blocks of a cancelled request: {h}"
    deadline = time.monotonic() + 10
    while (rec := record(router.url, request_id))["state"] != "cancelled" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rec["state"] == "cancelled", rec


def test_the_hop_floor_forwards_to_the_decode_service(stack, tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """bench serving's baseline (bench/hop_floor.py) is a real hop: the decode service's greedy tokens
    for the ids it was sent, the blocks freed after."""
    cluster, _, decode_, _ = stack
    model, tok = tiny
    ids = tok.encode(SHORT[0])
    floor_cluster = Cluster(None, str(tmp_path))
    try:
        floor = floor_cluster.start("hop-floor", "--decode-url", decode_.url, module="bench.hop_floor")
        r = httpx.post(floor.url + "/v1/completions", json={"prompt_ids": ids, "max_tokens": 6}, timeout=60)
        assert r.status_code == 200, r.text
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1))
        want = engine.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
        assert r.json()["token_ids"] == want.token_ids
        h = cluster.wait_blocks_free(decode_)
        assert h["free_blocks"] == h["total_blocks"], h
    finally:
        floor_cluster.stop()
