"""The planner against real processes: a real Redis, a decode service and a router on the tiny model.
Its signals come from the worker registry and the router's /metrics (latency, and the utilization figures:
prompt tokens and finished requests per second, max_num_seqs); `splitserve planner` prints one JSON
decision per round with its inputs, and holds (the floor) when Redis is gone; with --law forecast it
records the router's arrivals per minute in Redis, where a restarted planner finds them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from common.cluster.state import ClusterState
from planner.signals import SignalReader, describe
from tests.support.cluster import Cluster, free_port, wait_until

pytestmark = pytest.mark.services


def test_signals_and_decisions_from_a_real_stack(tmp_path) -> None:  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()
    redis_url = redis.url
    c = Cluster(redis_url, str(tmp_path))
    try:
        c.start("decode", "--threads", "1", "--kv-cache-mb", "32")
        router = c.start("router")
        c.wait_routed()

        async def read_around_traffic():  # type: ignore[no-untyped-def]
            reader = SignalReader(redis.url, router.url)
            try:
                await reader.read()  # the baseline of the router's histograms
                async with httpx.AsyncClient(timeout=60) as client:
                    for _ in range(3):
                        body = {"model": "default", "prompt": "Hello there", "max_tokens": 4}
                        r = await client.post(router.url + "/v1/completions", json=body)
                        assert r.status_code == 200, r.text
                # the registry's load is a heartbeat old: wait until it shows the three finished
                await asyncio.to_thread(wait_until, decode_idle, 10, "a heartbeat with nothing running")
                return await reader.read()
            finally:
                await reader.close()

        def decode_idle() -> bool:
            async def read() -> bool:
                state = ClusterState.from_url(redis_url)
                try:
                    [w] = await state.registry.alive("decode")
                    return int(w.load.get("running", 0)) + int(w.load.get("waiting", 0)) == 0
                finally:
                    await state.close()

            return asyncio.run(read())

        s = asyncio.run(read_around_traffic())
        assert s is not None
        assert (s.prefill.workers, s.decode.workers) == (0, 1)
        assert s.prefill.latency_s is not None and s.prefill.latency_s > 0  # p90 TTFT of those three
        assert s.decode.latency_s is not None and 0 <= s.decode.kv_used < 1
        # the utilization signals: the router's prompt tokens per second since the previous read, the
        # requests finished per second (the TPOT histogram's count), max_num_seqs from the registry
        assert s.prefill.demand is not None and s.prefill.demand > 0
        assert s.decode.finished_per_s is not None and s.decode.finished_per_s > 0
        assert s.decode.per_worker is not None and s.decode.per_worker >= 1
        assert s.decode.demand == 0.0  # nothing running once the three have finished
        # the arrivals counter (the forecast law's input): three requests over the span between the reads
        assert s.arrivals_rps is not None and s.span_s is not None and s.span_s > 0
        assert s.arrivals_rps * s.span_s == pytest.approx(3.0)

        cmd = [sys.executable, "-m", "splitserve", "planner", "--redis-url", redis.url]
        cmd += ["--router-url", router.url, "--rounds", "2", "--interval-s", "0.2"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert len(lines) == 2
        first = lines[0]
        # no prefill worker runs: the floor (1) asks for one; the decode worker is enough for no traffic
        assert (first["prefill"], first["decode"]) == (1, 1), first
        assert first["signals"]["prefill"]["workers"] == 0 and first["signals"]["decode"]["workers"] == 1
        assert set(first["inputs"]) == {"prefill", "decode"} and first["reason"]

        # the forecast law: its rate log is written to Redis as it reads, and a restarted planner reads it
        table = tmp_path / "capacity.json"
        table.write_text(json.dumps({"rows": [{"rate_rps": 10, "prefill": 1, "decode": 1}]}))
        cmd = [sys.executable, "-m", "splitserve", "planner", "--redis-url", redis.url, "--law", "forecast"]
        cmd += ["--capacity-table", str(table), "--router-url", router.url, "--rounds", "3"]
        cmd += ["--interval-s", "0.2", "--log-level", "info"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert [(d["prefill"], d["decode"]) for d in lines] == [(1, 1)] * 3
        assert lines[-1]["inputs"]["seen_rps"] == 0.0 and lines[-1]["inputs"]["forecast_rps"] is None
        assert "0 minutes of arrivals read" in out.stderr

        async def logged() -> list[bytes]:
            state = ClusterState.from_url(redis_url)
            try:  # one hash per day (two if the run crossed midnight UTC): field minute, "requests seconds"
                keys = await state.redis.keys("splitserve:planner:arrivals:86400:*")
                return [v for k in keys for v in (await state.redis.hgetall(k)).values()]
            finally:
                await state.close()

        minutes = asyncio.run(logged())
        assert minutes and all(float(v.split()[1]) > 0 for v in minutes)  # seconds observed
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"{len(minutes)} minutes of arrivals read" in out.stderr
    finally:
        c.stop()
        redis.stop()
    # Redis gone: every round is an outage; the decisions hold at the floor, never below
    cmd = [sys.executable, "-m", "splitserve", "planner", "--redis-url", redis_url, "--rounds", "2"]
    cmd += ["--interval-s", "0.1", "--min-decode", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    held = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(d["prefill"], d["decode"]) for d in held] == [(1, 2), (1, 2)]
    assert all("holding" in d["reason"] for d in held) and "signals unavailable" in out.stderr


def test_every_live_router_is_read_and_summed(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """--discover-routers: each router registers its URL in Redis; the planner reads every live one and
    sums their figures (arrivals, finished requests, the TTFT histogram); a router that stops cleanly
    leaves the list at once; one that is killed fails the read (the planner holds) until its
    registration expires."""
    from common.cluster.owners import live_router_urls

    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path))
    try:
        c.start("decode", "--threads", "1", "--kv-cache-mb", "32")

        async def alone():  # type: ignore[no-untyped-def]
            reader = SignalReader(redis.url, None, discover=True)
            try:
                return [await reader.read() for _ in range(2)]
            finally:
                await reader.close()

        # no router registered yet: the load signals alone, and a warning (once) that says why
        with caplog.at_level("WARNING", logger="splitserve.planner"):
            first, second = asyncio.run(alone())
        assert first is not None and second is not None and second.arrivals_rps is None
        assert second.routers is None and "routers" not in describe(second)
        said = [r for r in caplog.records if "no router has registered" in r.getMessage()]
        assert len(said) == 1
        a, b = c.start("router"), c.start("router")
        c.wait_routed()

        async def listed() -> set[str]:
            state = ClusterState.from_url(redis.url)
            try:
                return set((await live_router_urls(state.redis, state.prefix)).values())
            finally:
                await state.close()

        wait_until(lambda: asyncio.run(listed()) == {a.url, b.url}, 10, "both routers registered")

        async def complete(client: httpx.AsyncClient, url: str) -> None:
            # two tokens each, always: a request's TPOT (the finished count) needs more than one
            body = {"model": "default", "prompt": "Hello there", "max_tokens": 2, "ignore_eos": True}
            r = await client.post(url + "/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text

        async def around(reader: SignalReader, sends: list[str]):  # type: ignore[no-untyped-def]
            await reader.read()  # each router's baseline
            async with httpx.AsyncClient(timeout=60) as client:
                for url in sends:
                    await complete(client, url)
            return await reader.read()

        async def scenario():  # type: ignore[no-untyped-def]
            reader = SignalReader(redis.url, None, discover=True)
            try:
                s = await around(reader, [a.url, a.url, b.url, b.url, b.url])
                assert s is not None and s.arrivals_rps is not None and s.span_s is not None
                assert s.arrivals_rps * s.span_s == pytest.approx(5.0)  # 2 through a, 3 through b
                assert s.routers == 2 and describe(s)["routers"] == 2  # in each decision's log line
                assert s.decode.finished_per_s is not None
                assert s.decode.finished_per_s * s.span_s == pytest.approx(5.0)
                assert s.prefill.latency_s is not None and s.prefill.latency_s > 0
                c.stop(b)  # cleanly: its registration goes with it
                assert await listed() == {a.url}
                s = await around(reader, [a.url])
                assert s is not None and s.arrivals_rps is not None and s.span_s is not None
                assert s.arrivals_rps * s.span_s == pytest.approx(1.0) and s.routers == 1
                d = c.start("router")
                await asyncio.to_thread(wait_until, lambda: asyncio.run(listed()) == {a.url, d.url}, 10, "d")
                d.popen.kill()  # registered, not answering: an outage until its key expires
                d.popen.wait()
                assert await reader.read() is None
            finally:
                await reader.close()

        asyncio.run(scenario())
        # `splitserve planner --discover-routers` runs the forecast law on it
        table = tmp_path / "capacity.json"
        table.write_text(json.dumps({"rows": [{"rate_rps": 10, "prefill": 1, "decode": 1}]}))
        cmd = [sys.executable, "-m", "splitserve", "planner", "--redis-url", redis.url, "--law", "forecast"]
        cmd += ["--capacity-table", str(table), "--discover-routers", "--rounds", "2", "--interval-s", "0.2"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert len(lines) == 2
        both = cmd + ["--router-url", a.url]
        out = subprocess.run(both, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "not both" in out.stderr
    finally:
        c.stop()
        redis.stop()
