"""How much of the KV transfer hides behind the prefill compute when each layer is sent as soon as it is done.

The prefill side is an LLMEngine in this process (the real model, fp32, prefix caching off so that every
run computes the whole prompt; max_num_batched_tokens = the prompt length, so the prompt is ONE chunk).
The decode side is a receiver of `--backend` (nixl) in a spawned process with a KV cache of the same
spec; the destination block ids are a seeded random sample of its blocks (a fragmented decode cache).
The streamed sends are the prefill service's own: its KV connector posts each layer from the engine
thread (here the main thread) onto an event loop running in a helper thread.

Two modes, one prefill each per round in `--rounds` (5) rounds after one warm-up pair, the order reversed
every other round (sequential, streamed; streamed, sequential; ...) so that outside load hits both alike;
every figure is the median over the rounds of its per-round value. Times end at the receiver's `kv_done`,
read with time.perf_counter() in the receiver process (CLOCK_MONOTONIC: one clock for all processes on
the host):

    sequential: t0 step() t1 post every layer + kv_done ... t2 kv_done received
                compute_ms = t1 - t0, transfer_ms = t2 - t1, ttft_after_prefill_ms = t2 - t0
    streamed:   t0 step() (the connector posts layer i as it is done) ... wait the writes, post
                kv_done ... t2 kv_done received
                ttft_streamed_ms = t2 - t0

hidden_fraction = 1 - (ttft_streamed - compute) / transfer, clamped to [0, 1]: 1 means the transfer
cost nothing beyond the compute, 0 means it was not hidden at all. On CPU the transfer is a small
fraction of the compute, so run-to-run noise of the compute can swamp it; two parts of the streamed run
tell the two costs apart: compute_streamed_ms (its step() alone: the compute slowed by the sender thread
and the receiver sharing the cores and the GIL) and tail_ms (step() end -> kv_done received: the part of the
transfer the compute did not hide). compute_slowdown = compute_streamed_ms / compute_ms (per round, from
the same round's two runs; ratio_min/ratio_max its spread) is what streaming costs the compute itself.
On a shared 2-core machine a prefill's wall time moves by ±10 % between rounds, far more than the
transfer (~0.5 % of it), so two load-independent figures say what the wall clock cannot:
transfer_hidden_fraction = 1 - tail / transfer (how much of the transfer was over when the compute ended)
and helper_cpu_ms (CPU time the sender's event-loop thread and the receiver process used from t0 to t2,
per mode: the work streaming adds, taken from the cores the prefill computes on).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import threading
import time
from concurrent.futures import Future
from functools import partial
from typing import Any

import psutil
import torch
from tqdm import tqdm

from bench.rounds import alternate, load_avg, median, ratio_stats, spread
from bench.transfer import RemoteReceiver, checksum
from common.config import EngineConfig
from common.connector.prefill import PrefillConnector
from common.engine.llm_engine import LLMEngine
from common.model.loader import load_model
from common.protocol import KVDone, PrefillRequest
from common.sampling_params import SamplingParams
from kv_transfer import KVSender, make_sender


class Prefill:
    """The prefill side: an engine with the prefill service's KV connector, a sender, and the event loop
    thread that runs the sender and the connector's event-loop half."""

    def __init__(self, engine: LLMEngine, connector: PrefillConnector, backend: str, rx: RemoteReceiver,
                 dst_ids: list[int]) -> None:  # fmt: skip
        self.engine, self.connector, self.rx, self.dst_ids = engine, connector, rx, dst_ids
        self.num_layers = engine.model.config.num_layers
        self.last_src: list[int] = []  # the source blocks of the latest run (still holding its KV)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kv-sender-loop", daemon=True)
        self.thread.start()
        self.sender: KVSender = self._call(self._make(backend, engine.kv_compat()))
        self._loop_clock = time.pthread_getcpuclockid(self.thread.ident or 0)
        self._rx_proc = psutil.Process(rx.proc.pid)

    def _helper_cpu_s(self) -> float:
        rx = self._rx_proc.cpu_times()
        return time.clock_gettime(self._loop_clock) + rx.user + rx.system

    async def _make(self, backend: str, compat: Any) -> KVSender:
        return make_sender(backend, self.engine.kv_cache, compat, sender_id="bench-prefill")

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def once(self, rid: str, prompt: list[int], streamed: bool) -> tuple[float, float, float, float]:
        """One prefill of `prompt` whose KV ends up at the receiver: (t0, t1, t2) as in the module doc, and
        the CPU seconds the loop thread and the receiver process used from t0 to t2."""
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        req = PrefillRequest(rid, prompt, params, self.rx.endpoint, self.dst_ids, fence=1)
        rkv = self._call(self.connector.add(req))
        if not streamed:
            self.connector.stop(rkv)  # it holds the blocks but ships nothing by itself
        self.engine.add_request(prompt, params, rid, remote_kv="send")
        try:
            c0 = self._helper_cpu_s()
            t0 = time.perf_counter()
            result = self.engine.step()
            t1 = time.perf_counter()
            assert result.finished, "the prompt took more than one step"
            token = result.outputs[0].token_ids[0]
            src_ids = self.engine.scheduler.parked[rid].block_table[: len(self.dst_ids)]
            if streamed:
                self._call(self.connector.finish_sending(rkv, token, len(prompt)))
            else:
                writes = [self._post(rid, layer, src_ids) for layer in range(self.num_layers)]
                for w in writes:
                    w.result(120)
                done = KVDone(rid, 1, token, len(prompt), self.num_layers)
                self._call(self.sender.send_done(self.rx.endpoint, done))
            t2 = self.rx.done_at(rid)
            cpu = self._helper_cpu_s() - c0
            self.last_src = list(src_ids)
        finally:
            self._call(self.connector.settle(rkv))
            self.engine.finish(rid, "sent")
        return t0, t1, t2, cpu

    def _post(self, rid: str, layer: int, src_ids: list[int]) -> Future[None]:
        coro = self.sender.send_layer(self.rx.endpoint, rid, 1, layer, src_ids, self.dst_ids)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self._call(self.sender.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # read when the first agent starts; children inherit it
    load_before = load_avg()
    rounds, n = args.rounds, args.prompt_tokens
    model, tok = load_model(args.model)
    bs = 16
    needed = -(-(n + 1) // bs)
    cfg = EngineConfig(
        block_size=bs,
        num_kv_blocks=2 * needed,
        max_num_seqs=1,
        max_num_batched_tokens=n,  # the whole prompt in one chunk
        max_model_len=max(n + 1, model.config.max_position_embeddings),
        enable_prefix_caching=False,  # every run computes every token
    )
    side: Prefill | None = None
    connector = PrefillConnector(lambda endpoint: side.sender if side else _no_sender(), _failed)
    engine = LLMEngine(model, tok, cfg, connector=connector)
    spec = engine.kv_cache.spec
    rng = random.Random(args.seed)
    dst_ids = rng.sample(range(spec.num_blocks), -(-n // bs))
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for _ in range(2 * (rounds + 1))]
    rx = RemoteReceiver(args.backend, spec, engine.kv_compat())
    side = Prefill(engine, connector, args.backend, rx, dst_ids)
    bar = tqdm(total=2 * (rounds + 1), desc=f"overlap {args.backend}", unit="prefill")
    todo = {"seq": iter(enumerate(prompts[0::2])), "str": iter(enumerate(prompts[1::2]))}

    def once(mode: str) -> tuple[float, float, float, float]:
        assert side is not None
        i, prompt = next(todo[mode])
        times = side.once(f"{mode}{i}", prompt, streamed=mode == "str")
        bar.update(1)
        return times

    try:
        (
            once("seq"),
            once("str"),
        )  # warm-up: connection, handshake, descriptor lists, first-touch of the caches
        per_round = alternate({"seq": partial(once, "seq"), "str": partial(once, "str")}, rounds)
        bar.close()
        got, want = rx.checksum(dst_ids), checksum(engine.kv_cache, side.last_src)  # the last run's KV
        assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), f"checksum {got} != {want}"
    finally:
        side.close()
        rx.close()
    load_after = load_avg()
    t: dict[str, list[float]] = {
        "compute": [],
        "transfer": [],
        "sequential": [],
        "streamed": [],
        "busy": [],
        "tail": [],
        "cpu_seq": [],
        "cpu_str": [],
    }
    for (t0, t1, t2, c_seq), (s0, s1, s2, c_str) in zip(per_round["seq"], per_round["str"], strict=True):
        for k, v in {
            "cpu_seq": c_seq,
            "cpu_str": c_str,
            "compute": t1 - t0,
            "transfer": t2 - t1,
            "sequential": t2 - t0,
            "streamed": s2 - s0,
            "busy": s1 - s0,
            "tail": s2 - s1,
        }.items():
            t[k].append(v)
    hidden = spread(
        [
            min(1.0, max(0.0, 1 - (st - c) / x))
            for st, c, x in zip(t["streamed"], t["compute"], t["transfer"], strict=True)
        ]
    )
    slowdown = ratio_stats(t["busy"], t["compute"], digits=4)
    transfer_hidden = spread([max(0.0, 1 - tl / x) for tl, x in zip(t["tail"], t["transfer"], strict=True)])
    kv_bytes = spec.num_layers * 2 * n * spec.num_kv_heads * spec.head_dim * engine.kv_cache.k.element_size()

    def ms(k: str) -> float:
        return round(median(t[k]) * 1e3, 1)

    return {
        "backend": args.backend,
        "prompt_tokens": n,
        "prefill_chunks": 1,
        "kv_mb": round(kv_bytes / 1e6, 1),
        "compute_ms": ms("compute"),
        "transfer_ms": ms("transfer"),
        "ttft_after_prefill_ms": ms("sequential"),
        "ttft_streamed_ms": ms("streamed"),
        "hidden_fraction": hidden["median"],
        "hidden_fraction_min": hidden["min"],
        "hidden_fraction_max": hidden["max"],
        "compute_slowdown": slowdown["median"],
        "ratio_min": slowdown["min"],
        "ratio_max": slowdown["max"],
        "ratio_iqr": slowdown["iqr"],
        "transfer_hidden_fraction": transfer_hidden["median"],
        "transfer_hidden_fraction_min": transfer_hidden["min"],
        "helper_cpu_ms_sequential": ms("cpu_seq"),
        "helper_cpu_ms_streamed": ms("cpu_str"),
        "compute_streamed_ms": ms("busy"),
        "tail_ms": ms("tail"),
        "transfer_gb_s": round(kv_bytes / median(t["transfer"]) / 1e9, 3),
        "rounds": rounds,
        "compute_ms_rounds": [round(x * 1e3, 1) for x in t["compute"]],
        "compute_streamed_ms_rounds": [round(x * 1e3, 1) for x in t["busy"]],
        # load-independent: what moves per prefill, each way
        "layers": spec.num_layers,
        "kv_bytes": kv_bytes,
        "layer_bytes": kv_bytes // spec.num_layers,
        "torch_threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": load_after,
    }


def _no_sender() -> KVSender:
    raise AssertionError("the sender is made before the first request")


def _failed(rkv: Any, why: str) -> None:
    raise RuntimeError(f"transfer of {rkv.request_id} failed: {why}")
