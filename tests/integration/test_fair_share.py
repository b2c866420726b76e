"""Tenant fair share through real processes: a decode service with `--policy fair` behind a router,
tenants named by `x-splitserve-tenant`. A light tenant's request arriving to a batch full of a heavy
tenant's starts at once, in place of one of those, which is recomputed and still answers in full; a
sparse tenant with a burst allowance runs more than its share."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.cluster import Cluster, get_json

pytestmark = pytest.mark.services
FLAGS = ("--threads", "1", "--kv-cache-mb", "64", "--policy", "fair", "--max-num-seqs", "2")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    cluster = Cluster(None, str(tmp_path_factory.mktemp("logs")))
    try:
        decode = cluster.start("decode", *FLAGS)
        router = cluster.start("router", "--decode-urls", decode.url, "--local-prefill-threshold", "100000")
        yield decode, router
    finally:
        cluster.stop()


async def complete(
    client: httpx.AsyncClient, url: str, tenant: str, prompt: str, n: int
) -> tuple[float, dict]:
    body = {"model": "default", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    r = await client.post(f"{url}/v1/completions", json=body, headers={"x-splitserve-tenant": tenant})
    assert r.status_code == 200, r.text
    return time.monotonic() - t0, r.json()


def test_a_light_tenant_starts_at_once_and_the_preempted_request_still_answers_in_full(stack) -> None:  # type: ignore[no-untyped-def]
    decode, router = stack

    async def main() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            heavy = [
                asyncio.ensure_future(
                    complete(client, router.url, "heavy", f"Story {i}: once upon a time", 150)
                )
                for i in range(4)
            ]
            deadline = time.monotonic() + 60
            while get_json(decode.url + "/health")["running"] < 2:  # both slots are heavy's
                assert time.monotonic() < deadline, "the heavy tenant never filled the batch"
                await asyncio.sleep(0.05)
            light_s, light = await complete(client, router.url, "light", "The capital of France is", 4)
            heavy_done = [h.done() for h in heavy]
            answers = await asyncio.gather(*heavy)
        assert light["usage"]["completion_tokens"] == 4
        assert not all(heavy_done), "the light request finished before heavy's: it did not wait for them"
        # every heavy request answers in full, the preempted one included (its output continues where
        # it was: one Reserved frame, tokens in order)
        assert [a["usage"]["completion_tokens"] for _, a in answers] == [150] * 4
        assert light_s < min(s for s, _ in answers)

    asyncio.run(main())
    metrics = httpx.get(decode.url + "/metrics").text
    assert 'splitserve_preemptions_total{kind="recompute"}' in metrics
    h = get_json(decode.url + "/health")
    assert h["free_blocks"] == h["total_blocks"] and h["running"] == 0


def _recomputes(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('splitserve_preemptions_total{kind="recompute"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_sparse_tenant_with_a_burst_allowance_runs_over_its_share(stack) -> None:  # type: ignore[no-untyped-def]
    # "sparse" sends one request, then nothing for 2.5 s: it earns the share of the 2-slot batch it
    # leaves unused (--fair-burst-s, default 2 s of the batch). "flood" then takes both slots and sparse
    # sends two requests at once. Their demands are alike (~500 and ~600 tokens asked: neither is 4x
    # lighter), so by its share sparse gets one slot and its second request would wait for its first;
    # with the allowance both start, each in place of one of flood's (two recomputes, not one).
    decode, router = stack

    async def main() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            await complete(client, router.url, "sparse", "Hello", 4)
            await asyncio.sleep(2.5)
            before = _recomputes(decode.url)
            flood = [
                asyncio.ensure_future(complete(client, router.url, "flood", f"Tale {i}: long ago", 300))
                for i in range(2)
            ]
            deadline = time.monotonic() + 60
            while get_json(decode.url + "/health")["running"] < 2:
                assert time.monotonic() < deadline, "the flooding tenant never filled the batch"
                await asyncio.sleep(0.05)
            sparse = await asyncio.gather(
                *(
                    complete(client, router.url, "sparse", f"Question {i}: why is the sky", 240)
                    for i in range(2)
                )
            )
            taken = _recomputes(decode.url) - before
            answers = await asyncio.gather(*flood)
        assert [a["usage"]["completion_tokens"] for _, a in sparse] == [240, 240]
        assert [a["usage"]["completion_tokens"] for _, a in answers] == [300, 300]
        assert taken >= 2, f"sparse's two requests made {taken} recompute preemption(s): one waited"

    asyncio.run(main())
    h = get_json(decode.url + "/health")
    assert h["free_blocks"] == h["total_blocks"] and h["running"] == 0
