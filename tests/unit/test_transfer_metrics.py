"""The KV transfer's observability: histograms and transport counters labelled by backend and rank (never
by request), children that read 0 before the first transfer, and the kv.transfer span's figures."""

from __future__ import annotations

import concurrent.futures
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.connector.remote_kv import OutgoingKV, TransferState
from common.engine.api import EngineLoad
from common.parallel.messages import RankStats
from common.service.metrics import EngineCollector, ServiceMetrics, TransportCount
from kv_transfer import SenderStats
from prefill_service.service import PrefillService
from prefill_service.spans import transfer_done

HISTOGRAMS = ("splitserve_kv_transfer_seconds", "splitserve_kv_transfer_active_seconds")


def samples(metrics: ServiceMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def test_transfer_histograms_read_zero_for_the_services_backend_and_rank() -> None:
    metrics = ServiceMetrics("prefill")
    assert samples(metrics, "splitserve_kv_transfer_seconds_count") == {}  # labelled: no child yet
    metrics.init_transfer("tcp", 0)
    for name in HISTOGRAMS:
        assert samples(metrics, name + "_count") == {(("backend", "tcp"), ("rank", "0")): 0.0}


def outgoing(nbytes: int, active: list[tuple[float, float]]) -> OutgoingKV:
    rkv = OutgoingKV("req-1", 3, [0, 1], TransferState.SENT, endpoint="tcp://127.0.0.1:1/abc")
    rkv.writes = [concurrent.futures.Future() for _ in active]
    rkv.active, rkv.nbytes, rkv.dst_blocks, rkv.layers = active, nbytes, {0, 1}, {0}
    return rkv


def test_transfer_done_labels_by_backend_and_rank_and_fills_the_span() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = ServiceMetrics("prefill")
    now = time.perf_counter()
    rkv = outgoing(2_000_000, [(now - 0.004, now - 0.002)])  # 2 MB in 2 ms of writes
    rkv.span = provider.get_tracer("t").start_span("kv.transfer")
    duration = transfer_done(metrics, rkv, rank=2)
    assert duration >= 0.004
    for name in HISTOGRAMS:  # by backend and rank only: the request id is in no label
        assert samples(metrics, name + "_count") == {(("backend", "tcp"), ("rank", "2")): 1.0}
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert attrs["splitserve.kv.rank"] == 2 and attrs["splitserve.kv.backend"] == "tcp"
    assert attrs["splitserve.kv.bytes"] == 2_000_000 and attrs["splitserve.kv.blocks"] == 2
    assert attrs["splitserve.kv.duration_s"] == pytest.approx(duration)
    assert attrs["splitserve.kv.active_s"] == pytest.approx(0.002)
    assert attrs["splitserve.kv.bandwidth_gbps"] == pytest.approx(8.0)  # 16 Mbit / 2 ms

    exporter.clear()
    rkv = outgoing(1000, [(now, now)])  # no measurable write time: no bandwidth rather than a made-up one
    rkv.span = provider.get_tracer("t").start_span("kv.transfer")
    transfer_done(metrics, rkv, rank=0)
    (span,) = exporter.get_finished_spans()
    assert "splitserve.kv.bandwidth_gbps" not in (span.attributes or {})
    assert transfer_done(metrics, OutgoingKV("r", 1, [0], TransferState.SENT, endpoint="tcp://h:1"), 0) == 0


def collect(counts: list[TransportCount]) -> dict[str, list[tuple[dict[str, str], float]]]:
    load = EngineLoad(free_blocks=1, total_blocks=1)
    collector = EngineCollector(lambda: load, lambda: 0, lambda: counts)
    return {m.name: [(s.labels, s.value) for s in m.samples] for m in collector.collect()}


def test_prefill_transport_counters_per_backend_and_rank() -> None:
    workers = SimpleNamespace(rank_stats={})
    service = SimpleNamespace(kv_backend="nixl", rank=0, senders={}, engine=SimpleNamespace(tp_workers=None))
    before = collect(PrefillService.transfer_counters(cast(Any, service)))
    assert before["splitserve_kv_transfer_bytes"] == [({"backend": "nixl", "rank": "0"}, 0)]  # 0, not absent
    service.senders["tcp"] = SimpleNamespace(stats=SenderStats(bytes_sent=4096, layers_sent=2), rank=0)
    after = collect(PrefillService.transfer_counters(cast(Any, service)))
    assert after["splitserve_kv_transfer_bytes"] == [
        ({"backend": "nixl", "rank": "0"}, 0),
        ({"backend": "tcp", "rank": "0"}, 4096),
    ]
    assert ({"backend": "tcp", "rank": "0"}, 2) in after["splitserve_kv_transfer_layers"]
    # tensor parallelism: the worker ranks' senders, as their agents last reported them
    service.engine.tp_workers = workers
    workers.rank_stats[1] = RankStats(sent={"tcp": {"bytes_sent": 1024, "layers_sent": 1, "dones_sent": 1}})
    ranked = collect(PrefillService.transfer_counters(cast(Any, service)))
    assert ({"backend": "tcp", "rank": "1"}, 1024) in ranked["splitserve_kv_transfer_bytes"]


def test_fp8_clamped_values_are_a_counter_of_the_engine_load() -> None:
    """Issue 28, point 7: clamping is counted in a metric, not only in PagedKVCache.clamped."""
    for clamped in (0, 7):
        load = EngineLoad(free_blocks=1, total_blocks=1, kv_clamped=clamped)
        collector = EngineCollector(lambda load=load: load, lambda: 0, lambda: [])  # type: ignore[misc]
        families = {m.name: m for m in collector.collect()}
        (sample,) = families["splitserve_kv_fp8_clamped_values"].samples
        assert (sample.name, sample.value) == ("splitserve_kv_fp8_clamped_values_total", clamped)
