"""The router's request flow against fake decode/prefill services: split and local paths, token
de-duplication, stop strings, UTF-8 safe streaming, usage, retries, disconnects, deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx
import pytest

from tests.support.router_fakes import FakeCluster, FakeState, make_router, model_info, sse_events

pytestmark = pytest.mark.anyio
TEXT = "Hello wörld 😀 and the end. More text here"
LONG_PROMPT = "one two three four five six seven eight nine ten " * 8  # > 32 tokens: split path


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def out_ids() -> list[int]:
    ids = model_info().tokenizer.encode(TEXT, add_special_tokens=False)
    tok = model_info().tokenizer
    # The test is only meaningful if the emoji really is split across two byte-level tokens.
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    return ids


def _texts(events: list[Any]) -> list[str]:
    return [c["choices"][0]["text"] for c in events if isinstance(c, dict) and c.get("choices")]


async def _stream(client: Any, body: dict[str, Any], path: str = "/v1/completions") -> tuple[Any, list[Any]]:
    resp = await client.post(path, json={"model": "default", "stream": True, **body})
    return resp, sse_events(resp.text)


async def test_split_path_streams_first_token_then_rest_without_duplicates(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    async with make_router(cluster) as client:
        resp, events = await _stream(client, {"prompt": LONG_PROMPT, "max_tokens": 100})
    assert resp.status_code == 200 and resp.headers["x-splitserve-route"] == "split"
    assert resp.headers["x-request-id"].startswith("cmpl-")
    assert events[-1] == "[DONE]"
    texts = _texts(events)
    assert "".join(texts) == TEXT
    assert all("\ufffd" not in t for t in texts)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    # one reservation in remote mode, one prefill call that used its blocks and fence
    (_, gen), = cluster.generate_calls  # fmt: skip
    (_, pre), = cluster.prefill_calls  # fmt: skip
    assert gen.mode == "remote" and pre.block_ids == [7, 8, 9] and pre.kv_endpoint == "tcp://decode:9000"
    assert pre.token_ids == gen.token_ids and pre.deadline == gen.deadline and pre.deadline is not None
    assert not cluster.closed_early


async def test_local_path_for_short_prompt_and_without_prefill_worker(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    async with make_router(cluster) as client:
        resp = await client.post(
            "/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 50}
        )
    assert resp.headers["x-splitserve-route"] == "local; reason=short_prompt"
    assert resp.json()["choices"][0]["text"] == TEXT
    assert cluster.generate_calls[0][1].mode == "local" and not cluster.prefill_calls
    async with make_router(cluster, prefills=()) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": LONG_PROMPT})
        metrics = (await client.get("/metrics")).text
    assert resp.headers["x-splitserve-route"] == "local; reason=no_prefill_worker"
    assert 'route_decisions_total{reason="no_prefill_worker",route="local"} 1.0' in metrics


async def test_usage_and_length_finish(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    async with make_router(cluster) as client:
        resp = await client.post(
            "/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 3}
        )
        body = resp.json()
        n_prompt = len(model_info().tokenizer.encode("Hi"))
        assert body["usage"] == {
            "prompt_tokens": n_prompt,
            "completion_tokens": 3,
            "total_tokens": n_prompt + 3,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["object"] == "text_completion" and body["id"] == resp.headers["x-request-id"]
        _, events = await _stream(
            client, {"prompt": LONG_PROMPT, "max_tokens": 4, "stream_options": {"include_usage": True}}
        )
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 4
    assert events[-3]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("chunk", [1, 3])
async def test_stop_string_across_tokens_never_leaks(out_ids: list[int], chunk: int) -> None:
    cluster = FakeCluster(out_ids, chunk=chunk, delay_s=0.01)  # D still busy when the stop hits
    async with make_router(cluster) as client:
        # " the end" is two tokens (" the", " end"): the first must be held back, then dropped.
        resp, events = await _stream(client, {"prompt": LONG_PROMPT, "stop": [" the end", "zzz"]})
        texts = _texts(events)
        assert "".join(texts) == "Hello wörld 😀 and"
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        await asyncio.sleep(0.05)
        assert cluster.closed_early  # the router closed D's stream: D aborts and frees the blocks
        resp = await client.post(
            "/v1/completions", json={"model": "default", "prompt": "Hi", "stop": "More", "max_tokens": 64}
        )
    body = resp.json()
    assert body["choices"][0]["text"] == "Hello wörld 😀 and the end. "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 11  # through " More", the token that completed the stop


async def test_chat_stream_roles_and_content(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids, chunk=1)
    async with make_router(cluster) as client:
        resp, events = await _stream(
            client, {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions"
        )
        assert resp.headers["x-request-id"].startswith("chatcmpl-")
        chunks = [e for e in events if isinstance(e, dict)]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert content == TEXT and all(
            "\ufffd" not in c["choices"][0]["delta"].get("content", "") for c in chunks
        )
        resp = await client.post(
            "/v1/chat/completions", json={"model": "default", "messages": [{"role": "user", "content": "hi"}]}
        )
    msg = resp.json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": TEXT}


async def test_prefill_failure_retries_on_another_worker_with_new_reservation(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    cluster.failing.add("p1")
    async with make_router(cluster, prefills=("p1", "p2")) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": LONG_PROMPT})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == TEXT
    assert [n for n, _ in cluster.prefill_calls] == ["p1", "p2"]
    fences = [p.fence for _, p in cluster.prefill_calls]
    assert fences[0] != fences[1] and len(cluster.generate_calls) == 2
    assert ("decode", cluster.generate_calls[0][1].request_id) in cluster.aborts


async def test_prefill_failure_without_spare_falls_back_to_the_decode_service(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    cluster.failing.add("prefill")
    async with make_router(cluster) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": LONG_PROMPT})
        metrics = (await client.get("/metrics")).text
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == TEXT
    assert resp.headers["x-splitserve-route"] == "local; reason=prefill_failed"
    assert [g.mode for _, g in cluster.generate_calls] == ["remote", "local"]
    assert cluster.closed_early  # the first reservation on D was released
    assert 'splitserve_router_transfer_failures_total{outcome="recomputed",policy="retry"} 1.0' in metrics


async def test_prefill_failure_with_policy_fail_is_a_502(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    cluster.failing.add("prefill")
    async with make_router(cluster, transfer_failure_policy="fail") as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": LONG_PROMPT})
    assert resp.status_code == 502 and "prefill failed" in resp.json()["error"]["message"]
    assert resp.headers["x-splitserve-route"] == "split" and cluster.closed_early


@pytest.mark.parametrize("prompt", ["Hi", LONG_PROMPT], ids=["local", "split"])
@pytest.mark.parametrize("fault", ["break", "stall"])
async def test_a_failed_decode_stream_migrates_and_the_text_goes_on(
    out_ids: list[int], prompt: str, fault: str
) -> None:
    """d1 breaks (or stops sending) once it reaches output 5; the router moves the request to d2 with
    the prompt plus the tokens already sent, and the client sees one uninterrupted text."""
    cluster = FakeCluster(out_ids)
    cluster.fail_on = {"d1": (fault, 5)}
    async with make_router(cluster, decodes=("d1", "d2"), decode_stall_s=0.5) as client:
        resp, events = await _stream(client, {"prompt": prompt, "max_tokens": 100})
        metrics = (await client.get("/metrics")).text
    assert resp.status_code == 200 and not [e for e in events if isinstance(e, dict) and "error" in e]
    assert "".join(_texts(events)) == TEXT
    (name1, first), (name2, moved) = cluster.generate_calls
    assert (name1, name2) == ("d1", "d2")
    n = moved.num_output_tokens  # what the client had when d1 failed (frames carry 2 tokens)
    assert n >= 5 and moved.token_ids == first.token_ids + out_ids[:n]
    if prompt == LONG_PROMPT:  # the prefill service computed prompt + n tokens and sampled the next
        assert cluster.prefill_calls[-1][1].num_output_tokens == n
    reason = "stalled" if fault == "stall" else "lost"
    assert f'splitserve_router_migrations_total{{reason="{reason}"}} 1.0' in metrics


@pytest.mark.parametrize("prefills", [("p1",), ("p1", "p2")])
async def test_a_decode_lost_while_its_kv_is_written_is_placed_again_without_a_409(
    out_ids: list[int], prefills: tuple[str, ...]
) -> None:
    """d1 dies while p1 writes the prompt's KV into it. The request moves to d2, through p1 again when it
    ranks first: p1 must have let go of the request id by then, or it refuses it (409)."""
    cluster = FakeCluster(out_ids)
    cluster.dies_in_prefill = {"d1"}
    async with make_router(cluster, decodes=("d1", "d2"), prefills=prefills) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": LONG_PROMPT})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == TEXT
    assert [n for n, _ in cluster.generate_calls] == ["d1", "d2"]
    assert (
        cluster.prefill_calls[0][0] == "p1"
        and ("p1", cluster.prefill_calls[0][1].request_id) in cluster.aborts
    )


async def test_a_decode_lost_before_its_reserved_frame_is_not_tried_again(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    cluster.dies_before_reserved = {"d1"}
    async with make_router(cluster, decodes=("d1", "d2"), max_migrations=3) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
    assert resp.status_code == 200, resp.text
    assert [n for n, _ in cluster.generate_calls] == ["d1", "d2"]


async def test_migrations_are_bounded(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    cluster.fail_on = {"d1": ("break", 3), "d2": ("break", 6)}
    async with make_router(cluster, decodes=("d1", "d2"), max_migrations=1) as client:
        _, events = await _stream(client, {"prompt": "Hi", "max_tokens": 100})
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
        metrics = (await client.get("/metrics")).text
    assert "gave up after 1 migration" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    text = "".join(_texts(events))
    assert text and TEXT.startswith(text)  # what was shown is right, and nothing was shown twice
    assert resp.status_code == 502  # the second request: d1 and d2 both fail it before its end
    assert 'splitserve_router_migrations_total{reason="gave_up"} 2.0' in metrics


async def read_again(client: httpx.AsyncClient, state: FakeState) -> None:
    """Until the router has read the registry again (its /health asks for the worker list, which a
    read in the background refreshes): what the test changed there is what it routes on next."""
    reads = state.registry.reads["decode"]
    deadline = time.monotonic() + 10
    while state.registry.reads["decode"] == reads:
        assert time.monotonic() < deadline, "the router never read the registry again"
        state.registry.read.clear()
        await client.get("/health")  # asks for the list: a read starts once the list is old enough
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.registry.read.wait(), 0.5)


async def test_overloaded_decode_services_shed_load_with_retry_after(out_ids: list[int]) -> None:
    state = FakeState()
    state.registry.workers = {"decode": [("d1", {"waiting": 9}), ("d2", {"waiting": 4})]}
    cluster = FakeCluster(out_ids, state=state)
    async with make_router(cluster, decodes=("d1", "d2"), static=False, max_decode_queue=4) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert "4+ requests waiting" in resp.json()["error"]["message"]
        state.registry.workers["decode"][1] = ("d2", {"waiting": 3})
        await read_again(client, state)
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
        assert resp.status_code == 200
        assert 'splitserve_router_shed_total{reason="queue_depth"} 1.0' in (await client.get("/metrics")).text


async def test_a_request_that_cannot_start_in_time_is_refused_up_front(out_ids: list[int]) -> None:
    state = FakeState()
    state.registry.workers = {"decode": [("d1", {"queue_wait_s": 9.0}), ("d2", {"queue_wait_s": 2.5})]}
    cluster = FakeCluster(out_ids, state=state)
    async with make_router(cluster, decodes=("d1", "d2"), static=False, start_timeout_s=2) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert "could not start in time" in resp.json()["error"]["message"]
        assert not cluster.generate_calls  # refused before any work
        state.registry.workers["decode"][1] = ("d2", {"queue_wait_s": 0.4})
        await read_again(client, state)
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
        assert resp.status_code == 200 and [n for n, _ in cluster.generate_calls] == ["d2"]
        assert 'splitserve_router_shed_total{reason="queue_wait"} 1.0' in (await client.get("/metrics")).text


@pytest.mark.parametrize("path", ["local", "split"])
async def test_no_first_token_within_start_timeout_is_a_503_and_frees_the_work(
    out_ids: list[int], path: str
) -> None:
    state = FakeState()
    cluster = FakeCluster(out_ids, state=state)
    if path == "local":
        cluster.hang_after = 0  # the decode service never produces a first token
    else:
        cluster.prefill_hangs = True  # the prefill service never answers
    prompt = "Hi" if path == "local" else LONG_PROMPT
    async with make_router(cluster, start_timeout_s=0.3) as client:
        body = {"model": "default", "prompt": prompt, "stream": True}
        resp = await client.post("/v1/completions", json=body)
        metrics = (await client.get("/metrics")).text
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert "could not start within 0.3 s" in resp.json()["error"]["message"]
    assert 'splitserve_router_shed_total{reason="start_timeout"} 1.0' in metrics
    rid = resp.headers["x-request-id"]
    assert cluster.closed_early == [rid]  # the decode stream (and its reservation) was let go
    assert (path == "split") == (("prefill", rid) in cluster.aborts)  # a hung prefill is aborted
    assert state.records[rid]["state"] == "failed" and "could not start" in state.records[rid]["error"]


async def test_busy_decode_is_skipped_and_all_busy_is_503(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    cluster.busy.add("d1")
    async with make_router(cluster, decodes=("d1", "d2")) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
        assert resp.status_code == 200 and [n for n, _ in cluster.generate_calls] == ["d1", "d2"]
        cluster.busy.add("d2")
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi", "stream": True})
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["type"] == "service_unavailable"


async def test_decode_error_frame_mid_stream(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    cluster.error_after = 4
    async with make_router(cluster) as client:
        _, events = await _stream(client, {"prompt": "Hi"})
        # the client learns that the decode service failed, never its words (they go to the log)
        message = events[-2]["error"]["message"]
        assert "decode exploded" not in message and "decode service failed" in message, message
        assert events[-1] == "[DONE]"
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
    assert resp.status_code == 502 and "decode exploded" not in resp.json()["error"]["message"]


async def test_deadline_exceeded_is_504(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    cluster.hang_after = 2
    async with make_router(cluster, request_timeout_s=0.3) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"
    await asyncio.sleep(0.05)
    assert cluster.closed_early


async def test_client_disconnect_closes_upstream(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    cluster.hang_after = 3
    async with make_router(cluster, served_model_name="m") as client:
        body = {"model": "default", "prompt": "Hi", "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break  # got a token; now walk away
        labels = 'endpoint="completions",model="m",status="cancelled"'
        cancelled = f"splitserve_router_requests_total{{{labels}}} 1.0"
        for _ in range(200):
            if cancelled in (await client.get("/metrics")).text:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the request was never counted as cancelled")
    assert cluster.closed_early == [cluster.generate_calls[0][1].request_id]


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_while_prefilling_aborts_prefill_and_decode(
    out_ids: list[int], stream: bool
) -> None:
    cluster = FakeCluster(out_ids)
    cluster.prefill_hangs = True
    async with make_router(cluster) as client:
        body = {"model": "default", "prompt": LONG_PROMPT, "stream": stream}
        call = asyncio.ensure_future(client.post("/v1/completions", json=body))
        while not cluster.prefill_calls:
            await asyncio.sleep(0.01)
        call.cancel()
        rid = cluster.prefill_calls[0][1].request_id
        for _ in range(200):
            if ("prefill", rid) in cluster.aborts and cluster.closed_early:
                break
            await asyncio.sleep(0.01)
        assert ("prefill", rid) in cluster.aborts and cluster.closed_early == [rid]


async def test_non_streaming_disconnect_cancels(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    cluster.hang_after = 3
    async with make_router(cluster) as client:
        call = asyncio.ensure_future(
            client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
        )
        while not cluster.generate_calls:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        call.cancel()
        for _ in range(200):
            if cluster.closed_early:
                break
            await asyncio.sleep(0.01)
    assert cluster.closed_early == [cluster.generate_calls[0][1].request_id]


async def test_request_records_follow_the_state_machine(out_ids: list[int]) -> None:
    state = FakeState()
    cluster = FakeCluster(out_ids, state=state)
    async with make_router(cluster) as client:
        split = await client.post("/v1/completions", json={"model": "default", "prompt": LONG_PROMPT})
        local = await client.post(
            "/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 3}
        )
        record = (await client.get(f"/v1/requests/{split.json()['id']}")).json()
    sid, lid = split.json()["id"], local.json()["id"]
    assert state.states(sid) == ["queued", "reserved", "prefilling", "transferring", "decoding", "finished"]
    assert state.states(lid) == ["queued", "reserved", "decoding", "finished"]
    assert record["state"] == "finished" and record["route"] == "split"
    assert record["decode_id"] == "decode-id" and record["prefill_id"] == "http://prefill"
    assert record["output_tokens"] == len(out_ids) and record["finish_reason"] == "stop"
    assert record["prompt_tokens"] == split.json()["usage"]["prompt_tokens"]
    assert (
        state.records[lid]["route"] == "local:short_prompt"
        and state.records[lid]["finish_reason"] == "length"
    )


async def test_failed_and_cancelled_requests_are_recorded(out_ids: list[int]) -> None:
    state = FakeState()
    cluster = FakeCluster(out_ids, state=state)
    cluster.failing.add("prefill")
    async with make_router(cluster, transfer_failure_policy="fail") as client:
        failed = await client.post("/v1/completions", json={"model": "default", "prompt": LONG_PROMPT})
    assert failed.status_code == 502
    (rid,) = state.records
    assert state.records[rid]["state"] == "failed" and "prefill failed" in state.records[rid]["error"]


async def test_several_prompts_are_requests_of_their_own(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    prompts = ["Hi", "Hello there", "Hey"]
    async with make_router(cluster) as client:
        resp = await client.post(
            "/v1/completions", json={"model": "default", "prompt": prompts, "max_tokens": 3}
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        texts = {c["text"] for c in body["choices"]}
        assert len(texts) == 1 and texts.pop()  # the fake generates the same tokens for every prompt
        n_prompt = sum(len(model_info().tokenizer.encode(p)) for p in prompts)
        assert body["usage"]["prompt_tokens"] == n_prompt and body["usage"]["completion_tokens"] == 9
        ids = resp.headers["x-splitserve-request-ids"].split(",")
        assert ids == [f"{body['id']}-{i}" for i in range(3)] and resp.headers["x-request-id"] == body["id"]
        assert sorted(g.request_id for _, g in cluster.generate_calls) == ids  # three requests upstream

        stream = await client.post(
            "/v1/completions",
            json={"model": "default", "prompt": prompts, "max_tokens": 3, "stream": True,
                  "stream_options": {"include_usage": True}},
        )  # fmt: skip
        events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        by_index: dict[int, str] = {}
        finishes = set()
        for c in chunks[:-1]:
            (choice,) = c["choices"]
            by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes.add(choice["index"])
        assert finishes == {0, 1, 2} and set(by_index.values()) == {body["choices"][0]["text"]}
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9


async def test_n_choices_are_requests_with_consecutive_seeds(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 10,
            "max_tokens": 3, "temperature": 0.5}  # fmt: skip
    async with make_router(cluster) as client:
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        choices = resp.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        assert all(c["message"]["role"] == "assistant" and c["message"]["content"] for c in choices)
        seeds = sorted(g.sampling.seed for _, g in cluster.generate_calls)
        assert seeds == [10, 11, 12]
        assert resp.json()["usage"]["completion_tokens"] == 9


async def test_fallbacks_and_shedding_are_span_events(
    out_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where operators look: the request's span says a prefill failed (and what the policy did) and
    that it was shed (and why)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common.runtime import telemetry
    from router import outcome

    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(outcome, "_tracer", provider.get_tracer("test"))  # a local provider, not the global
    monkeypatch.setattr(telemetry, "_enabled", True)  # as with an OTLP endpoint: spans are made current

    def root_events() -> list[tuple[str, dict[str, Any]]]:
        (root,) = [s for s in spans.get_finished_spans() if s.name.startswith("text_completion")]
        spans.clear()
        return [(e.name, dict(e.attributes or {})) for e in root.events]

    cluster = FakeCluster(out_ids)
    cluster.failing.add("p1")
    async with make_router(cluster, prefills=("p1", "p2")) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": LONG_PROMPT})
    assert resp.status_code == 200
    [(name, attrs)] = root_events()
    assert name == "splitserve.prefill_failed" and attrs["splitserve.prefill_id"] == "http://p1"
    assert attrs["splitserve.policy"] == "retry" and attrs["splitserve.outcome"] == "retried"

    state = FakeState()
    state.registry.workers = {"decode": [("d1", {"waiting": 9})]}
    cluster = FakeCluster(out_ids, state=state)
    async with make_router(cluster, decodes=("d1",), static=False, max_decode_queue=4) as client:
        resp = await client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
    assert resp.status_code == 503
    assert root_events() == [("splitserve.shed", {"splitserve.reason": "queue_depth"})]


async def test_choice_seeds_wrap_within_int64(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    body = {"model": "default", "prompt": "Hi", "n": 2, "seed": 2**63 - 1, "max_tokens": 2, "temperature": 1}
    async with make_router(cluster) as client:
        resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert sorted(g.sampling.seed for _, g in cluster.generate_calls) == [-(2**63), 2**63 - 1]


async def test_tenant_and_priority_headers_reach_the_services(out_ids: list[int]) -> None:
    cluster = FakeCluster(out_ids)
    async with make_router(cluster) as client:
        headers = {"x-splitserve-tenant": "acme", "x-splitserve-priority": "-3"}
        body = {"model": "default", "prompt": LONG_PROMPT, "max_tokens": 5}
        assert (await client.post("/v1/completions", json=body, headers=headers)).status_code == 200
        for bad in ({"x-splitserve-tenant": "no spaces"}, {"x-splitserve-priority": "urgent"}):
            resp = await client.post("/v1/completions", json=body, headers=bad)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == next(iter(bad))
    (_, gen), = cluster.generate_calls  # fmt: skip
    (_, pre), = cluster.prefill_calls  # fmt: skip
    assert (gen.tenant, gen.priority, pre.tenant, pre.priority) == ("acme", -3, "acme", -3)


async def test_latency_targets_pick_a_placement_that_meets_them_or_refuse_at_once(out_ids: list[int]) -> None:
    state = FakeState()
    slow = {"prefill_tps": 100.0, "queued_tokens": 2000, "decode_step_ms": 20.0, "running": 1}
    fast = {"prefill_tps": 2000.0, "queued_tokens": 0, "decode_step_ms": 20.0, "running": 3}
    state.registry.workers = {"decode": [("d1", slow), ("d2", fast)]}  # d1 first by load alone
    cluster = FakeCluster(out_ids, state=state)
    async with make_router(cluster, decodes=("d1", "d2"), static=False) as client:
        body = {"model": "default", "prompt": "Hi", "max_tokens": 5}
        resp = await client.post("/v1/completions", json=body, headers={"x-splitserve-ttft-slo-ms": "500"})
        assert resp.status_code == 200 and [n for n, _ in cluster.generate_calls] == ["d2"]
        # 20 s of queue on d1, 20 ms steps shared by 4 on d2: 1 ms per token is out of reach
        resp = await client.post("/v1/completions", json=body, headers={"x-splitserve-tpot-slo-ms": "1"})
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        err = resp.json()["error"]
        assert err["code"] == "slo_unattainable" and "TPOT 27 ms" in err["message"], err
        assert len(cluster.generate_calls) == 1, "refused before any work"
        resp = await client.post("/v1/completions", json=body, headers={"x-splitserve-ttft-slo-ms": "soon"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-splitserve-ttft-slo-ms"
        assert 'splitserve_router_shed_total{reason="slo"} 1.0' in (await client.get("/metrics")).text
