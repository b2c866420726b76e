"""Failures with real processes: a prefill service killed mid-prefill, a decode service killed
mid-transfer, a prefill service that hangs. Within the lease time every block on the survivor is
free again, and the request either finishes another way or ends FAILED with the reason in Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from dataclasses import dataclass

import httpx
import pytest

from common.cluster.state import ClusterState
from tests.support.cluster import Cluster, Proc, get_json, wait_until

pytestmark = pytest.mark.services
LEASE_S = 2.0
# 16-token chunks: the ~1,500-token prompt below takes ~100 prefill steps, long enough to fail in the
# middle of even on the tiny test model
FLAGS = ("--threads", "1", "--kv-cache-mb", "256", "--lease-s", str(LEASE_S))
FLAGS += ("--max-num-batched-tokens", "16")
PROMPT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(110))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url):  # type: ignore[no-untyped-def]
    c = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    yield c
    for p in c.procs:
        if p.popen.poll() is None:
            os.kill(p.popen.pid, signal.SIGCONT)
    c.stop()


@dataclass
class Services:
    prefill: Proc
    decode: Proc
    router: Proc


ROUTER_FLAGS = ("--transfer-failure-policy", "recompute")


@pytest.fixture
def services(cluster: Cluster) -> Services:
    """One healthy prefill service, decode service and router (recompute policy), each the only one of
    its role, and the router routing on exactly those two, whatever an earlier test of this module left
    behind on this worker (tests run in any order, alone, or split across xdist workers): a healthy
    process is reused; one an earlier test killed, or left unhealthy, is replaced. Each test then kills
    or stops one of them, and the next test's `services` replaces that one only."""
    procs, started = {}, False
    for role, flags in (("prefill", FLAGS), ("decode", FLAGS), ("router", ROUTER_FLAGS)):
        keep = None
        for p in [p for p in cluster.procs if p.role == role]:
            if p.popen.poll() is None:
                os.kill(p.popen.pid, signal.SIGCONT)  # an earlier test's SIGSTOP, should it have failed
            # a router that routed while a service was replaced may answer from the registry as it was
            # (it re-reads it every fraction of a second): a fresh one reads it after the wait below
            fresh = role != "router" or not started
            if keep is None and fresh and p.popen.poll() is None and healthy(cluster, p):
                keep = p
            else:  # dead (killed by an earlier test), unhealthy, stale, or one too many
                cluster.stop(p)
        if keep is None:
            if role == "router":
                # A service killed by an earlier test (SIGKILL: no deregistration) stays in the registry
                # until its entry expires (the worker TTL, 5 s); a router placing on it would change the
                # route the test checks. The router starts once the registry holds just the services above.
                wait_until(lambda: registered(cluster) == (1, 1), 15, "the registry to list one of each")
            keep = cluster.start(role, *flags)
            started = True
        procs[role] = keep
    wait_until(lambda: registered(cluster) == (1, 1), 15, "the registry to list one of each service")
    wait_until(lambda: routes_on(procs["router"]) == (1, 1), 15, "the router to route on one of each")
    return Services(procs["prefill"], procs["decode"], procs["router"])


def healthy(cluster: Cluster, p: Proc) -> bool:
    """p answers /health; a service also holds no request and no KV block (the leases of a failed
    earlier test's transfer free its blocks within a few lease times)."""
    try:
        if p.role == "router":
            return bool(get_json(p.url + "/health")["status"] == "ok")
        h = cluster.wait_blocks_free(p, timeout_s=LEASE_S * 4)
    except OSError:
        return False
    return bool(h["free_blocks"] == h["total_blocks"] and h["running"] == 0 and h["waiting"] == 0)


def registered(cluster: Cluster) -> tuple[int, int]:
    """(prefill, decode) services the registry in Redis lists (as a router reads it: unexpired entries)."""
    assert cluster.redis_url

    async def count() -> tuple[int, int]:
        state = ClusterState.from_url(cluster.redis_url or "")
        try:
            return len(await state.registry.alive("prefill")), len(await state.registry.alive("decode"))
        finally:
            await state.close()

    return asyncio.run(count())


def routes_on(router: Proc) -> tuple[int, int]:
    """(prefill, decode) services the router routes on, as its /health says."""
    try:
        h = get_json(router.url + "/health")
    except OSError:
        return (-1, -1)
    return (h["prefill_workers"], h["decode_workers"])


def start_request(router: Proc, result: dict, tag: str) -> threading.Thread:
    """The long prompt, made unique by `tag` at its start: a service that holds an earlier test's prompt
    in its prefix cache would otherwise get it (prefix-aware routing) and compute nothing to fail in."""

    def run() -> None:
        r = httpx.post(
            router.url + "/v1/completions",
            timeout=120,
            json={"model": "default", "prompt": f"{tag}. {PROMPT}", "max_tokens": 4, "temperature": 0},
        )
        result["response"] = r

    t = threading.Thread(target=run)
    t.start()
    return t


def prefilling(p: Proc) -> bool:
    return get_json(p.url + "/health")["running"] > 0


def record(router: Proc, request_id: str) -> dict:
    return get_json(f"{router.url}/v1/requests/{request_id}")


def test_prefill_killed_mid_prefill_is_recomputed_on_decode(cluster: Cluster, services: Services) -> None:
    prefill, decode_, router = services.prefill, services.decode, services.router
    result: dict = {}
    t = start_request(router, result, "Prefill killed")
    wait_until(lambda: prefilling(prefill), 60, "the prefill to start")
    prefill.popen.kill()
    t.join(120)
    r = result["response"]
    assert r.status_code == 200, r.text
    assert r.headers["x-splitserve-route"] == "local; reason=prefill_failed"
    rec = record(router, r.headers["x-request-id"])
    assert rec["state"] == "finished" and rec["route"] == "local:prefill_failed", rec
    h = cluster.wait_blocks_free(decode_, timeout_s=LEASE_S * 3)
    assert h["free_blocks"] == h["total_blocks"], h
    cluster.stop(prefill)


def test_decode_killed_mid_transfer_frees_prefill_blocks(cluster: Cluster, services: Services) -> None:
    prefill, decode_, router = services.prefill, services.decode, services.router
    result: dict = {}
    t = start_request(router, result, "Decode killed")
    wait_until(lambda: prefilling(prefill), 60, "the prefill to start")
    decode_.popen.kill()
    h = cluster.wait_blocks_free(prefill, timeout_s=LEASE_S * 3)
    assert h["free_blocks"] == h["total_blocks"], f"the prefill service kept blocks for a dead peer: {h}"
    t.join(120)
    r = result["response"]
    assert r.status_code >= 500
    rec = record(router, r.headers["x-request-id"])
    assert rec["state"] == "failed" and rec.get("error"), rec
    cluster.stop(decode_)


def test_hung_prefill_lease_expires_and_the_policy_applies(cluster: Cluster, services: Services) -> None:
    """A prefill service that hangs (alive, silent): the decode service's lease watch ends the
    reservation, the router reads that from the decode stream instead of waiting on the hung call,
    and its policy (recompute here) finishes the request on the decode service."""
    prefill, decode_, router = services.prefill, services.decode, services.router
    result: dict = {}
    t = start_request(router, result, "Prefill hung")
    wait_until(lambda: prefilling(prefill), 60, "the prefill to start")
    os.kill(prefill.popen.pid, signal.SIGSTOP)  # hung: its lease stops renewing
    try:
        t.join(120)
        r = result["response"]
        assert r.status_code == 200, r.text
        assert r.headers["x-splitserve-route"] == "local; reason=prefill_failed"
        rec = record(router, r.headers["x-request-id"])
        states = [s for s, _ in rec["history"]]
        # the recompute's reservation is recorded when the record had moved on to PREFILLING (RESERVED ->
        # RESERVED is no move); under load the hung service can stop before its PREFILLING write lands
        assert rec["state"] == "finished", rec
        assert states.count("reserved") == (2 if "prefilling" in states else 1), rec
        h = cluster.wait_blocks_free(decode_, timeout_s=LEASE_S * 3)
        assert h["free_blocks"] == h["total_blocks"], h
    finally:
        os.kill(prefill.popen.pid, signal.SIGCONT)
    # the prefill service, back, finds the decode side's lease gone and frees its blocks too
    h = cluster.wait_blocks_free(prefill, timeout_s=LEASE_S * 4)
    assert h["free_blocks"] == h["total_blocks"], h
