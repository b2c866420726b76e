"""Overload is an answer, not a hang: real Redis, a real decode service with room for one sequence,
a real router with --start-timeout-s. A request that cannot start in time gets a retryable 503 (up
front when the decode queue is already too old, later when its first token is late), its work is
freed on the decode service, and its record says why."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from common.protocol import GenerateRequest, encode
from common.sampling_params import SamplingParams
from tests.support.cluster import Cluster, Proc, free_port, get_json, internal_auth, wait_until

pytestmark = pytest.mark.services
START_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()  # its own: no other module's workers in the registry
    c = Cluster(redis.url, str(tmp_path_factory.mktemp("logs")))
    try:
        decode_ = c.start("decode", "--threads", "1", "--kv-cache-mb", "64", "--max-num-seqs", "1")
        router = c.start("router", "--start-timeout-s", str(START_TIMEOUT_S))
        c.wait_routed()
        yield decode_, router
    finally:
        c.stop()
        redis.stop()


def metric(router: Proc, name: str) -> float:
    text = httpx.get(router.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def hold_the_only_slot(router: Proc, started: asyncio.Event) -> None:
    """A long generation through the router that keeps the decode service's one sequence busy
    until cancelled (the client hanging up frees it): 8,000 tokens outlast the scenario even at the
    tiny test model's few milliseconds a step."""
    body = {
        "model": "default", "prompt": "Tell me a long story.", "max_tokens": 8000, "ignore_eos": True,
        "temperature": 0, "stream": True,
    }  # fmt: skip
    async with (
        httpx.AsyncClient(timeout=120, auth=internal_auth) as client,
        client.stream("POST", router.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for _ in r.aiter_bytes():
            started.set()


async def queued_directly(decode_: Proc) -> None:
    """A request sent straight to the decode service: it waits in the queue (no free slot) until
    cancelled, ageing the queue the service reports in its registry load."""
    req = GenerateRequest(uuid.uuid4().hex, [1, 2, 3, 4], SamplingParams(max_tokens=4), mode="local")
    async with (
        httpx.AsyncClient(timeout=120, auth=internal_auth) as client,
        client.stream("POST", decode_.url + "/internal/generate", content=encode(req)) as r,
    ):
        async for _ in r.aiter_bytes():
            pass


def test_requests_that_cannot_start_in_time_get_a_retryable_503(stack) -> None:
    decode_, router = stack

    async def scenario() -> None:
        started = asyncio.Event()
        holder = asyncio.create_task(hold_the_only_slot(router, started))
        waiter: asyncio.Task[None] | None = None
        try:
            starting = asyncio.ensure_future(started.wait())
            await asyncio.wait({starting, holder}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            if holder.done():
                holder.result()  # its failure, if it failed
            assert started.is_set(), "the long request did not start"
            async with httpx.AsyncClient(timeout=60, auth=internal_auth) as client:
                # 1. Placed, but the decode service has no free slot: no first token within the limit.
                t0 = time.monotonic()
                late = await client.post(
                    router.url + "/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 4}
                )
                waited = time.monotonic() - t0
                assert late.status_code == 503, late.text
                assert late.headers["retry-after"] == "1"
                assert f"could not start within {START_TIMEOUT_S:g} s" in late.json()["error"]["message"]
                assert waited >= START_TIMEOUT_S * 0.9
                rid = late.headers["x-request-id"]
                rec = (await client.get(f"{router.url}/v1/requests/{rid}")).json()
                assert rec["state"] == "failed" and "could not start" in rec["error"], rec
                for _ in range(100):  # its decode stream was closed: the queue empties
                    if get_json(decode_.url + "/health")["waiting"] == 0:
                        break
                    await asyncio.sleep(0.1)
                assert get_json(decode_.url + "/health")["waiting"] == 0, "the late request was not freed"

                # 2. The decode queue has held a request longer than the limit: refused up front.
                waiter = asyncio.create_task(queued_directly(decode_))
                await asyncio.sleep(START_TIMEOUT_S + 2.5)  # its age reaches the registry (1 s heartbeat)
                assert get_json(decode_.url + "/health")["queue_wait_s"] >= START_TIMEOUT_S
                t0 = time.monotonic()
                shed = await client.post(
                    router.url + "/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 4}
                )
                assert shed.status_code == 503 and shed.headers["retry-after"] == "1", shed.text
                assert "could not start in time" in shed.json()["error"]["message"]
                assert time.monotonic() - t0 < START_TIMEOUT_S  # an answer at once, not after the limit
                assert get_json(decode_.url + "/health")["waiting"] == 1  # it never reached the queue
        finally:
            for task in (holder, waiter):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert metric(router, 'splitserve_router_shed_total{reason="start_timeout"}') == 1
    assert metric(router, 'splitserve_router_shed_total{reason="queue_wait"}') == 1
    # Everything is let go: the holder's hang-up and the direct request's close free the decode service.
    wait_until(
        lambda: (
            (h := get_json(decode_.url + "/health"))["running"] == h["waiting"] == 0
            and h["free_blocks"] == h["total_blocks"]
        ),
        15,
        "the decode service to be empty",
    )
