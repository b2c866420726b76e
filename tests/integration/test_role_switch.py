"""Role switching on real processes (Redis, two services, the router): a prefill service becomes a decode
service and back, and a decode service the other way, each without a restart (POST /internal/role,
signed). After every switch the registry shows the new role under the same worker id with a new
incarnation, /health shows every block of the fresh pool free, no lease is left, and the router routes
the worker in its new role only: a split request lands on it in that role."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest

from common.cluster.state import ClusterState
from common.service.base import stop_bounded
from tests.support.cluster import Cluster, Proc, get_json, internal_auth, leases_left, wait_until

pytestmark = pytest.mark.services
FLAGS = ("--threads", "1", "--kv-cache-mb", "64")
QUESTION = "Name three colors and say one thing about each of them."


def registry(redis_url: str) -> dict[str, tuple[str, str]]:
    """worker id -> (role, incarnation) of every registered service."""

    async def read() -> dict[str, tuple[str, str]]:
        state = ClusterState.from_url(redis_url)
        try:
            out = {}
            for role in ("prefill", "decode"):
                out.update({w.id: (w.role, w.incarnation) for w in await state.registry.alive(role)})
            return out
        finally:
            await state.close()

    return asyncio.run(read())


def switch(p: Proc, role: str, redis_url: str) -> dict[str, Any]:
    """Switch p to `role`; check the answer, the registry, /health and the ledger right after."""
    before = get_json(p.url + "/health")
    r = httpx.post(p.url + "/internal/role", json={"role": role}, auth=internal_auth, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["switched"] and body["role"] == role
    assert body["previous_incarnation"] == before["incarnation"] != body["incarnation"]
    released = body["released"]
    assert released["free_blocks"] == released["total_blocks"] and released["leases_left"] == 0, released
    assert released["kv_released"] == 1 and released["stuck_requests"] == 0, released
    h = get_json(p.url + "/health")
    assert h["role"] == role and h["worker_id"] == before["worker_id"]
    assert h["incarnation"] == body["incarnation"]
    assert h["free_blocks"] == h["total_blocks"] > 0 and h["running"] == h["waiting"] == 0, h
    assert leases_left(redis_url) == 0
    wait_until(
        lambda: registry(redis_url).get(h["worker_id"]) == (role, body["incarnation"]),
        5,
        f"{h['worker_id']} registered as {role} with its new incarnation",
    )
    return h


def split_request(router: Proc) -> dict[str, Any]:
    body = {
        "model": "default", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
        "max_tokens": 12, "ignore_eos": True,
    }  # fmt: skip
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-splitserve-route"].startswith("split"), r.headers["x-splitserve-route"]
    record = get_json(f"{router.url}/v1/requests/{r.headers['x-request-id']}")
    assert record["state"] == "finished", record
    return {"text": r.json()["choices"][0]["message"]["content"], **record}


def wait_roles(router: Proc, decode: int, prefill: int) -> None:
    def sees() -> bool:
        h = get_json(router.url + "/health")
        return bool(h["decode_workers"] == decode and h["prefill_workers"] == prefill)

    wait_until(sees, 10, f"the router to route on {decode} decode and {prefill} prefill services")


def test_services_switch_roles_and_back(tmp_path, redis_url) -> None:  # type: ignore[no-untyped-def]
    c = Cluster(redis_url, str(tmp_path))
    try:
        a = c.start("prefill", *FLAGS)
        b = c.start("decode", *FLAGS)
        router = c.start("router", "--local-prefill-threshold", "1")  # every prompt split
        c.wait_routed()
        a_id, b_id = get_json(a.url + "/health")["worker_id"], get_json(b.url + "/health")["worker_id"]
        want = split_request(router)
        assert (want["prefill_id"], want["decode_id"]) == (a_id, b_id)
        # a role this process never held: its routes answer as they always did (404), not 503
        never = httpx.post(a.url + "/internal/generate", content=b"", auth=internal_auth, timeout=10)
        assert never.status_code == 404, never.text

        switch(a, "decode", redis_url)  # two decode services for a moment, no prefill
        switch(b, "prefill", redis_url)
        wait_roles(router, decode=1, prefill=1)
        got = split_request(router)
        assert (got["prefill_id"], got["decode_id"]) == (b_id, a_id), "routed by the new roles"
        assert got["text"] == want["text"]  # greedy: the same text whichever way round

        # a role's own routes answer a retryable 503 once the process switched away from it
        r = httpx.post(b.url + "/internal/generate", content=b"", auth=internal_auth, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        r = httpx.post(a.url + "/internal/prefill", content=b"", auth=internal_auth, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text

        switch(b, "decode", redis_url)  # and back
        switch(a, "prefill", redis_url)
        wait_roles(router, decode=1, prefill=1)
        again = split_request(router)
        assert (again["prefill_id"], again["decode_id"]) == (a_id, b_id)
        assert again["text"] == want["text"]
        # a held decode route now answers 503 on a too (it was decode for a while)
        r = httpx.post(a.url + "/internal/generate", content=b"", auth=internal_auth, timeout=10)
        assert r.status_code == 503, r.text

        # the same role again: nothing happens; a bad body is a 400 with an OpenAI-style error
        same = httpx.post(a.url + "/internal/role", json={"role": "prefill"}, auth=internal_auth, timeout=10)
        assert same.status_code == 200 and same.json()["switched"] is False
        bad = httpx.post(a.url + "/internal/role", json={"role": "router"}, auth=internal_auth, timeout=10)
        assert bad.status_code == 400 and "role must be" in bad.json()["error"]["message"]
        unsigned = httpx.post(a.url + "/internal/role", json={"role": "decode"}, timeout=10)
        assert unsigned.status_code == 401
        assert get_json(a.url + "/health")["role"] == "prefill"
    finally:
        c.stop()


class SwallowingLoop:
    """A part whose loop task loses its first cancellation, as a Redis client caught mid-command can
    (the CancelledError turns into an error the loop catches and goes on): its own stop() then waits
    for the task forever."""

    def __init__(self) -> None:
        self.running = asyncio.Event()  # set once the loop waits (what stop() cancels)
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        swallowed = False
        never = asyncio.Event()  # the loop's work: a wait that only a cancellation ends
        while True:
            try:
                self.running.set()
                await never.wait()
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed = True  # the first one is lost

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def test_a_stop_that_would_hang_is_bounded_and_its_loop_ended() -> None:
    async def run() -> None:
        part = SwallowingLoop()
        await asyncio.wait_for(part.running.wait(), 10)
        assert not await stop_bounded("test part", part.stop(), part, timeout_s=0.3)
        assert part._task.done()  # cancelled again until it ended: nothing of the old role goes on

        async def fine() -> None:
            return None

        assert await stop_bounded("fine part", fine(), timeout_s=1)

        async def failing() -> None:
            raise RuntimeError("boom")

        assert not await stop_bounded("failing part", failing(), timeout_s=1)

    asyncio.run(run())
