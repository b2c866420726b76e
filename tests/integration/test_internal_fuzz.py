"""Hypothesis-generated bodies against the internal endpoints of real prefill and decode processes:
garbage, truncated bodies, messages of the wrong kind or version, fields of wrong types, values out of
range, the odd valid one. Every answer is a 4xx (or, for a valid request, 200 and a stream this test
closes at once); never a 5xx; the services stay healthy and hold no block afterwards."""

from __future__ import annotations

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.protocol import PROTOCOL_VERSION
from tests.support.cluster import Cluster, internal_auth

pytestmark = pytest.mark.services
FLAGS = ("--threads", "1", "--kv-cache-mb", "64", "--kv-backend", "tcp")

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
values = st.recursive(
    scalars | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
token_ids = st.lists(st.integers(-5, 60_000), min_size=0, max_size=40)
sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(-2, 4) | values,
        "temperature": st.floats(-1, 3) | values,
        "top_p": st.floats(-1, 2) | values,
        "top_k": st.integers(-3, 100) | values,
        "seed": st.integers(-(2**63), 2**64 - 1) | values,
        "stop_token_ids": st.lists(st.integers(-3, 60_000), max_size=3) | values,
        "min_tokens": st.integers(-2, 5) | values,
    },
)
FIELDS = {
    "request_id": st.text(min_size=1, max_size=12) | values,
    "token_ids": token_ids | values,
    "sampling": sampling | values,
    "mode": st.sampled_from(["local", "remote", "sideways"]) | values,
    "deadline": st.floats(0, 2e9) | values,
    "kv_endpoint": st.sampled_from(["tcp://127.0.0.1:1", "nixl://h:2/x", "bogus"]) | values,
    "block_ids": st.lists(st.integers(-3, 10_000), max_size=8) | values,
    "fence": st.integers(-3, 5) | values,
    "num_cached_tokens": st.integers(-3, 50) | values,
    "num_output_tokens": st.integers(-3, 50) | values,
    "traceparent": st.text(max_size=10) | values,
}
maps = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["generate", "prefill", "abort", "tokens", "?"]),
        "protocol_version": st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 1]),
    },
    optional=FIELDS,
).map(msgspec.msgpack.encode)
truncated = maps.flatmap(lambda b: st.integers(0, len(b)).map(lambda i: b[:i]))
bodies = st.one_of(maps, truncated, st.binary(max_size=64))
PATHS = ["/internal/generate", "/internal/prefill", "/internal/abort"]


@pytest.fixture(scope="module")
def services(tmp_path_factory, redis_url):  # type: ignore[no-untyped-def]
    c = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    try:
        yield c, c.start("prefill", *FLAGS), c.start("decode", *FLAGS)
    finally:
        c.stop()


def test_no_body_makes_an_internal_endpoint_fail(services) -> None:  # type: ignore[no-untyped-def]
    cluster, prefill, decode_ = services
    seen: set[int] = set()

    with httpx.Client(timeout=30, auth=internal_auth) as client:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.sampled_from([prefill, decode_]), st.sampled_from(PATHS), bodies)
        def post(proc, path: str, body: bytes) -> None:  # type: ignore[no-untyped-def]
            with client.stream("POST", proc.url + path, content=body) as r:  # closed at once
                seen.add(r.status_code)
                assert r.status_code < 500, (path, body, r.read())

        post()
    assert 400 in seen
    for proc in (prefill, decode_):
        h = cluster.wait_blocks_free(proc, timeout_s=10)
        assert h["status"] == "ok" and h["free_blocks"] == h["total_blocks"] and h["running"] == 0, h
