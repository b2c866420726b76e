"""A real decode service's logs with --log-format json (issue 29: a start-up a person can follow; 31.6: no
forged log lines): every line it writes is one JSON object, the start-up lines say what is loaded and
where it serves, and each request is one access line carrying its request id, even one whose path holds
an encoded newline."""

from __future__ import annotations

import json
import os
import urllib.parse
import uuid
from typing import Any

import httpx
import pytest

from common.protocol import AbortRequest, encode
from tests.support.cluster import Cluster, Proc, internal_auth, wait_until

pytestmark = pytest.mark.services
FORGED = "1999-01-01T00:00:00.000Z INFO decode-0 splitserve.access: GET /forged 200"


@pytest.fixture(scope="module")
def decode_(tmp_path_factory):  # type: ignore[no-untyped-def]
    c = Cluster(None, str(tmp_path_factory.mktemp("logs")))
    try:
        yield c.start(
            "decode", "--threads", "1", "--kv-cache-mb", "64", "--log-format", "json", "--log-level", "info"
        )
    finally:
        c.stop()


def log_records(proc: Proc) -> list[dict[str, Any]]:
    """Every line the process wrote (stdout and stderr), each of which must be one JSON object."""
    with open(proc.log_path, errors="replace") as f:
        text = f.read()
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON log line: {line!r}") from None
        assert isinstance(out[-1], dict), line
    return out


def access_of(proc: Proc, rid: str) -> list[dict[str, Any]]:
    return [r for r in log_records(proc) if r["logger"] == "splitserve.access" and r.get("request_id") == rid]


def test_start_up_lines(decode_: Proc) -> None:
    port = decode_.url.rsplit(":", 1)[1]
    serving = f"serving on http://127.0.0.1:{port}"
    wait_until(lambda: any(serving in r["msg"] for r in log_records(decode_)), 10, "the serving line")
    recs = log_records(decode_)
    for r in recs:
        assert {"ts", "level", "process", "logger", "msg"} <= r.keys(), r
        assert r["ts"].endswith("Z")
    assert {r["process"] for r in recs} == {f"decode-127.0.0.1-{port}"}  # the worker id

    def first(prefix: str) -> int:
        return next(i for i, r in enumerate(recs) if r["msg"].startswith(prefix) and r["level"] == "info")

    model = os.environ["SPLITSERVE_MODEL"]
    order = [
        first(f"loading model {model} ..."),
        first("model loaded: tiny-random-llama-v1, 4 layers, "),
        first("KV cache: "),
        first(f"decode decode-127.0.0.1-{port} {serving}"),
    ]
    assert order == sorted(order), [recs[i]["msg"] for i in order]
    kv = recs[order[2]]["msg"]
    assert " blocks of 16 tokens (64 MiB, float32)" in kv, kv
    assert not any(r["msg"].startswith("Uvicorn running on") for r in recs)  # ours says it


def test_a_newline_in_a_path_is_one_access_line(decode_: Proc) -> None:
    path = "/v1/x%0a" + urllib.parse.quote(FORGED) + "%0d%1b[2J"  # the forged line, after a newline
    r = httpx.get(decode_.url + path + "?q=%0a")
    assert r.status_code == 404
    rid = r.headers["x-request-id"]
    wait_until(lambda: access_of(decode_, rid), 10, "the access line")
    (line,) = access_of(decode_, rid)
    assert line["level"] == "info" and line["status"] == 404 and line["method"] == "GET"
    assert line["path"] == "/v1/x\\n" + FORGED + "\\r\\x1b[2J?q=%0a"
    assert line["msg"].startswith("GET " + line["path"] + " 404 ")
    with open(decode_.log_path) as f:
        raw = f.read()
    assert not any(ln.startswith(("1999", "GET /forged")) for ln in raw.splitlines())
    assert "\x1b" not in raw


def test_the_message_id_is_the_request_id(decode_: Proc) -> None:
    rid = f"logs-{uuid.uuid4().hex}"
    r = httpx.post(decode_.url + "/internal/abort", content=encode(AbortRequest(rid)), auth=internal_auth)
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    wait_until(lambda: access_of(decode_, rid), 10, "the access line")
    (line,) = access_of(decode_, rid)
    assert line["msg"].startswith("POST /internal/abort 200 ") and line["status"] == 200
    # probes are at debug: none of the health checks the start-up polled shows at info
    assert not any(r.get("path") == "/health" for r in log_records(decode_))
