"""The garbage collector in a serving process (common/runtime/gc_pauses.py): the startup heap frozen
unless SPLITSERVE_GC_FREEZE=0, and every pass timed into a Prometheus histogram by generation."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest

from common.runtime.gc_pauses import GCPauses

PROBE = """
import gc, json
from common.runtime.gc_pauses import freeze_startup_heap
before = gc.get_freeze_count()
frozen = freeze_startup_heap()
print(json.dumps({"before": before, "frozen": frozen, "count": gc.get_freeze_count()}))
"""


def _probe(value: str | None) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_GC_FREEZE"}
    if value is not None:
        env["SPLITSERVE_GC_FREEZE"] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_the_startup_heap_is_frozen_unless_turned_off() -> None:
    on = _probe(None)
    assert on["before"] == 0 and on["frozen"] == on["count"] > 1000, on  # the imports' objects, at least
    for off in ("0", "false", "off"):
        got = _probe(off)
        assert got == {"before": 0, "frozen": 0, "count": 0}, (off, got)


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("splitserve_gc_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_every_pass_is_timed_by_generation() -> None:
    registry = CollectorRegistry()
    registry.register(GCPauses())
    other = CollectorRegistry()  # a second registry in the same process reads the same record
    other.register(GCPauses())
    before = _samples(registry)
    gc.collect(0)
    gc.collect(2)
    gc.collect(2)
    after = _samples(registry)
    count = 'splitserve_gc_pause_seconds_count{generation="%d"}'
    assert after[count % 2] >= before[count % 2] + 2
    assert after[count % 0] >= before[count % 0] + 1
    full_sum = 'splitserve_gc_pause_seconds_sum{generation="2"}'
    assert after[full_sum] > before[full_sum]
    # cumulative buckets: never decreasing, the last (+Inf) equal to the count
    for gen in (0, 1, 2):
        buckets = [
            v
            for k, v in after.items()
            if k.startswith(f'splitserve_gc_pause_seconds_bucket{{generation="{gen}"')
        ]
        assert buckets == sorted(buckets) and buckets[-1] == after[count % gen], (gen, buckets)
    assert _samples(other)[count % 2] == _samples(registry)[count % 2]
    assert after["splitserve_gc_frozen_objects"] == gc.get_freeze_count()
