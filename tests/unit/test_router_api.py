"""The router's HTTP surface: validation errors in OpenAI's shape, models, health, metrics, records,
request ids, 503 without decode services, and that importing the router does not import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from common.sampling_params import SamplingParams
from router.app import create_app
from router.config import RouterConfig
from router.errors import install_handlers
from tests.support.router_fakes import FakeCluster, make_router, model_info

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster(model_info().tokenizer.encode(" fine thanks", add_special_tokens=False))


RF, SO = "response_format", "structured_outputs"
BAD: list[tuple[str, dict[str, Any], str | None]] = [
    (COMPLETIONS, {"prompt": "hi"}, "model"),
    (COMPLETIONS, {"model": "default"}, "prompt"),
    (COMPLETIONS, {"model": "default", "prompt": 5}, "prompt"),
    (COMPLETIONS, {"model": "default", "prompt": ["a", ""]}, "prompt"),
    (COMPLETIONS, {"model": "default", "prompt": ["a"] * 65}, "prompt"),
    (COMPLETIONS, {"model": "default", "prompt": [[1, 2], [3, 10**9]]}, "prompt.1"),
    (COMPLETIONS, {"model": "default", "prompt": [1, 10**9]}, "prompt"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "temperature": -0.1}, "temperature"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "temperature": 2.5}, "temperature"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "top_k": 2**64}, "top_k"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "seed": 2**63}, "seed"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "n": 0}, "n"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "n": 17}, "n"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "best_of": 3, "stream": True}, "best_of"),
    (COMPLETIONS, {"model": "default", "prompt": ["a"] * 64, "best_of": 3}, "n"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "logprobs": 6}, "logprobs"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "best_of": 17}, "best_of"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "suffix": "x"}, "suffix"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "stop": 3}, "stop"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "min_p": 1.5}, "min_p"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", RF: {"type": "xml"}}, "response_format.type"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", RF: {"type": "json_schema"}}, "response_format"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", SO: {"regex": "("}}, "structured_outputs.regex"),
    (COMPLETIONS, {"model": "default", "prompt": "hi", SO: {"regex": "a", "choice": ["b"]}}, SO + ".choice"),
    (
        COMPLETIONS,
        {"model": "default", "prompt": "hi", RF: {"type": "json_object"}, SO: {"regex": "a"}},
        SO + ".regex",
    ),
    (COMPLETIONS, {"model": "default", "prompt": "hi", "max_tokens": 9000}, "max_tokens"),
    (COMPLETIONS, {"model": "default", "prompt": "hi " * 9000}, "prompt"),
    (CHAT, {"model": "default"}, "messages"),
    (CHAT, {"model": "default", "messages": "hi"}, "messages"),
    (CHAT, {"model": "default", "messages": []}, "messages"),
    (CHAT, {"model": "default", "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (CHAT, {"model": "default", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    (CHAT, {"model": "default", "messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"model": "default", "messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"model": "default", "messages": MSGS, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"model": "default", "messages": MSGS, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"model": "default", "messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
async def test_bad_requests_are_openai_400s(
    cluster: FakeCluster, path: str, body: dict[str, Any], param: str | None
) -> None:
    async with make_router(cluster) as client:
        resp = await client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert resp.headers["x-request-id"]
    assert not cluster.generate_calls  # nothing reached a worker


async def test_context_length_message_names_both_numbers(cluster: FakeCluster) -> None:
    async with make_router(cluster) as client:
        resp = await client.post(COMPLETIONS, json={"model": "default", "prompt": "hi", "max_tokens": 9000})
    msg = resp.json()["error"]["message"]
    assert "8192" in msg and "9001" in msg and resp.json()["error"]["code"] == "context_length_exceeded"


async def test_malformed_json(cluster: FakeCluster) -> None:
    async with make_router(cluster) as client:
        resp = await client.post(
            COMPLETIONS, content=b"{not json", headers={"content-type": "application/json"}
        )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"


async def test_sampling_sent_to_services_and_extras_accepted(cluster: FakeCluster) -> None:
    body = {"model": "default", "messages": MSGS, "user": "u1", "metadata": {"a": 1}, "seed": 7, "top_k": 5,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    async with make_router(cluster) as client:
        resp = await client.post(CHAT, json=body)
    assert resp.status_code == 200, resp.text
    sampling = cluster.generate_calls[0][1].sampling
    assert sampling == SamplingParams(max_tokens=256, temperature=0.0, top_k=5, seed=7, ignore_eos=True)


async def test_no_decode_service_is_503_with_retry_after(cluster: FakeCluster) -> None:
    async with make_router(cluster, decodes=()) as client:
        resp = await client.post(COMPLETIONS, json={"model": "default", "prompt": "hi", "stream": True})
        health = (await client.get("/health")).json()
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["type"] == "service_unavailable" and resp.headers["x-request-id"]
    assert health == {"status": "ok", "decode_workers": 0, "prefill_workers": 1}


async def test_models_metrics_records_and_request_ids(cluster: FakeCluster) -> None:
    async with make_router(cluster, served_model_name="smol") as client:
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["smol"] and models["object"] == "list"
        ok = await client.post(COMPLETIONS, json={"model": "smol", "prompt": "hi"})
        assert ok.status_code == 200 and ok.headers["x-request-id"] == ok.json()["id"]
        missing = await client.get(f"/v1/requests/{ok.json()['id']}")  # no Redis in unit tests
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"
        metrics = await client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["x-request-id"].startswith("req-")
    text = metrics.text
    finished = 'splitserve_router_requests_total{endpoint="completions",model="smol",status="finished"} 1.0'
    assert finished in text
    assert 'splitserve_router_ttft_seconds_count{route="local"} 1.0' in text
    assert "splitserve_router_e2e_seconds_bucket" in text and "splitserve_router_itl_seconds" in text


async def test_two_apps_in_one_process_have_separate_metrics() -> None:
    info = model_info()
    a, b = create_app(RouterConfig(), None, info), create_app(RouterConfig(), None, info)
    assert a.state.metrics.registry is not b.state.metrics.registry


async def test_framework_validation_errors_are_400_not_422() -> None:
    app = FastAPI()
    install_handlers(app)

    @app.get("/items/{n}")
    async def item(n: int) -> int:
        return n

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
        resp = await client.get("/items/abc")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "path.n"


def test_router_does_not_import_torch() -> None:
    code = "import sys, router.app, router.orchestrator; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# ---- limits on the request itself (docs/security.md) ----


async def test_a_body_over_the_limit_is_413_before_anything_runs(cluster: FakeCluster) -> None:
    big = {"model": "default", "prompt": "x" * 4096}
    async with make_router(cluster, max_body_bytes=2048) as client:
        declared = await client.post(COMPLETIONS, json=big)  # refused by its Content-Length

        async def chunks():  # type: ignore[no-untyped-def]
            for _ in range(8):  # no Content-Length: refused once it grows past the limit
                yield b" " * 512

        streamed = await client.post(
            COMPLETIONS, content=chunks(), headers={"content-type": "application/json"}
        )
        small = await client.post(COMPLETIONS, json={"model": "default", "prompt": "hi"})
    for r in (declared, streamed):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert small.status_code == 200
    assert len(cluster.generate_calls) == 1  # only the small one reached a worker


async def test_a_long_stop_sequence_is_400(cluster: FakeCluster) -> None:
    async with make_router(cluster, max_stop_chars=8) as client:
        resp = await client.post(COMPLETIONS, json={"model": "default", "prompt": "hi", "stop": ["x" * 9]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop"
    assert not cluster.generate_calls


@pytest.mark.parametrize("opt_in", [False, True])
async def test_prompts_and_completions_reach_spans_only_when_opted_in(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch, opt_in: bool
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from router import outcome

    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(outcome, "_tracer", provider.get_tracer("test"))  # a local provider, not the global
    async with make_router(cluster, log_content=opt_in) as client:
        resp = await client.post(
            CHAT, json={"model": "default", "messages": [{"role": "user", "content": "secret"}]}
        )
    assert resp.status_code == 200, resp.text
    (root,) = [s for s in spans.get_finished_spans() if s.name.startswith("chat ")]
    attrs = dict(root.attributes or {})
    assert attrs["gen_ai.usage.input_tokens"] > 0  # the span is there either way
    if opt_in:
        assert "secret" in attrs["gen_ai.input.messages"] and "fine thanks" in attrs["gen_ai.output.messages"]
    else:
        assert not any("secret" in str(v) or "fine" in str(v) for v in attrs.values())


def test_the_url_a_router_registers_for_the_planner(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """RouterConfig.metrics_url: the bind address, the advertised one, a wildcard's own hostname's
    address, https with a certificate; none where the port is chosen at bind time."""
    import socket

    assert RouterConfig(port=8000).metrics_url() == "http://127.0.0.1:8000"
    assert RouterConfig(port=8000, host="0.0.0.0", advertise_host="10.1.2.3").metrics_url() == (
        "http://10.1.2.3:8000"
    )
    assert RouterConfig(
        port=8443, advertise_host="fd00::7", ssl_certfile="c", ssl_keyfile="k"
    ).metrics_url() == ("https://[fd00::7]:8443")
    assert RouterConfig(port=0).metrics_url() is None
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    assert RouterConfig(port=8000, host="0.0.0.0").metrics_url() == "http://127.0.0.1:8000"
    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    assert RouterConfig(port=8000, host="0.0.0.0").metrics_url() is None
