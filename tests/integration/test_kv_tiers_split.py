"""KV offload tiers across the split (issue 32, point 4): real prefill and decode processes with RAM
tiers, the tcp KV backend, a real Redis and router; every request takes the split path.

Pools of about one request's blocks on both sides, so each prompt evicts the previous one into the
tiers. The prefill service's tier holds every prompt; the decode service's only about one.
1. A, then B (A leaves both pools for the tiers), then A again: the prefill service reads A's blocks
   back instead of computing them, and the decode service reads them back too, so it receives only the
   suffix; the router predicted both hits (its KV index follows the tiers).
2. C and D push A out of the decode service's small tier (not the prefill service's): A again is read
   back on the prefill side and pushed whole, as any prefill.
Every answer equals the plain engine's (tiers off, no split), token for token. The prefill service
puts its hits into its pool layer by layer while the step computes, the decode service whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.prefix_hash import prefix_chain
from common.sampling_params import SamplingParams
from tests.integration.test_prefix_routing import hit, index_events_applied, settle_index
from tests.support.cluster import Cluster, get_json

pytestmark = pytest.mark.services
BS = 16
POOL_BLOCKS = 16  # a prompt (~12 blocks) and its answer, and a little more
MAX_TOKENS = 6
BLOCK_BYTES = 24_576  # the tiny model's KV block (fp32, its layers and heads): sizes the decode's tier
FLAGS = ("--threads", "1", "--kv-backend", "tcp")
_TIER_HITS = re.compile(r'^splitserve_kv_tier_hits_total\{tier="ram"\} (\S+)$', re.MULTILINE)
_POOL_HITS = re.compile(r"^splitserve_prefix_cache_hits_total (\S+)$", re.MULTILINE)


def story(name: str) -> list[dict[str, str]]:
    text = " ".join(f"Then {name} counted to {i} and wrote it down." for i in range(16))
    return [{"role": "user", "content": f"Read the story of {name}. {text} What did {name} do?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):  # type: ignore[no-untyped-def]
    cluster = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    env = {"SPLITSERVE_NUM_KV_BLOCKS": str(POOL_BLOCKS)}
    decode_tier_gb = 18 * BLOCK_BYTES / 2**30  # one prompt's blocks, not two
    try:
        # the prefill service puts its tier hits in layer by layer while the step computes (a copy
        # thread; its KV sender reads each layer after the layer's wait), the decode service whole
        # (auto, on a CPU)
        prefill = cluster.start(
            "prefill", *FLAGS, "--kv-offload-ram-gb", "0.25", "--kv-offload-load", "layerwise", env=env
        )
        decode = cluster.start("decode", *FLAGS, "--kv-offload-ram-gb", f"{decode_tier_gb:.9f}", env=env)
        router = cluster.start("router", "--local-prefill-threshold", "1")  # every prompt split
        yield prefill, decode, router
    finally:
        cluster.stop()


def hits(url: str) -> tuple[int, int]:
    """(pool prefix-cache hits, RAM tier hits) of a service so far, in blocks."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pool, tier = _POOL_HITS.search(text), _TIER_HITS.search(text)
    return int(float(pool.group(1))) if pool else 0, int(float(tier.group(1))) if tier else 0


def ask(router_url: str, messages: list[dict[str, str]]) -> tuple[str, str, dict]:  # type: ignore[type-arg]
    """One chat turn, once the router's index has caught up with the services' KV events."""
    body = {"model": "default", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    before = index_events_applied(router_url)
    r = httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    route = r.headers["x-splitserve-route"]
    assert route.startswith("split"), route
    settle_index(router_url, before)  # its evictions reached the tiers and the router's index
    rec = get_json(f"{router_url}/v1/requests/{r.headers['x-request-id']}")
    return r.json()["choices"][0]["message"]["content"], route, rec


def plain_answers(tiny) -> Callable[[list[dict[str, str]]], str]:  # type: ignore[no-untyped-def]
    """A chat's answer from the plain engine, tiers off (the prompt tokenized as the router does)."""
    model, tok = tiny
    reference = LLMEngine(model, tok, EngineConfig(max_num_seqs=1))

    def want(messages: list[dict[str, str]]) -> str:
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        return reference.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].text

    return want


def read_back_from_tiers(
    router_url: str,
    prefill_url: str,
    decode_url: str,
    want: Callable[[list[dict[str, str]]], str],
    reusable: int,
) -> tuple[str, dict, dict]:  # type: ignore[type-arg]
    """A, then B (A leaves both pools for their tiers), then A again: the prefill service reads A back
    instead of computing it, the decode service reads it back too so only the suffix moves, and every
    answer is the tiers-off one. The second A's route, and both A's records."""
    a = story("Ada")
    text, _, first = ask(router_url, a)
    assert text == want(a)
    text, _, _ = ask(router_url, story("Bob"))  # evicts A from both pools into their tiers
    assert text == want(story("Bob"))
    p0, d0 = hits(prefill_url), hits(decode_url)
    text, route, again = ask(router_url, a)
    p1, d1 = hits(prefill_url), hits(decode_url)
    assert text == want(a), "read back from the tiers, the answer is the tiers-off one"
    # the prefill service's computed prompt tokens fell to the tail: the rest came from pool and tier
    assert p1[1] - p0[1] > 0 and (p1[0] - p0[0]) + (p1[1] - p0[1]) == reusable, (p0, p1)
    assert d1[1] - d0[1] > 0 and (d1[0] - d0[0]) + (d1[1] - d0[1]) == reusable, (d0, d1)
    assert 0 < again["transfer_bytes"] * 4 < first["transfer_bytes"], (first, again)
    return route, first, again


def test_tier_hits_across_the_split(stack, tiny) -> None:  # type: ignore[no-untyped-def]
    prefill, decode, router = stack
    model, tok = tiny
    want = plain_answers(tiny)

    def chain(messages: list[dict[str, str]]) -> list[int]:
        return prefix_chain(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False), BS)

    a = story("Ada")
    n_ids = len(tok.encode(tok.apply_chat_template(a), add_special_tokens=False))
    reusable = (n_ids - 1) // BS  # full blocks an engine reuses (the last token is always computed)
    shared = next(i for i, (x, y) in enumerate(zip(chain(a), chain(story("Dan")), strict=False)) if x != y)
    assert POOL_BLOCKS // 2 < reusable < POOL_BLOCKS - 2, "one prompt fits the pool, two do not"

    route, first, again = read_back_from_tiers(router.url, prefill.url, decode.url, want, reusable)
    # and the router predicted both hits from the tiers' KV events
    assert hit(route, "prefix_hit") == reusable and hit(route, "prefill_prefix_hit") == reusable, route
    assert hit(route, "tier_hit") > 0, route

    for name in ("Cyd", "Dan"):  # A leaves the decode service's small tier, not the prefill service's
        text, _, _ = ask(router.url, story(name))
        assert text == want(story(name))
    p0, d0 = hits(prefill.url), hits(decode.url)
    text, route, last = ask(router.url, a)
    p1, d1 = hits(prefill.url), hits(decode.url)
    assert text == want(a)
    assert (p1[0] - p0[0]) + (p1[1] - p0[1]) == reusable and p1[1] > p0[1], (p0, p1)
    # nothing of A is left on the decode side but the chat template's blocks every story shares
    assert d1[1] == d0[1] and d1[0] - d0[0] == shared, (d0, d1, shared)
    assert again["transfer_bytes"] * 4 < last["transfer_bytes"] <= first["transfer_bytes"], "pushed whole"
    assert hit(route, "prefix_hit") == shared and hit(route, "prefill_prefix_hit") == reusable, route
