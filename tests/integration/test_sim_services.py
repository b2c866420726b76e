"""The simulated engine behind the real services: a router, a sim prefill and a sim decode service as
processes on 127.0.0.1 with a real Redis, requests over the split path with the KV pushed over TCP. The
sim replaces only the model, so the text must be the in-process sim engine's, the transfer must move the
sim pool's real bytes, and every block must be free afterwards."""

from __future__ import annotations

import httpx
import pytest

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from tests.support.cluster import Cluster, Proc, get_json, internal_auth, wait_router_sees

pytestmark = pytest.mark.services
SIM_FLAGS = ("--engine", "sim", "--sim-profile", "llama3-8b-h200", "--sim-output-len", "6", "--threads", "1")
PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three most important ideas in the history of science are, in my opinion,",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):  # type: ignore[no-untyped-def]
    cluster = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    try:
        prefill = cluster.start("prefill", *SIM_FLAGS)
        decode_ = cluster.start("decode", *SIM_FLAGS, "--kv-backend", "tcp")
        router = cluster.start("router", "--local-prefill-threshold", "0")  # every prompt goes split
        cluster.wait_routed()
        yield cluster, prefill, decode_, router
    finally:
        cluster.stop()


def test_split_requests_complete_with_the_sims_tokens_and_real_kv_bytes(stack) -> None:  # type: ignore[no-untyped-def]
    cluster, prefill, decode_, router = stack
    engine = LLMEngine.from_config(EngineConfig(engine="sim", sim_profile="llama3-8b-h200", sim_output_len=6))
    health = get_json(decode_.url + "/health")
    assert health["total_blocks"] == engine.block_manager.num_blocks  # the profile's count, not the pool's
    before = httpx.get(decode_.url + "/internal/kv", auth=internal_auth).json()["stats"]["bytes_received"]
    blocks = 0
    for prompt in PROMPTS * 2:  # each prompt twice: the same text both times
        r = httpx.post(
            router.url + "/v1/completions",
            timeout=60,
            json={"model": "default", "prompt": prompt, "max_tokens": 16},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-splitserve-route"].startswith("split"), r.headers["x-splitserve-route"]
        body = r.json()
        ids = engine.tokenizer.encode(prompt)
        want = engine.generate([ids], SamplingParams(max_tokens=16))[0]
        assert body["choices"][0]["text"] == want.text
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "stop"
        rec = get_json(f"{router.url}/v1/requests/{r.headers['x-request-id']}")
        assert rec["transfer_backend"] == "tcp" and rec["transfer_bytes"] > 0, rec
        blocks += -(-len(ids) // 16)
    after = httpx.get(decode_.url + "/internal/kv", auth=internal_auth).json()["stats"]["bytes_received"]
    # a prefix-cache hit on the decode service sends less than the whole prompt: at most every block
    assert 0 < after - before <= blocks * engine.kv_cache.spec.bytes_per_block
    for proc in (prefill, decode_):
        h = cluster.wait_blocks_free(proc)
        assert h["free_blocks"] == h["total_blocks"], h


def test_sim_fleet_runs_many_registered_services_in_one_process(tmp_path, redis_url) -> None:  # type: ignore[no-untyped-def]
    from bench.serving import free_ports, on_fresh_ports

    # Redis database 1: the module's other stack (database 0) is still registered and must not be routed to
    cluster = Cluster(redis_url.rstrip("/") + "/1", str(tmp_path))

    def start_fleet() -> tuple[int, Proc]:
        """Three services on consecutive ports; others again if another process took one of them
        first (the test workers and everything else on the machine pick ports at once)."""
        base = free_ports(3)
        return base, cluster.start(
            "sim-fleet", "--prefill", "1", "--decode", "2", "--sim-output-len", "3", port=base
        )

    try:
        base, fleet = on_fresh_ports(start_fleet)
        router = cluster.start("router")
        wait_router_sees(router, decode=2, prefill=1)
        for port in range(base, base + 3):  # each its own HTTP server, registered under its own id
            assert get_json(f"http://127.0.0.1:{port}/health")["total_blocks"] > 0
        used = set()
        for i in range(6):
            r = httpx.post(
                router.url + "/v1/completions",
                timeout=60,
                json={"model": "default", "prompt": f"{i} " + PROMPTS[0], "max_tokens": 8},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
            used.add(get_json(f"{router.url}/v1/requests/{r.headers['x-request-id']}")["decode_id"])
        assert used <= {f"decode-sim-127.0.0.1-{base + 1}", f"decode-sim-127.0.0.1-{base + 2}"} and used
        assert fleet.popen.poll() is None
    finally:
        cluster.stop()
