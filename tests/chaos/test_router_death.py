"""A router SIGKILLed mid-stream: its client's stream is gone with it (nothing can carry a TCP
connection across a process death), but the request must not stay live in Redis forever nor hold KV.
Real Redis, a real decode service, two real routers, a real signal."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from tests.chaos.test_decode_and_prefill_faults import metric
from tests.support.cluster import Cluster, Proc, free_port, get_json, wait_until

pytestmark = [pytest.mark.services, pytest.mark.chaos]
ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "1"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path_factory.mktemp("logs")))
    try:
        decode_ = c.start("decode", "--threads", "1", "--kv-cache-mb", "64")
        yield c, decode_
    finally:
        c.stop()
        redis.stop()


class Client(threading.Thread):
    """One streaming chat request; keeps what it saw, including how its stream ended."""

    def __init__(self, router: Proc) -> None:
        super().__init__(daemon=True)
        self.router, self.request_id, self.chunks, self.error = router, "", 0, ""

    def run(self) -> None:
        body = {
            "model": "default", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True,
        }  # fmt: skip
        try:
            with httpx.stream("POST", self.router.url + "/v1/chat/completions", json=body, timeout=60) as r:
                self.request_id = r.headers.get("x-request-id", "")
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks += "error" not in json.loads(line[len("data: ") :])
        except httpx.HTTPError as e:
            self.error = repr(e)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_killed_routers_requests_are_failed_with_a_reason_and_free_their_kv(stack, round_) -> None:  # type: ignore[no-untyped-def]
    c, decode_ = stack
    router = c.start("router")
    c.wait_routed()
    client = Client(router)
    client.start()
    wait_until(lambda: client.chunks >= 3, 60, "the stream to be generating")
    rid = client.request_id
    assert get_json(f"{router.url}/v1/requests/{rid}")["state"] == "decoding"

    os.kill(router.popen.pid, signal.SIGKILL)
    router.popen.wait(10)
    client.join(30)
    assert client.error, "the client's stream ended with its router"
    # The decode service sees its generate stream close and frees the request's blocks.
    h = c.wait_blocks_free(decode_, timeout_s=15)
    assert h["free_blocks"] == h["total_blocks"] and h["running"] == h["waiting"] == 0, h

    # Another router ends the dead one's live request in Redis, with the reason, once its key expires.
    survivor = c.start("router")
    record_url = f"{survivor.url}/v1/requests/{rid}"
    wait_until(lambda: get_json(record_url)["state"] == "failed", 30, "the orphan to be failed")
    rec = get_json(record_url)
    assert "stopped before the request ended" in rec["error"], rec
    assert metric(survivor, "splitserve_router_orphans_failed") == 1
    c.stop(survivor)
