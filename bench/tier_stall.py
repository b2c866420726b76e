"""What a disk-tier hit costs the requests already running: its admission reads the disk on the engine's
thread (`--kv-offload-prefetch-wait-s 0`), or it waits, while they run, for the prefetch its arrival
started and then reads RAM (the default, common/engine/scheduler.py).

One engine per side in this process (SmolLM2 by default, fp32, `--threads`), each with a RAM tier of
about one chunk and a disk tier (a temp dir), on a pool that holds a long prompt and a little more.
A long prompt P (`--prompt-tokens`, 2048) is made disk-only: computed and evicted whole twice (two
fillers as long turn the pool over; the disk takes a block on its second eviction), and the fillers
push it out of the pool and of RAM again before every round. A round:
four short requests start decoding (64 tokens each); two steps later P plus a 32-token turn arrives;
the engine steps until P's first token. Timed, per step: its wall time. Reported per side, the median
over `--rounds` rounds (the sides alternate, A B, B A, ...), of
- `stall_ms`: the longest step from P's arrival to its first token: what the running requests' TPOT
  took at worst (P's admission step computes its 32 new tokens on either side; the difference between
  the sides is the disk read on the engine's thread);
- `ttft_ms`: P's arrival to its first token;
- `decode_step_ms`: the median step before P arrived (the running requests alone);
- `deferred_steps`: steps P waited for its prefetch (0 with the wait off).
Before each round P is checked to be on the disk only, and its tokens must equal on both sides.
`--cold-disk`: the disk tier's files are dropped from the page cache before each hit (fsync, then
posix_fadvise DONTNEED), so its reads go to the device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from bench.rounds import alternate, load_avg, ratio_stats, spread
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.loader import load_model
from common.prefix_hash import ROOT, prefix_chain
from common.sampling_params import SamplingParams

BLOCK = 16
NEW, DECODERS, DECODE_TOKENS = 32, 4, 64
TEXT = (
    "The lighthouse keeper climbed the spiral stairs at dusk, counting the steps as his father had, "
    "and wound the clockwork that turned the lens. Out at sea the fishing boats came home in a line. "
)
SIDES = {"wait": 5.0, "no_wait": 0.0}


def _ids(tok: Any, n: int, salt: str) -> list[int]:
    ids = tok.encode(salt + " " + TEXT * (1 + n // 30))[:n]
    assert len(ids) == n, f"the text gives only {len(ids)} tokens"
    return ids


class Side:
    def __init__(
        self, model: Any, tok: Any, wait_s: float, n: int, disk_dir: str, cold: bool = False
    ) -> None:
        self.cold = cold
        self.prompt = _ids(tok, n, "Story one.")
        self.fillers = [_ids(tok, n, "Story two."), _ids(tok, n, "Story three.")]
        self.turn = _ids(tok, NEW, "And then?")
        self.short = [_ids(tok, 8, f"Note {i}.") for i in range(DECODERS)]
        blocks = -(-n // BLOCK)
        c = model.config
        block_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * BLOCK  # fp32 K and V
        cfg = EngineConfig(
            dtype="float32",
            num_kv_blocks=blocks + 48,
            max_num_batched_tokens=max(n, 512),
            kv_offload_ram_gb=(BLOCK + 2) * block_bytes / 2**30,  # one chunk
            kv_offload_disk_dir=disk_dir,
            kv_offload_disk_gb=4.0,
            kv_offload_prefetch_wait_s=wait_s,
        )
        self.engine = LLMEngine(model, tok, cfg)
        self.hashes = prefix_chain(self.prompt, BLOCK, root=ROOT)[: (n - 1) // BLOCK]
        one = SamplingParams(max_tokens=1, temperature=0.0)
        # P evicted whole twice (two fillers turn the pool over): the disk takes a block on its second
        for p in (self.prompt, *self.fillers, self.prompt, *self.fillers):
            self.engine.generate([p], one)
            self._settle()
        self.tokens: list[list[int]] = []
        self.figures: list[dict[str, float]] = []

    def _settle(self) -> None:
        off = self.engine.kv_offload
        assert off is not None
        off.flush()
        assert off.store.wait_idle(60) and off.store.wait_prefetched(60)

    def _drop_page_cache(self) -> None:
        """The disk tier's files out of the page cache (written back first): the hit's reads go to the
        device, as a cold or network disk's would."""
        slot = self.engine.kv_offload.store.slot  # type: ignore[union-attr]
        assert slot is not None
        for path in slot.iterdir():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def _disk_only(self) -> bool:
        store = self.engine.kv_offload.store  # type: ignore[union-attr]
        assert store.ram is not None and store.disk is not None
        return not any(store.ram.holds(h) for h in self.hashes) and all(
            store.disk.holds(h) for h in self.hashes
        )

    def round(self) -> float:
        e, one = self.engine, SamplingParams(max_tokens=1, temperature=0.0)
        for f in self.fillers:  # P out of the pool and RAM, onto the disk only
            e.generate([f], one)
            self._settle()
        assert self._disk_only(), "P must be on the disk only before its hit"
        if self.cold:
            self._drop_page_cache()
        decode = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
        for s in self.short:
            e.add_request(s, decode)
        steps: list[float] = []
        for _ in range(3):
            t0 = time.perf_counter()
            e.step()
            steps.append(time.perf_counter() - t0)
        deferred = e.scheduler.stats["prefetch_deferred"]
        arrived = time.perf_counter()
        rid = e.add_request(self.prompt + self.turn, one)
        during: list[float] = []
        first: list[int] = []
        while not first:
            t0 = time.perf_counter()
            out = e.step()
            during.append(time.perf_counter() - t0)
            first = [t for o in out.outputs if o.request_id == rid for t in o.token_ids]
        ttft = time.perf_counter() - arrived
        while e.has_unfinished():
            e.step()
        self.tokens.append(first)
        self.figures.append(
            {
                "stall_ms": max(during) * 1000,
                "ttft_ms": ttft * 1000,
                "decode_step_ms": statistics.median(steps[1:]) * 1000,
                "deferred_steps": e.scheduler.stats["prefetch_deferred"] - deferred,
            }
        )
        return max(during) * 1000


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    n = args.prompt_tokens or 2048
    load_before = load_avg()
    with tempfile.TemporaryDirectory(prefix="splitserve-tier-stall-") as tmp:
        sides = {
            name: Side(model, tok, wait, n, f"{tmp}/{name}", args.cold_disk) for name, wait in SIDES.items()
        }
        try:
            alternate({name: s.round for name, s in sides.items()}, args.rounds, "tier-stall")
        finally:
            for s in sides.values():
                s.engine.close()
    fig = {name: s.figures for name, s in sides.items()}
    out: dict[str, Any] = {
        "model": model.config.model_id,
        "prompt_tokens": n,
        "new_tokens": NEW,
        "decoders": DECODERS,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "tokens_equal": sides["wait"].tokens == sides["no_wait"].tokens,
        "cold_disk": bool(args.cold_disk),
    }
    for name in SIDES:
        for key in ("stall_ms", "ttft_ms", "decode_step_ms", "deferred_steps"):
            out[f"{name}_{key}"] = spread([f[key] for f in fig[name]], 1)
    out["stall_ratio"] = ratio_stats(
        [f["stall_ms"] for f in fig["no_wait"]], [f["stall_ms"] for f in fig["wait"]]
    )  # no_wait / wait, per round: > 1, the wait kept the running requests' steps shorter
    out["ttft_ratio"] = ratio_stats(
        [f["ttft_ms"] for f in fig["wait"]], [f["ttft_ms"] for f in fig["no_wait"]]
    )
    out["load_before"], out["load_after"] = load_before, load_avg()
    return out
