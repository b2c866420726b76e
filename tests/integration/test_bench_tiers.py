"""The `tiers` benchmark end to end on the tiny test model: three real stacks (Redis, decode service,
router), pool only, +RAM and +RAM+disk, one round of a chat trace larger than the pool."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import pytest

from bench.tiers import run
from tests.support.tiny_model import tiny_model_path

pytestmark = pytest.mark.services


def test_tiers_bench_serves_tier_hits_and_the_same_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the logs it keeps: under tmp_path, not /tmp
    args = argparse.Namespace(
        model=tiny_model_path(), threads=1, kv_cache_mb=1, sessions=3, turns=3, answer_tokens=4,
        system_notes=6, rounds=1, seed=0, tiers_ram_gb=0.25, tiers_disk_ram_gb=None, tiers_disk_gb=0.25,
        chat_template=None, out=str(tmp_path),
    )  # fmt: skip
    out = run(args)
    assert out["working_set_over_pool"] > 1  # every session's history does not fit the pool at once
    for c in ("pool", "ram", "disk"):
        assert out[f"{c}_errors"] == 0, out[f"{c}_first_error"]
        assert out[f"{c}_verify_failures"] == 0
    assert out["pool_cached_tokens"] == 0  # evicted before each next turn: nothing reused without tiers
    assert out["ram_ram_hit_blocks"] > 0 and out["ram_disk_hit_blocks"] == 0
    # the third turn finds blocks evicted twice on the disk only: a prefetch on arrival starts for them
    # (only there: the other two have no disk tier), and the admission reads them from the disk itself,
    # or from RAM once the prefetch promoted them in time
    assert out["disk_prefetches_started"] > 0
    assert out["pool_prefetches_started"] == out["ram_prefetches_started"] == 0
    assert out["disk_disk_hit_blocks"] > 0 or out["disk_prefetches_in_time"] > 0
    assert out["disk_prefetches_in_time"] + out["disk_prefetches_late"] <= out["disk_prefetches_started"]
    # every answer of both tier configurations compared with the tiers-off one, none different
    assert out["compared_completions"] == 2 * 3 * 3 and out["wrong_completions"] == 0
    # the services counted as reused exactly what the responses reported as cached
    assert out["service_counted_vs_served_hits"] == 1.0
    # and the router predicted it: every reused block of a tier configuration was evicted from the pool
    # before its turn (the pool configuration reuses nothing), so a router that sees only the pool
    # predicts 0 of it. The bound leaves room for a turn whose tier write, or its KV event, is late.
    assert out["served_cached_tokens"] > 0
    assert out["predicted_vs_served_hits"] >= 0.9, out
    assert out["ttft_p50_ratio_ram"] > 0 and out["ttft_p50_ratio_disk"] > 0
    assert len(out["load_before"]) == 3 and len(out["load_after"]) == 3
    assert os.path.getsize(out["plot"]) > 0
