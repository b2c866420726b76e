"""Sliding-window layers send only their window across the split (issue 28, point 3).

Real processes over loopback: a prefill and a decode service (tcp KV transfer) and two routers on one
Redis, serving tiny random-weight models that transformers builds in the test — mistral (every layer
slides, window 8) and gemma3 (sliding and full layers interleaved). For a prompt five times the window:

* the bytes the prefill service moved are exactly what the layer groups need: every block for a full
  layer, only the blocks from the one holding position `prompt - window + 1` for a sliding layer;
* the greedy tokens of the split path equal the local path's (the decode service computing the prompt
  itself: every layer's KV, whole), request after request;
* a second prompt sharing the first one's prefix is not served from the decode service's window-only
  blocks where they lack the window its hit would read (mistral: kept out of its prefix cache; gemma3,
  laid out by layer group: in it, a hit taking a sliding page only for its window) and still equals
  the local path; for gemma3 a prompt extending a split one is a decode-side hit of its whole prefix;
* mistral's decode service has a pool of DECODE_BLOCKS, fewer than the prompt's 11 blocks: it reserves
  only the window's blocks (the ones before it are holes, common/kv/block_manager.py) and releases each
  block as it slides out while decoding, so the split request runs there (a whole reservation never
  could), and so does the local path's chunked prefill (16-token chunks); every block comes back;
* heterogeneous tensor parallelism (prefill on 1 rank, decode on 2 over tcp, and 2 -> 1 over NIXL: each
  rank moves its own KV head, window-only, into each layer group's pages): the greedy tokens equal the
  local path's, every block free on both sides.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from bench.serving import metric_sum, scrape
from common.cluster.redis_server import RedisServer
from common.kv.kv_cache import KVCacheSpec
from common.model.loader import load_model
from tests.integration.test_model_archs import ARCHS, VOCAB, build
from tests.support.cluster import Cluster, Proc, free_port

pytestmark = pytest.mark.services
BLOCK = 4  # the services' block size: a window of 8 spans blocks
PROMPT = 44  # 11 blocks, 5.5 windows
NEW_TOKENS = 12
DECODE_BLOCKS = 7  # mistral's decode service: a 16-token chunk and the window (8) before it


def _ids(seed: int, n: int = PROMPT) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp(f"window-{request.param}")
    folder = build(tmp / "model", ARCHS[request.param])
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp), model=str(folder))
    env = {"SPLITSERVE_BLOCK_SIZE": str(BLOCK), "SPLITSERVE_DTYPE": "float32"}
    try:
        flags = ("--threads", "1", "--kv-backend", "tcp")
        prefill = c.start("prefill", *flags, env=env)
        small = {"SPLITSERVE_NUM_KV_BLOCKS": str(DECODE_BLOCKS), "SPLITSERVE_MAX_NUM_BATCHED_TOKENS": "16"}
        decode = c.start("decode", *flags, env={**env, **small} if request.param == "mistral" else env)
        split = c.start("router", env={"SPLITSERVE_ROUTER_LOCAL_PREFILL_THRESHOLD": "16"})
        local = c.start("router", env={"SPLITSERVE_ROUTER_LOCAL_PREFILL_THRESHOLD": "100000"})
        c.wait_routed()
        model, _ = load_model(str(folder))
        yield {
            "prefill": prefill, "decode": decode, "split": split, "local": local, "config": model.config,
            "folder": folder, "tmp": tmp,
        }  # fmt: skip
    finally:
        c.stop()
        redis.stop()


def _complete(router: Proc, ids: list[int]) -> tuple[str, str]:
    body = {"model": "default", "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.headers["x-splitserve-route"]


def _moved_bytes(prefill: Proc) -> float:
    return metric_sum(scrape(prefill.url), "splitserve_kv_transfer_bytes_total")


def test_only_the_window_moves_and_the_tokens_equal_the_local_path(stack: dict) -> None:
    cfg = stack["config"]
    windows = tuple(cfg.window(i) for i in range(cfg.num_layers))
    assert any(w is not None for w in windows)
    spec = KVCacheSpec(cfg.num_layers, 1, BLOCK, cfg.num_kv_heads, cfg.head_dim, layer_windows=windows)
    layer_block = 2 * BLOCK * cfg.num_kv_heads * cfg.head_dim * 4  # K and V of one block of one layer, fp32
    blocks = -(-PROMPT // BLOCK)
    want = sum(blocks - spec.first_needed_block(i, PROMPT) for i in range(cfg.num_layers)) * layer_block
    every_layer = cfg.num_layers * blocks * layer_block

    for seed in (1, 2):
        ids = _ids(seed)
        before = _moved_bytes(stack["prefill"])
        text, route = _complete(stack["split"], ids)
        assert route.startswith("split"), route
        moved = _moved_bytes(stack["prefill"]) - before
        assert moved == want < every_layer, (moved, want, every_layer)
        local, route = _complete(stack["local"], ids)
        assert route.startswith("local"), route
        assert text == local

    # a prompt split, then another sharing its first 40 tokens: the decode service kept the first one's
    # window-only blocks out of its prefix cache (no hit, nothing stale read), so the second moves whole
    # again (the prefill service's own cache has the prefix: it computed every layer)
    first = _ids(4)
    assert _complete(stack["split"], first)[1].startswith("split")
    ids = first[:40] + _ids(3, PROMPT - 40)
    text, route = _complete(stack["split"], ids)
    assert route.startswith("split") and "; prefix_hit" not in route, route  # no decode-side hit
    assert text == _complete(stack["local"], ids)[0]
    if cfg.architecture != "mistral":
        # layer groups: the decode service keeps a window-only prompt in its prefix cache (a hit takes a
        # sliding page only for the window it reads), so a later prompt extending it by 8 tokens is
        # served 11 blocks from there (`cached_tokens`) and the prefill service sends only the 2 blocks
        # after them, every layer. The router did not predict it (its KV events name only blocks every
        # layer group holds: the sliding ones before the window are gone), so it split the request.
        earlier = _ids(7)
        assert _complete(stack["split"], earlier)[1].startswith("split")
        ids = earlier + _ids(8, 8)
        before = _moved_bytes(stack["prefill"])
        body = {
            "model": "default",
            "prompt": ids,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(stack["split"].url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-splitserve-route"].startswith("split"), r.headers["x-splitserve-route"]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT
        moved = _moved_bytes(stack["prefill"]) - before
        assert moved == 2 * cfg.num_layers * layer_block, (moved, 2 * cfg.num_layers * layer_block)
        assert r.json()["choices"][0]["text"] == _complete(stack["local"], ids)[0]
    if cfg.architecture == "mistral":  # the decode service's pool is smaller than one prompt
        metrics = scrape(stack["decode"].url)
        assert metric_sum(metrics, "splitserve_kv_blocks_total") == DECODE_BLOCKS < blocks
        assert metric_sum(metrics, "splitserve_kv_blocks_used") == 0  # every block came back


def test_the_kv_preflight_names_the_layer_groups(stack: dict) -> None:
    cfg = stack["config"]
    windows = tuple(cfg.window(i) for i in range(cfg.num_layers))
    spec = KVCacheSpec(cfg.num_layers, 1, BLOCK, cfg.num_kv_heads, cfg.head_dim, layer_windows=windows)
    groups = spec.layer_groups()
    assert groups.startswith(("window8:", "full:")) and "window8" in groups
    if cfg.architecture == "mistral":
        assert groups == f"window8:{cfg.num_layers}"
    else:
        assert "full:" in groups
    # both services lay a model mixing full and sliding layers out by layer group (pages of 2 layers,
    # a block table per group: common/kv/layer_groups.py) and say so; one table for mistral
    for proc in (stack["prefill"], stack["decode"]):
        with open(proc.log_path) as f:
            log = f.read()
        said = "KV layer groups: " in log and "pages (2 layers) of 4 tokens" in log
        assert said == (cfg.architecture != "mistral"), proc.log_tail()


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "backend"), [(1, 2, "tcp"), (2, 1, "nixl")])
def test_window_only_kv_across_tensor_parallel_sizes(
    stack: dict, prefill_tp: int, decode_tp: int, backend: str
) -> None:
    """Each rank's KV heads, window-only, into the other side's pages of each layer group: over tcp, and
    over NIXL (its descriptors address a layer's slot in the pages)."""
    if stack["config"].architecture == "mistral":  # ~50 s of services per model: gemma3 has both groups
        pytest.skip("gemma3 covers both layer groups (full and sliding) at TP 1->2 and 2->1")
    tmp = stack["tmp"] / f"tp{prefill_tp}{decode_tp}"
    tmp.mkdir()
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp), model=str(stack["folder"]))
    env = {"SPLITSERVE_BLOCK_SIZE": str(BLOCK), "SPLITSERVE_DTYPE": "float32"}
    try:
        flags = ("--threads", "1", "--kv-backend", backend)
        prefill = c.start("prefill", *flags, "--tensor-parallel-size", str(prefill_tp), env=env)
        decode = c.start("decode", *flags, "--tensor-parallel-size", str(decode_tp), env=env)
        split = c.start("router", env={"SPLITSERVE_ROUTER_LOCAL_PREFILL_THRESHOLD": "16"})
        c.wait_routed()
        for seed in (5, 6):
            ids = _ids(seed)
            text, route = _complete(split, ids)
            assert route.startswith("split"), route
            assert text == _complete(stack["local"], ids)[0], f"TP {prefill_tp} -> {decode_tp} differs"
        for proc in (prefill, decode):
            h = c.wait_blocks_free(proc)
            assert h["free_blocks"] == h["total_blocks"], f"{proc.role} leaked blocks: {h}"
    finally:
        c.stop()
        redis.stop()
