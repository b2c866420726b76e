"""Prefill and decode services with tensor parallelism, as real processes: each rank moves its own KV
heads (common/parallel/plan.py), prefill and decode at different TP sizes (SmolLM2-135M's 3 KV heads
split [2, 1] over 2 ranks). Greedy tokens must be those of the one-rank, one-process engine, every
block free afterwards on both sides. Byte-exact KV per head across re-sliced shards is checked per
backend in test_kv_tcp.py / test_kv_nixl.py."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import TypeVar

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.parallel.plan import split_endpoints
from tests.integration.conftest import MAX_TOKENS, QUESTIONS
from tests.integration.test_services import run_request
from tests.support.cluster import Cluster, internal_auth

pytestmark = pytest.mark.services
FLAGS = ("--threads", "1", "--kv-cache-mb", "32")
T = TypeVar("T")


def _decode_ranks(url: str) -> dict[str, dict[str, int]]:
    return httpx.get(url + "/internal/kv", auth=internal_auth).json()["ranks"]  # type: ignore[no-any-return]


def _sent_bytes(url: str) -> dict[str, float]:
    """splitserve_kv_transfer_bytes_total by rank, from the prefill service's /metrics."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "splitserve_kv_transfer_bytes_total" and sample.value > 0:
                out[sample.labels["rank"]] = sample.value
    return out


def _wait_for(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 10.0) -> T:
    """Worker ranks report their counters to rank 0 once a second: poll until `done`."""
    deadline = time.monotonic() + timeout_s
    while not done(got := read()) and time.monotonic() < deadline:
        time.sleep(0.3)
    return got


@pytest.mark.parametrize(
    ("backend", "prefill_tp", "decode_tp"),
    [("tcp", 1, 2), ("tcp", 2, 1), ("nixl", 1, 2), ("nixl", 2, 1), ("torch_dist", 2, 1)],
)
def test_split_across_tp_sizes_matches_one_rank(  # type: ignore[no-untyped-def]
    backend, prefill_tp, decode_tp, prompts, reference, redis_url, tmp_path
) -> None:
    cluster = Cluster(redis_url, str(tmp_path))
    try:
        prefill = cluster.start("prefill", *FLAGS, "--tensor-parallel-size", str(prefill_tp))
        decode_ = cluster.start(
            "decode", *FLAGS, "--kv-backend", backend, "--tensor-parallel-size", str(decode_tp)
        )
        info = httpx.get(decode_.url + "/internal/kv", auth=internal_auth).json()
        endpoints = split_endpoints(info["kv_endpoint"])
        assert len(endpoints) == decode_tp and all(e.startswith(backend + "://") for e in endpoints)

        async def main() -> list[list[int]]:
            async with httpx.AsyncClient(timeout=120, auth=internal_auth) as c:
                outs = await asyncio.gather(
                    *(run_request(c, decode_.url, prefill.url, p, "remote", MAX_TOKENS) for p in prompts)
                )
            return [t for t, _ in outs]

        got = asyncio.run(main())
        for g, want, q in zip(got, reference, QUESTIONS, strict=True):
            assert g == want, f"TP {prefill_tp} -> {decode_tp} over {backend} differs for {q!r}"
        for proc in (prefill, decode_):
            h = cluster.wait_blocks_free(proc)
            assert h["free_blocks"] == h["total_blocks"], f"{proc.role} leaked blocks: {h}"
        # every rank moved its own heads: each decode rank received, each prefill rank sent
        ranks = _wait_for(
            lambda: _decode_ranks(decode_.url),
            lambda r: len(r) == decode_tp and all(st["bytes_received"] > 0 for st in r.values()),
        )
        for rank, st in ranks.items():
            assert st["bytes_received"] > 0 and st["stale_drops"] == 0, (rank, st)
        sent = _wait_for(lambda: _sent_bytes(prefill.url), lambda r: len(r) == prefill_tp)
        assert sorted(sent) == [str(r) for r in range(prefill_tp)] and all(sent.values()), sent
    finally:
        cluster.stop()


def _tp_workers(pid: int) -> list[psutil.Process]:
    """The service's tensor-parallel worker processes (spawned children, not the resource tracker)."""
    kids = psutil.Process(pid).children()
    return [
        p
        for p in kids
        if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())
    ]


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_rank_that_dies_takes_its_service_down_loudly(role, redis_url, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL a worker rank: its service cannot step without it, so it exits at once (status 70),
    naming the rank, instead of accepting requests it would hang on; the supervisor restarts it and the
    routers move its requests (the chaos suite covers a service that dies)."""
    cluster = Cluster(redis_url, str(tmp_path))
    try:
        proc = cluster.start(role, *FLAGS, "--tensor-parallel-size", "2")
        (worker,) = _tp_workers(proc.popen.pid)
        worker.send_signal(signal.SIGKILL)
        code = proc.popen.wait(timeout=30)
        assert code == 70, proc.log_tail()
        assert "tensor-parallel rank 1 exited" in proc.log_tail(), proc.log_tail()
    finally:
        cluster.stop()
