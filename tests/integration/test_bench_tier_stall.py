"""The `tier-stall` benchmark end to end on the tiny test model, in both of its comparisons: the
prefetch wait on and off, and disk reads auto against always (one round each, page-cached disk)."""

from __future__ import annotations

import argparse

import pytest

from bench.tier_stall import run
from tests.support.tiny_model import tiny_model_path


@pytest.mark.parametrize("compare", ["wait", "disk-reads"])
def test_tier_stall_bench_runs_a_disk_hit_beside_decoding_requests(compare: str) -> None:
    args = argparse.Namespace(
        model=tiny_model_path(), threads=1, prompt_tokens=512, rounds=1, cold_disk=False,
        disk_read_mbps=None, compare=compare,
    )  # fmt: skip
    out = run(args)
    first, second = ("wait", "no_wait") if compare == "wait" else ("auto", "always")
    assert out["compare"] == compare and out["tokens_equal"], "both sides answer P alike"
    for side in (first, second):
        assert out[f"{side}_ttft_ms"]["median"] > 0 and out[f"{side}_stall_ms"]["median"] > 0
    assert out["stall_ratio"]["median"] > 0 and out["ttft_ratio"]["median"] > 0
    if compare == "wait":
        assert out["no_wait_deferred_steps"]["median"] == 0, "with the wait off nothing waits"
    else:
        assert out["always_disk_skipped_blocks"] == 0, "always reads every disk hit"


def test_tier_stall_refuses_a_prompt_too_short_for_its_pool() -> None:
    args = argparse.Namespace(
        model=tiny_model_path(), threads=1, prompt_tokens=256, rounds=1, cold_disk=False,
        disk_read_mbps=None, compare="wait",
    )  # fmt: skip
    with pytest.raises(ValueError, match="at least 512"):
        run(args)
