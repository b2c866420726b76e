"""Python's cyclic garbage collector in a serving process: the startup heap frozen, every pass timed.

Reference counting frees almost everything a request allocates; the cyclic collector runs besides, in
passes triggered by allocation counts, and a pass of generation 2 (a *full* one) walks every tracked
object of the process while holding the GIL: the router's event loop, an engine's step and a KV
receiver's thread all stand still meanwhile. After startup most of a process's heap is long-lived and
never garbage (modules, FastAPI's app, the tokenizer, the model's modules, the block manager's `Block`
objects): measured here, a full pass takes ~55 ms in the router (92,000 objects once imported) and
~140 ms in a process holding the router and the engine (237,000), and reclaimed 20-50 objects.

`freeze_startup_heap()` (every process calls it once it serves: its socket listens, its model is
loaded; common/runtime/http_server.py) calls `gc.freeze()`: what is tracked now moves to the permanent
generation, which later passes do not walk, so a full pass costs what the heap grew by since.
Reference counting still frees frozen objects; only a reference cycle among them, dropped later, stays
(bounded by what startup built). No `gc.collect()` before it: that costs a full pass at every start
(the test suite starts hundreds of services) to reclaim a few dozen objects.
`SPLITSERVE_GC_FREEZE=0` turns it off (to compare, or to rule it out).

`GCPauses`, a Prometheus collector: `gc.callbacks` time every pass, per generation, as the histogram
`splitserve_gc_pause_seconds{generation}` (process-wide: several services in one process, as a
sim-fleet, each report the same process), with `splitserve_gc_collected_objects_total{generation}`
(the cyclic garbage the passes freed: what reference counting could not) and
`splitserve_gc_frozen_objects`. The callback only adds to plain counters (never a lock: a pass may
start inside any code, a metric's own lock held included); a scrape reads them.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

# Seconds: a young pass takes microseconds, a full one over a large heap tens to hundreds of milliseconds
BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GENERATIONS = (0, 1, 2)


def freeze_startup_heap() -> int:
    """Move every object the collector tracks now to the permanent generation (module doc), unless
    SPLITSERVE_GC_FREEZE is 0; how many objects are frozen in all (0 when off)."""
    if os.environ.get("SPLITSERVE_GC_FREEZE", "1").strip().lower() in ("0", "false", "no", "off"):
        return 0
    gc.freeze()
    return gc.get_freeze_count()


class _Pauses:
    """The process's one record of collector passes, kept by a gc callback."""

    def __init__(self) -> None:
        # per generation: a count per bucket (the last: above every bound), and the sum of seconds
        self.counts = [[0] * (len(BUCKETS) + 1) for _ in GENERATIONS]
        self.sums = [0.0 for _ in GENERATIONS]
        self.collected = [0 for _ in GENERATIONS]  # unreachable objects each generation's passes freed
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        gen = info.get("generation", 2)
        i = next((i for i, b in enumerate(BUCKETS) if took <= b), len(BUCKETS))
        self.counts[gen][i] += 1  # plain ints under the GIL: passes never overlap (module doc)
        self.sums[gen] += took
        self.collected[gen] += info.get("collected", 0)


_PAUSES: _Pauses | None = None


def _pauses() -> _Pauses:
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = _Pauses()
    return _PAUSES


class GCPauses(Collector):
    """The process's collector passes, for a registry (module doc). Timing starts when the first one is
    made; any number may be made (each registry its own), all reading the one record."""

    def __init__(self) -> None:
        self._record = _pauses()

    def collect(self) -> Iterator[Any]:
        h = HistogramMetricFamily(
            "splitserve_gc_pause_seconds",
            "Python garbage collector passes, by generation (2: full), process-wide; each stops every thread",
            labels=["generation"],
        )
        for gen in GENERATIONS:
            counts, running, buckets = self._record.counts[gen], 0, []
            for bound, n in zip((*map(str, BUCKETS), "+Inf"), counts, strict=True):
                running += n
                buckets.append((bound, running))
            h.add_metric([str(gen)], buckets, self._record.sums[gen])
        yield h
        freed = CounterMetricFamily(
            "splitserve_gc_collected_objects",
            "Objects the garbage collector's passes freed (cyclic garbage: reference counting could not), "
            "by generation, process-wide",
            labels=["generation"],
        )
        for gen in GENERATIONS:
            freed.add_metric([str(gen)], self._record.collected[gen])
        yield freed
        yield GaugeMetricFamily(
            "splitserve_gc_frozen_objects",
            "Objects in the garbage collector's permanent generation (frozen at startup: never walked)",
            value=gc.get_freeze_count(),
        )
