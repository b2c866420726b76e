"""Observability end to end: an OTLP/gRPC receiver inside the test collects the spans that the three
real service processes export for one split-path request; the /metrics endpoints expose the names
docs/operations.md lists, and their values move after traffic."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent import futures
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cluster import Cluster

pytestmark = pytest.mark.services
SERVICE_FLAGS = ("--threads", "1", "--kv-cache-mb", "64")
LONG = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """The OTLP trace service: keeps every exported span with its process's service.name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method's name
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((attrs.get("service.name", "?"), s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[tuple[str, Any]]:
        with self.lock:
            return list(self.spans)


@pytest.fixture(scope="module")
def receiver() -> Any:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, port
    server.stop(grace=None)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url, receiver):  # type: ignore[no-untyped-def]
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    cluster = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    try:
        prefill = cluster.start("prefill", *SERVICE_FLAGS, env=env)
        decode_ = cluster.start("decode", *SERVICE_FLAGS, env=env)
        router = cluster.start("router", "--local-prefill-threshold", "12", env=env)
        yield cluster, prefill, decode_, router
    finally:
        cluster.stop()


def complete(router_url: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    r = httpx.post(
        router_url + "/v1/completions",
        timeout=120,
        json={"model": "default", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r


WANTED = {  # every span the test reads: the router's server span ends after its answer is sent, so
    # it can be exported after the client has the response (a CI run checked before it arrived)
    "splitserve-router": {"POST /v1/completions", "router.route", "router.decode_reserve", "router.prefill"},
    "splitserve-prefill": {"prefill", "prefill.queue", "prefill.compute", "prefill.chunk", "kv.transfer"},
    "splitserve-decode": {
        "kv.receive",
        "decode",
        "decode.queue",
        "decode.kv_wait",
        "decode.generate",
        "decode.first_step",
    },
}


def test_one_trace_across_router_prefill_transfer_decode(stack, receiver) -> None:  # type: ignore[no-untyped-def]
    rec = receiver[0]
    r = complete(stack[3].url, LONG)
    assert r.headers["x-splitserve-route"].startswith("split")
    request_id = r.headers["x-request-id"]
    deadline = time.monotonic() + 20
    while True:
        by_service: dict[str, set[str]] = defaultdict(set)
        for service, span in rec.snapshot():
            by_service[service].add(span.name)
        if all(names <= by_service[svc] for svc, names in WANTED.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for svc, names in WANTED.items():
        assert names <= by_service[svc], f"{svc} exported {sorted(by_service[svc])}, missing {names}"

    spans = [s for _, s in rec.snapshot()]
    traces: dict[bytes, list[str]] = defaultdict(list)
    for svc, s in rec.snapshot():
        traces[s.trace_id].append(f"{svc}:{s.name}")
    assert len(traces) == 1, f"every span of the one request is in one trace: {dict(traces)}"
    roots = [s for s in spans if not s.parent_span_id]
    assert [s.name for s in roots] == ["POST /v1/completions"]  # FastAPI's server span
    root = next(s for s in spans if s.name.startswith("text_completion "))  # the request's span
    assert root.parent_span_id == roots[0].span_id
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["splitserve.request_id"].string_value == request_id
    assert attrs["gen_ai.usage.input_tokens"].int_value > 12
    assert attrs["gen_ai.usage.output_tokens"].int_value == 8
    assert attrs["gen_ai.request.model"].string_value == "default"

    ids = {s.span_id: s for s in spans}
    for s in spans:
        assert not s.parent_span_id or s.parent_span_id in ids, f"{s.name}: parent not in the trace"
        assert s.end_time_unix_nano >= s.start_time_unix_nano, s.name

    def parent(name: str) -> str:
        s = next(s for s in spans if s.name == name)
        return ids[s.parent_span_id].name

    assert parent("router.prefill") == root.name
    assert parent("prefill") == "router.prefill"
    assert parent("kv.transfer") == "prefill"
    assert parent("kv.receive") == "kv.transfer"  # the KVDone traceparent crossed the KV link
    assert parent("decode") == root.name
    assert parent("decode.first_step") == "decode.generate"

    xfer = next(s for s in spans if s.name == "kv.transfer")
    xa = {a.key: a.value for a in xfer.attributes}
    assert xa["splitserve.kv.bytes"].int_value > 0
    assert xa["splitserve.kv.blocks"].int_value > 0 and xa["splitserve.kv.layers"].int_value > 0
    active_s = xa["splitserve.kv.active_s"].double_value
    assert 0 < active_s <= xa["splitserve.kv.duration_s"].double_value
    gbps = xa["splitserve.kv.bandwidth_gbps"].double_value  # bits over the time a write was in flight
    assert gbps == pytest.approx(xa["splitserve.kv.bytes"].int_value * 8 / active_s / 1e9)
    assert xa["splitserve.kv.rank"].int_value == 0  # no tensor parallelism: the one rank
    assert xa["splitserve.kv.backend"].string_value in ("tcp", "nixl", "torch_dist")
    gen = next(s for s in spans if s.name == "decode.generate")
    assert {a.key: a.value for a in gen.attributes}["gen_ai.usage.output_tokens"].int_value == 8


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, labels summed away: {sample name: value}."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers.get("x-request-id")
    out: dict[str, float] = defaultdict(float)
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[s.name] += s.value
    return out


def labels_of(url: str, sample: str) -> list[dict[str, str]]:
    """The label sets of one sample name on /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return [s.labels for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == sample]


SERVICE_MOVES = [  # must grow with one split request, on both services
    "splitserve_requests_total",
    "splitserve_kv_transfer_bytes_total",
    "splitserve_kv_transfer_layers_total",
    "splitserve_ttft_seconds_count",
    "splitserve_queue_wait_seconds_count",
    "splitserve_e2e_seconds_count",
]
SERVICE_NAMES = [
    "splitserve_running_sequences",
    "splitserve_waiting_sequences",
    "splitserve_kv_blocks_free",
    "splitserve_kv_blocks_used",
    "splitserve_kv_blocks_total",
    "splitserve_prefix_cache_queries_total",
    "splitserve_prefix_cache_hits_total",
    "splitserve_prefix_cache_hit_rate",
    "splitserve_expired_peer_leases_total",
    "splitserve_itl_seconds_count",
    "splitserve_tpot_seconds_count",
    "splitserve_kv_transfer_seconds_count",
    "splitserve_kv_transfer_active_seconds_count",
    "splitserve_prefill_compute_seconds_count",
]
ROUTER_MOVES = [
    "splitserve_router_requests_total",
    "splitserve_router_route_decisions_total",
    "splitserve_router_ttft_seconds_count",
    "splitserve_router_itl_seconds_count",
    "splitserve_router_tpot_seconds_count",
    "splitserve_router_e2e_seconds_count",
    "splitserve_router_prompt_tokens_total",
    "splitserve_router_arrivals_total",
    "splitserve_router_output_tokens_total",
    "splitserve_router_goodput_requests_total",
    "splitserve_router_slo_judged_requests_total",
]


def test_metrics_exposed_and_move(stack) -> None:  # type: ignore[no-untyped-def]
    _, prefill, decode_, router = stack
    before = {p.role: scrape(p.url) for p in (prefill, decode_, router)}
    # new text first: a prompt that starts like an earlier one would be prefilled where that one's KV is
    # (prefix-aware routing), and the prefill service's figures would not move
    complete(router.url, "(metrics) " + LONG, max_tokens=8)
    must_move = [(role, name) for role in ("prefill", "decode") for name in SERVICE_MOVES]
    must_move += [("decode", "splitserve_itl_seconds_count"), ("decode", "splitserve_tpot_seconds_count")]
    must_move += [("prefill", "splitserve_kv_transfer_active_seconds_count")]
    must_move += [("router", name) for name in ROUTER_MOVES]

    def unmoved(after: dict[str, dict[str, float]]) -> list[tuple[str, str]]:
        return [(r, n) for r, n in must_move if after[r].get(n, 0) <= before[r].get(n, 0)]

    # the decode stream's end is counted just after the router's answer: wait for it, not a fixed time
    deadline = time.monotonic() + 10
    after = {p.role: scrape(p.url) for p in (prefill, decode_, router)}
    while unmoved(after) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = {p.role: scrape(p.url) for p in (prefill, decode_, router)}
    for role in ("prefill", "decode"):
        for name in SERVICE_NAMES + SERVICE_MOVES:
            assert name in after[role], f"{role} /metrics lacks {name}"
    assert not unmoved(after), f"did not move: {unmoved(after)}"
    assert after["prefill"]["splitserve_prefix_cache_queries_total"] > 0
    # the transfer's figures by backend and rank, never by request: one series per backend and rank
    for role, proc in (("prefill", prefill), ("decode", decode_)):
        for sample in (
            "splitserve_kv_transfer_seconds_count",
            "splitserve_kv_transfer_active_seconds_count",
            "splitserve_kv_transfer_bytes_total",
        ):
            got = labels_of(proc.url, sample)
            assert got, (role, sample)
            assert all(set(ls) == {"backend", "rank"} and ls["rank"] == "0" for ls in got), (role, got)
    assert after["router"]["splitserve_router_goodput_ratio"] == 1.0  # no SLO configured: all met
    assert "splitserve_router_inflight_requests" in after["router"]
