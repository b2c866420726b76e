"""Two models behind one router (issue 28, point 5), with real processes: Redis, one router serving the
real SmolLM2 as `smol` and the tiny random-weight test model as `tiny`, each model with its own prefill
and decode service. Each request is served by its own model's services only (its record in Redis says
which), /v1/models lists both, an unknown model is OpenAI's 404 model_not_found, and the official
`openai` client works with both. Then `splitserve up --model A --model B` brings up the same shape."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.cluster.redis_server import RedisServer
from tests.support.cluster import Cluster, Proc, free_port, get_json, wait_until
from tests.support.tiny_model import real_model_path, tiny_model_path
from tests.support.up import start_up

pytestmark = [pytest.mark.services, pytest.mark.real_model]
FLAGS = ("--threads", "1", "--kv-cache-mb", "64")
QUESTION = "What is the capital of France?"
# long enough (> local_prefill_threshold tokens) for the split route: the model's prefill service runs too
LONG = "Please answer in one short sentence, without any preamble or explanation at all. " * 3 + QUESTION


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("multi")
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp))
    real = real_model_path()
    try:
        for name, model in (("smol", real), ("tiny", tiny_model_path())):
            for role in ("prefill", "decode"):
                c.start(role, *FLAGS, "--worker-id", f"{name}-{role}", "--served-model-name", name,
                        env={"SPLITSERVE_MODEL": model})  # fmt: skip
        router = c.start(
            "router", "--model", real, "--model", tiny_model_path(),
            "--served-model-name", "smol", "--served-model-name", "tiny",
        )  # fmt: skip
        c.wait_routed()
        yield router
    finally:
        c.stop()
        redis.stop()


def test_each_request_is_served_by_its_own_models_services(stack: Proc) -> None:
    health = get_json(stack.url + "/health")
    assert health["models"] == {
        "smol": {"decode_workers": 1, "prefill_workers": 1},
        "tiny": {"decode_workers": 1, "prefill_workers": 1},
    }
    answers = {}
    for name in ("smol", "tiny", "smol"):
        # and back to the first: its prompt may now be in smol-decode's prefix cache (once the KV index
        # has the event), and then runs there locally
        body = {
            "model": name,
            "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 12,
            "temperature": 0,
        }
        r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        record = get_json(f"{stack.url}/v1/requests/{r.json()['id']}")
        assert r.json()["model"] == record["model"] == name and record["decode_id"] == f"{name}-decode"
        if name not in answers:  # the first time: a long prompt, split
            assert r.headers["x-splitserve-route"] == "split"
        if r.headers["x-splitserve-route"] == "split":
            assert record["prefill_id"] == f"{name}-prefill"
        else:
            assert r.headers["x-splitserve-route"].startswith("local; reason=cached_prefix"), r.headers
        answers[name] = r.json()
    assert "Paris" in answers["smol"]["choices"][0]["message"]["content"]  # the real model answered
    assert answers["smol"]["system_fingerprint"] != answers["tiny"]["system_fingerprint"]
    # the router rendered each with its own model's tokenizer: /tokenize agrees with the usage counted
    for name, answer in answers.items():
        tok = httpx.post(
            stack.url + "/tokenize", json={"model": name, "messages": [{"role": "user", "content": LONG}]}
        )
        assert tok.status_code == 200 and tok.json()["count"] == answer["usage"]["prompt_tokens"]
    counted = requests_counted(stack)  # the request counters' `model` label
    assert counted['endpoint="chat",model="smol",status="finished"'] >= 2
    assert counted['endpoint="chat",model="tiny",status="finished"'] >= 1


def requests_counted(router: Proc) -> dict[str, float]:
    """splitserve_router_requests_total by its labels, as the router's /metrics has it now."""
    return {
        line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
        for line in httpx.get(router.url + "/metrics").text.splitlines()
        if line.startswith("splitserve_router_requests_total{")
    }


def test_v1_models_lists_both_and_an_unknown_model_is_404(stack: Proc) -> None:
    models = get_json(stack.url + "/v1/models")["data"]
    assert [m["id"] for m in models] == ["smol", "tiny"]
    r = httpx.post(stack.url + "/v1/completions", json={"model": "gpt-4", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404
    assert r.json()["error"] | {"message": ""} == {
        "message": "", "type": "invalid_request_error", "param": "model", "code": "model_not_found",
    }  # fmt: skip
    # refused before it named a served model: counted under _none
    assert requests_counted(stack)['endpoint="completions",model="_none",status="rejected"'] >= 1


def test_the_openai_client_works_with_both_models(stack: Proc) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    assert sorted(m.id for m in client.models.list()) == ["smol", "tiny"]
    for name in ("smol", "tiny"):
        out = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": QUESTION}], max_tokens=6, temperature=0
        )
        assert out.model == name and out.choices[0].message.content
        chunks = list(client.completions.create(model=name, prompt=QUESTION, max_tokens=4, stream=True))
        assert {c.model for c in chunks} == {name}
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"


def test_up_serves_two_models(tmp_path: Path) -> None:
    """`splitserve up --model A --model B`: each model gets its own services (here --prefill 0 --decode
    1 each, to keep it short), and one router serves both names."""
    env = {**os.environ}
    env.pop("SPLITSERVE_ROUTER_MODEL", None)  # up gives the router the services' models
    args = [
        "--threads-per-service", "1", "--kv-cache-mb", "64", "--prefill", "0", "--decode", "1",
        "--model", real_model_path(), "--model", tiny_model_path(),
        "--served-model-name", "smol", "--served-model-name", "tiny",
    ]  # fmt: skip
    proc, port = start_up(args, tmp_path / "up.log", env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: proc.poll() is not None or "splitserve is up" in (tmp_path / "up.log").read_text(),
            120, "up to start",
        )  # fmt: skip
        assert proc.poll() is None, (tmp_path / "up.log").read_text()
        wait_until(lambda: "models" in get_json(url + "/health"), 15, "the router to see both models")
        wait_until(
            lambda: all(m["decode_workers"] == 1 for m in get_json(url + "/health")["models"].values()),
            15, "a decode service of each model",
        )  # fmt: skip
        assert [m["id"] for m in get_json(url + "/v1/models")["data"]] == ["smol", "tiny"]
        for name in ("smol", "tiny"):
            body = {"model": name, "prompt": QUESTION, "max_tokens": 3, "temperature": 0}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == name, r.text
            record = get_json(f"{url}/v1/requests/{r.json()['id']}")
            # up numbers the services in model order: decode-0 is smol's, decode-1 tiny's
            assert record["decode_id"] == {"smol": "decode-0", "tiny": "decode-1"}[name]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (tmp_path / "up.log").read_text()
