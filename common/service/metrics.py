"""A prefill or decode service's Prometheus metrics: histograms and counters observed as requests go,
and the engine's (its published load), leases' and KV transport's figures read at scrape time (nothing
on the hot path)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from common.engine.api import EngineLoad
from common.kv.tiers import LATENCY_BUCKETS, VERIFY_CAUSES, Latency, StoreStats
from common.runtime.gc_pauses import GCPauses

# Seconds. Queue waits and TTFT span a crowded queue; ITL/TPOT one engine step.
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# Label values the services' code uses, exported as 0 from the start so that a panel or an alert reads 0
# rather than "no data" until the first event. Outcomes: prefill_service/service.py, decode_service/
# service.py; transfer failures: the prefill service's TransferError subclasses (kv_transfer/base.py) and
# a decode side whose lease expired; internal auth: common/security/internal_auth.py `check` and the body
# limit of its middleware; preemptions: the scheduler's two kinds.
OUTCOMES = {
    "prefill": ("finished", "refused", "transfer_failed", "aborted", "decode_lease_expired", "failed"),
    "decode": ("finished", "refused", "aborted", "failed"),  # failed: an engine fault put down to it
}
TRANSFER_FAILURES = ("TransferError", "PreflightError", "AuthError", "decode_lease_expired")
INTERNAL_AUTH_REFUSALS = (
    "missing", "malformed", "stale", "bad_signature", "wrong_audience", "replayed", "too_large",
)  # fmt: skip
PREEMPTION_KINDS = ("swap", "recompute")
# The KV transfer's figures are labelled by backend and by rank (the tensor-parallel rank whose KV shard
# moved; 0 until there is tensor parallelism): a bounded set, never a request id.
TRANSFER_LABELS = ("backend", "rank")
TIER_WRITE_FAILURES = ("full", "too_large", "io", "busy")  # common/kv/tiers.py: why a chunk was not stored


class TransportCount(NamedTuple):
    """One KV-transport counter of one sender or receiver, read at scrape time."""

    name: str  # without _total
    doc: str
    backend: str
    rank: int
    value: int


class ServiceMetrics:
    """A service's own registry: histograms and counters observed as requests go, plus the engine's
    and the KV transport's figures, read at scrape time by `EngineCollector` (nothing on the hot path)."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(GCPauses())  # the process's garbage-collector passes (common/runtime/gc_pauses.py)
        self.role = role
        self.requests = Counter("splitserve_requests", "requests by outcome", ["role", "outcome"], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        self.queue_wait = hist(
            "splitserve_queue_wait_seconds", "arrival to admission (KV blocks granted)", _WAIT_BUCKETS
        )
        self.ttft = hist(
            "splitserve_ttft_seconds",
            "arrival to the first token known here (prefill: sampled; decode: first frame sent)",
            _WAIT_BUCKETS,
        )
        self.itl = hist("splitserve_itl_seconds", "gap between token frames sent (decode)", _STEP_BUCKETS)
        self.tpot = hist(
            "splitserve_tpot_seconds", "per-request mean time per output token after the first", _STEP_BUCKETS
        )
        self.e2e = hist("splitserve_e2e_seconds", "arrival to the request's end here", _E2E_BUCKETS)
        self.prefill_compute = hist(
            "splitserve_prefill_compute_seconds", "first prefill chunk start to last chunk end", _WAIT_BUCKETS
        )
        self.transfer = hist(
            "splitserve_kv_transfer_seconds",
            "first layer write to kv_done delivered (prefill), by backend and rank",
            _WAIT_BUCKETS,
            TRANSFER_LABELS,
        )
        self.transfer_active = hist(
            "splitserve_kv_transfer_active_seconds",
            "time at least one layer write was in flight (prefill), by backend and rank; bandwidth = "
            "rate(splitserve_kv_transfer_bytes_total) / rate(this _sum)",
            _WAIT_BUCKETS,
            TRANSFER_LABELS,
        )
        self.transfer_failures = Counter(
            "splitserve_kv_transfer_failures", "KV transfers that failed, by reason", ["reason"], registry=r
        )
        self.internal_auth_refused = Counter(
            "splitserve_internal_auth_refused",
            "/internal/ calls refused before their handler: missing, malformed, stale, bad_signature, "
            "replayed, too_large",
            ["reason"],
            registry=r,
        )
        for outcome in OUTCOMES.get(role, ()):
            self.requests.labels(role, outcome)
        if role == "prefill":  # the side that sends, and so counts failed transfers
            for reason in TRANSFER_FAILURES:
                self.transfer_failures.labels(reason)
        for reason in INTERNAL_AUTH_REFUSALS:
            self.internal_auth_refused.labels(reason)

    def init_transfer(self, backend: str, rank: int) -> None:
        """The transfer histograms' children of the service's own backend and rank, so that panels read
        0 before the first transfer (another backend's children appear with its first transfer)."""
        for h in (self.transfer, self.transfer_active):
            h.labels(backend, str(rank))

    def observe_transfer(self, backend: str, rank: int, duration_s: float, active_s: float) -> None:
        self.transfer.labels(backend, str(rank)).observe(duration_s)
        self.transfer_active.labels(backend, str(rank)).observe(active_s)


class EngineCollector:
    """Gauges and counters per scrape: the engine's from the `EngineLoad` it last published (one value:
    its figures agree with each other and with /health), the leases' and the KV transport's."""

    def __init__(
        self,
        load: Callable[[], EngineLoad],
        expired_leases: Callable[[], int],
        transfer_counters: Callable[[], list[TransportCount]],
        tiers: Callable[[], StoreStats | None] = lambda: None,
    ) -> None:
        self.load = load
        self.expired_leases, self.transfer_counters = expired_leases, transfer_counters
        self.tiers = tiers  # the KV offload tiers' figures (None: off)

    def collect(self) -> Iterator[Metric]:
        load = self.load()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge(
            "splitserve_running_sequences", "sequences running or holding a reservation", load.running
        )
        yield gauge(
            "splitserve_waiting_sequences", "queue depth: sequences waiting for KV blocks", load.waiting
        )
        yield gauge(
            "splitserve_kv_blocks_free", "free KV blocks (incl. evictable cached ones)", load.free_blocks
        )
        yield gauge("splitserve_kv_blocks_used", "KV blocks in use", load.total_blocks - load.free_blocks)
        yield gauge("splitserve_kv_blocks_total", "KV blocks", load.total_blocks)
        preempt = CounterMetricFamily("splitserve_preemptions", "preemptions by kind", labels=["kind"])
        preempted = {"swap": load.preempted_swap, "recompute": load.preempted_recompute}
        for kind in PREEMPTION_KINDS:  # both, 0 before the first
            preempt.add_metric([kind], preempted[kind])
        yield preempt
        queries, hits = load.prefix_queries, load.prefix_hits
        yield CounterMetricFamily(
            "splitserve_prefix_cache_queries",
            "full prompt blocks looked up in the prefix cache",
            value=queries,
        )
        yield CounterMetricFamily(
            "splitserve_prefix_cache_hits", "prompt blocks found in the prefix cache", value=hits
        )
        yield gauge(
            "splitserve_prefix_cache_hit_rate", "hits / queries since start", hits / queries if queries else 0
        )
        yield CounterMetricFamily(
            "splitserve_prefix_cache_tier_hits",
            "prompt blocks the offload tiers read back at admission (blocks, whatever the pages per block)",
            value=load.tier_hits,
        )
        yield CounterMetricFamily(
            "splitserve_kv_fp8_clamped_values",
            "K/V values written past the fp8 KV cache's range and saturated (0 unless the cache is fp8; "
            "read once a second): a steady rise means the calibrated scales miss this traffic",
            value=load.kv_clamped,
        )
        yield CounterMetricFamily(
            "splitserve_expired_peer_leases",
            "transfers ended because the peer's lease expired",
            value=self.expired_leases(),
        )
        transport: dict[str, CounterMetricFamily] = {}  # one family per name, a sample per backend/rank
        for c in self.transfer_counters():
            if c.name not in transport:
                transport[c.name] = CounterMetricFamily(c.name, c.doc, labels=TRANSFER_LABELS)
            transport[c.name].add_metric([c.backend, str(c.rank)], c.value)
        yield from transport.values()
        yield from self._tier_metrics()

    def _tier_metrics(self) -> Iterator[Metric]:
        """The KV offload tiers (common/kv/tiers.py), labelled by tier (ram, disk): nothing while off."""
        store = self.tiers()
        if store is None:
            return
        gauges = {  # TierStats field -> family
            "bytes": GaugeMetricFamily("splitserve_kv_tier_bytes", "bytes a KV tier holds", labels=["tier"]),
            "capacity_bytes": GaugeMetricFamily(
                "splitserve_kv_tier_capacity_bytes", "a KV tier's size limit", labels=["tier"]
            ),
            "blocks": GaugeMetricFamily(
                "splitserve_kv_tier_blocks", "KV blocks a tier holds", labels=["tier"]
            ),
        }
        counters = {
            "hits": CounterMetricFamily(
                "splitserve_kv_tier_hits", "KV blocks read back from a tier and verified", labels=["tier"]
            ),
            "misses": CounterMetricFamily(
                "splitserve_kv_tier_misses",
                "KV blocks looked up in a tier and not returned (not held, or failed to verify)",
                labels=["tier"],
            ),
            "writes": CounterMetricFamily(
                "splitserve_kv_tier_writes", "KV blocks stored in a tier", labels=["tier"]
            ),
            "evicted": CounterMetricFamily(
                "splitserve_kv_tier_evicted", "KV blocks a tier's LRU let go of", labels=["tier"]
            ),
        }
        verify = CounterMetricFamily(
            "splitserve_kv_tier_verify_failures",
            "tier reads that failed or did not verify (each a miss, recomputed), by cause",
            labels=["tier", "cause"],
        )
        wfail = CounterMetricFamily(
            "splitserve_kv_tier_write_failures",
            "KV blocks not stored: full (disk full), too_large (a chunk over the tier's size), io, "
            "busy (RAM: the slots that would make room are still being read)",
            labels=["tier", "cause"],
        )
        read = HistogramMetricFamily(
            "splitserve_kv_tier_read_seconds", "one chunk read from a tier and verified", labels=["tier"]
        )
        write = HistogramMetricFamily(
            "splitserve_kv_tier_write_seconds", "one chunk encoded and stored in a tier", labels=["tier"]
        )
        for st in store.tiers:
            t = [st.tier]
            for name, g in gauges.items():
                g.add_metric(t, getattr(st, name))
            for name, c in counters.items():
                c.add_metric(t, getattr(st, name))
            for cause in VERIFY_CAUSES:  # every cause, 0 before the first (an alert reads 0, not no data)
                verify.add_metric([st.tier, cause], st.verify_failures[cause])
            for cause in TIER_WRITE_FAILURES:
                wfail.add_metric([st.tier, cause], st.write_failures[cause])
            read.add_metric(t, _buckets(st.read_latency), st.read_latency.sum)
            write.add_metric(t, _buckets(st.write_latency), st.write_latency.sum)
        yield from gauges.values()
        yield from counters.values()
        yield from (verify, wfail, read, write)
        yield CounterMetricFamily(
            "splitserve_kv_tier_dropped_blocks",
            "evicted KV blocks dropped because the tier write queue was full",
            value=store.dropped_blocks,
        )
        yield CounterMetricFamily(
            "splitserve_kv_tier_unoffered_blocks",
            "evicted KV blocks never offered to the tiers: a tensor-parallel worker did not hand them over",
            value=store.unoffered_blocks,
        )
        yield CounterMetricFamily(
            "splitserve_kv_tier_disk_skipped_blocks",
            "KV blocks the disk tier held that admissions recomputed: reading them cost more",
            value=store.disk_skipped_blocks,
        )
        yield CounterMetricFamily(
            "splitserve_kv_tier_filtered_blocks",
            "evicted KV blocks kept off the disk by the reuse filter (not evicted twice yet)",
            value=store.filtered_blocks,
        )
        pf = store.prefetch  # prefetch on arrival: disk blocks into RAM before admission (tiers.py)
        for name, doc, value in (
            ("started", "arrivals whose disk-only leading blocks a prefetch set out to bring into RAM",
             pf.started),
            ("dropped", "arrivals not prefetched: the prefetches in flight were at their limit", pf.dropped),
            ("completed", "prefetches that read (and, where they verified, promoted) their chunks",
             pf.completed),
            ("in_time", "prefetches whose promoted blocks an admission then read from RAM", pf.in_time),
            ("late", "prefetches an admission overtook: it read their blocks from the disk itself",
             pf.late),
        ):  # fmt: skip
            yield CounterMetricFamily(f"splitserve_kv_tier_prefetches_{name}", doc, value=value)
        yield CounterMetricFamily(
            "splitserve_kv_tier_prefetched_blocks",
            "KV blocks a prefetch promoted from disk to RAM",
            value=pf.blocks,
        )


def _buckets(lat: Latency) -> list[tuple[str, float]]:
    """A tier latency as Prometheus' cumulative buckets."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, n in zip((*LATENCY_BUCKETS, float("inf")), lat.counts, strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(bound), total))
    return out
