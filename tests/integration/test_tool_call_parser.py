"""`--tool-call-parser` with real processes (issue 28, point 4): a router serving two models, the real
SmolLM2 as `smol` (format detected from its chat template: hermes) and the tiny test model as `tiny`
(`mistral`, given), says each model's format in /v1/models and answers a tools request for `tiny`
through the tiny model's own decode service; an unknown parser name stops the router at start-up.
How each format's output is parsed is tested on the router's own code path in
tests/unit/test_tool_formats.py (the tiny model's output is random)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from tests.support.cluster import Cluster, Proc, free_port, get_json
from tests.support.tiny_model import real_model_path, tiny_model_path

pytestmark = [pytest.mark.services]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("tool-parser")
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp))
    try:
        c.start("decode", "--threads", "1", "--kv-cache-mb", "32", "--served-model-name", "tiny",
                env={"SPLITSERVE_MODEL": tiny_model_path()})  # fmt: skip
        proc = c.start(
            "router", "--model", real_model_path(), "--model", tiny_model_path(),
            "--served-model-name", "smol", "--served-model-name", "tiny",
            "--tool-call-parser", "auto", "--tool-call-parser", "mistral",
        )  # fmt: skip
        c.wait_routed()
        yield proc
    finally:
        c.stop()
        redis.stop()


def test_each_model_says_its_format(router: Proc) -> None:
    cards = {m["id"]: m for m in get_json(router.url + "/v1/models")["data"]}
    assert cards["smol"]["tool_call_parser"] == "hermes"  # detected: SmolLM2's template has no tools
    assert cards["tiny"]["tool_call_parser"] == "mistral"  # given


def test_a_tools_request_is_answered(router: Proc) -> None:
    add = {"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {}}}}}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "1+1?"}],
        "tools": [add],
        "max_tokens": 8,
    }
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    if choice["finish_reason"] == "tool_calls":  # random weights: possible, if unlikely
        assert all(c["function"]["name"] == "add" for c in choice["message"]["tool_calls"])


def test_an_unknown_parser_stops_the_router() -> None:
    env = {**os.environ, "SPLITSERVE_ROUTER_MODEL": tiny_model_path()}
    cmd = [sys.executable, "-m", "splitserve", "router", "--port", str(free_port())]
    done = subprocess.run(
        [*cmd, "--tool-call-parser", "jsonish"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 2, done.stderr
    assert "--tool-call-parser" in done.stderr and "unknown tool call parser 'jsonish'" in done.stderr
