"""`splitserve bench window`: the KV bytes a long prompt moves prefill -> decode on a model with sliding
windows, against sending every layer's whole prompt.

Gemma 3 270M (the PyPI GGUF, `--model` for another file): 18 layers, 15 sliding with a 512-token window
and 3 full. Real processes on loopback: Redis, a prefill and a decode service (tcp KV transfer, fp32 so a
block's bytes are known), a router that splits (the prompt is long) and one that never does. One prompt
of `--prompt-tokens` (4096) goes through each: the prefill service's `kv_transfer_bytes_total` rise is
what moved, and the two answers' greedy tokens must be equal (the local path computes every layer's KV
itself).

    window_bytes_fraction   bytes moved / bytes of every layer's whole prompt (goal <= 0.30)
    expected_fraction       the layer groups' arithmetic (sliding layers: blocks from the one holding
                            position prompt - window + 1; full layers: all)
    bytes_match_layer_groups  the bytes moved are exactly that arithmetic's
    greedy_equal            the split path's tokens equal the local path's
    kv_held_bytes           the most KV the decode service held for the split request (its KV blocks in
                            use, sampled every 20 ms while it ran, times the bytes of one: a page of a
                            few layers, common/kv/layer_groups.py)
    kv_held_fraction        kv_held_bytes / every layer's blocks of the prompt and answer (one block
                            table for all layers would hold 1.0; the sliding groups release what slid
                            out of their window)
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from typing import Any

import httpx
import psutil

from bench.serving import Stack, metric_sum, scrape
from bench.workload import QUESTIONS
from common.cluster.redis_server import RedisServer
from common.kv.kv_cache import KVCacheSpec
from common.model.loader import load_model
from common.model.packaged import ModelUnavailable, gemma3_270m

BLOCK = 16
ELEM = 4  # the services run fp32: a K or V value is 4 bytes


class _Peak(threading.Thread):
    """The most KV blocks a service holds in use (/health: total - free), polled until `stop`."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.most, self.done = url, 0, threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.done.wait(0.02):
                h = client.get(self.url + "/health").json()
                self.most = max(self.most, h["total_blocks"] - h["free_blocks"])

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.most


def _moved(prefill: str) -> float:
    return metric_sum(scrape(prefill), "splitserve_kv_transfer_bytes_total")


def _complete(router: str, ids: list[int], tokens: int) -> tuple[str, str, float]:
    body = {"model": "default", "prompt": ids, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = httpx.post(router + "/v1/completions", json=body, timeout=1800)
    r.raise_for_status()
    return r.json()["choices"][0]["text"], r.headers["x-splitserve-route"], time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        path = args.model or str(gemma3_270m())
    except ModelUnavailable as e:
        raise SystemExit(f"error: bench window needs Gemma 3 270M (or --model FILE): {e}") from None
    model, tok = load_model(path)
    cfg = model.config
    del model
    windows = tuple(cfg.window(i) for i in range(cfg.num_layers))
    spec = KVCacheSpec(cfg.num_layers, 1, BLOCK, cfg.num_kv_heads, cfg.head_dim, layer_windows=windows)
    n = args.prompt_tokens
    text = " ".join(QUESTIONS * (1 + n // 40))
    ids = tok.encode(text)[:n]
    assert len(ids) == n, f"the prompt text gives only {len(ids)} tokens"
    blocks = -(-n // BLOCK)
    layer_block = 2 * BLOCK * cfg.num_kv_heads * cfg.head_dim * ELEM
    sent_blocks = sum(blocks - spec.first_needed_block(i, n) for i in range(cfg.num_layers))
    every_layer = cfg.num_layers * blocks * layer_block
    # what the decode service's KV blocks are (pages of a few layers when full and sliding layers mix)
    paged = KVCacheSpec(
        cfg.num_layers, 1, BLOCK, cfg.num_kv_heads, cfg.head_dim, layer_windows=windows, paged_groups=True
    )
    page_bytes = paged.groups.layers_per_page * layer_block
    every_layer_answer = cfg.num_layers * -(-(n + args.answer_tokens) // BLOCK) * layer_block

    redis = RedisServer().start()
    stack = Stack(tempfile.mkdtemp(prefix="splitserve-window-"))
    load_before = psutil.getloadavg()
    try:
        env_flags = ["--redis-url", redis.url, "--model", path, "--threads", str(args.threads),
                     "--kv-backend", "tcp", "--kv-cache-mb", "1024", "--dtype", "float32"]  # fmt: skip
        prefill = stack.start("prefill", *env_flags, timeout_s=600)
        decode = stack.start("decode", *env_flags, timeout_s=600)
        split = stack.start("router", "--redis-url", redis.url, "--model", path)
        local = stack.start(
            "router", "--redis-url", redis.url, "--model", path, "--local-prefill-threshold", "1000000"
        )
        time.sleep(1.5)  # the routers' registry caches see both services
        before = _moved(prefill)
        peak = _Peak(decode)
        peak.start()
        split_text, split_route, split_s = _complete(split, ids, args.answer_tokens)
        held_blocks = peak.stop()
        moved = _moved(prefill) - before
        local_text, local_route, local_s = _complete(local, ids, args.answer_tokens)
    finally:
        stack.stop()
        redis.stop()
    return {
        "model": cfg.model_id,
        "prompt_tokens": n,
        "layers": cfg.num_layers,
        "layer_groups": spec.layer_groups(),
        "bytes_moved": int(moved),
        "bytes_every_layer": every_layer,
        "window_bytes_fraction": round(moved / every_layer, 4),
        "expected_fraction": round(sent_blocks / (cfg.num_layers * blocks), 4),
        "bytes_match_layer_groups": int(moved) == sent_blocks * layer_block,
        "greedy_equal": split_text == local_text,
        "kv_held_bytes": held_blocks * page_bytes,
        "kv_held_fraction": round(held_blocks * page_bytes / every_layer_answer, 4),
        "split_route": split_route,
        "local_route": local_route,
        "split_s": round(split_s, 1),
        "local_s": round(local_s, 1),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in psutil.getloadavg()],
    }
