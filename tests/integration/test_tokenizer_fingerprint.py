"""A router routes only to services whose token ids mean what its own tokenizer's do (issue 28, "a router
refuses services whose model fingerprint differs"), against real Redis, router, prefill and decode.

The other model here is the tiny test model with two vocabulary entries swapped in its tokenizer.json:
it loads and serves like the real one, and a prompt tokenized by the router would reach it as other text,
with no error anywhere — the silent failure this check exists for. Before, the router routed to it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from common.model.loader import load_model
from common.text.model_info import load_model_info
from tests.support.cluster import Cluster, free_port, get_json, wait_until
from tests.support.tiny_model import tiny_model_path

pytestmark = pytest.mark.services
FLAGS = ("--threads", "1", "--kv-cache-mb", "64")
BODY = {"model": "default", "prompt": "one two three", "max_tokens": 4, "temperature": 0}


def swapped_tokenizer_model(tmp: Path) -> str:
    """The tiny model with the ids of two ordinary tokens swapped in its tokenizer."""
    out = tmp / "swapped"
    shutil.copytree(tiny_model_path(), out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "the", "and"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return str(out)


def test_the_router_and_a_service_fingerprint_one_tokenizer_alike(tmp_path: Path) -> None:
    """The router's tokenizer (common/text/model_info.py, no torch) and a service's (the weight loader)
    are built by different code from the same files: their fingerprints must agree, for the default
    GGUF and for a Hugging Face folder, or every router would refuse every service."""
    for model in (None, tiny_model_path()):
        assert load_model_info(model).tokenizer.fingerprint == load_model(model)[1].fingerprint, model
    other = swapped_tokenizer_model(tmp_path)
    tiny = load_model_info(tiny_model_path()).tokenizer.fingerprint
    assert load_model_info(other).tokenizer.fingerprint != tiny


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path))
    try:
        yield c, swapped_tokenizer_model(tmp_path)
    finally:
        c.stop()
        redis.stop()


def test_a_service_with_another_tokenizer_gets_no_request(cluster: tuple[Cluster, str]) -> None:
    c, other = cluster
    c.start("prefill", *FLAGS)
    wrong = c.start("decode", *FLAGS, env={"SPLITSERVE_MODEL": other})
    router = c.start("router")
    assert get_json(wrong.url + "/health")["status"] == "ok"  # it serves: only the router keeps away
    wait_until(lambda: "serves another tokenizer" in Path(router.log_path).read_text(), 15, "the refusal")
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 503, r.text  # no decode service it may use: refused, not another model's text
    assert get_json(router.url + "/health")["decode_workers"] == 0
    assert "POST /internal/generate" not in Path(wrong.log_path).read_text()
    # a service with the router's own tokenizer is used at once
    c.start("decode", *FLAGS)
    wait_until(lambda: get_json(router.url + "/health")["decode_workers"] == 1, 15, "the right decode")
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    assert "POST /internal/generate" not in Path(wrong.log_path).read_text()
    metrics = httpx.get(router.url + "/metrics").text
    assert "splitserve_router_registry_other_tokenizer_workers 1.0" in metrics, metrics
