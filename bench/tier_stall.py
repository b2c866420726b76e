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

`--disk-read-mbps N` (implies `--cold-disk`): the disk is throttled to N MB/s of reads, a slow or
shared device (a network volume), with a real kernel limit: this process joins a cgroup of its own
whose blkio controller (cgroup v1) caps reads from the temp dir's block device (bench/throttle.py;
needs root). `--compare disk-reads`: the sides are the engine's `--kv-offload-disk-reads` `auto` (a
disk hit is read only while the disk's measured cost per block is below recomputing it) against
`always`, on a disk tier alone (no RAM tier, so no prefetch: P's admission reads the disk itself, or
computes P); each side runs one hit first, not counted (auto measures the disk on it). Ratios are
then always / auto: above 1, auto's choice was the faster one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from bench.rounds import alternate, load_avg, ratio_stats, spread
from bench.throttle import throttle_reads
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
# per comparison, its sides: (prefetch wait seconds, disk reads); the ratios are second / first
COMPARE = {
    "wait": {"wait": (5.0, "always"), "no_wait": (0.0, "always")},
    "disk-reads": {"auto": (5.0, "auto"), "always": (5.0, "always")},
}


def _ids(tok: Any, n: int, salt: str) -> list[int]:
    ids = tok.encode(salt + " " + TEXT * (1 + n // 30))[:n]
    assert len(ids) == n, f"the text gives only {len(ids)} tokens"
    return ids


class Side:
    def __init__(
        self,
        model: Any,
        tok: Any,
        wait_s: float,
        n: int,
        disk_dir: str,
        cold: bool = False,
        disk_reads: str = "always",
        ram: bool = True,
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
            num_kv_blocks=blocks + min(48, blocks - 8),  # P, its turn and 4 decoders; 2 fillers turn it over
            max_num_batched_tokens=max(n, 512),
            kv_offload_ram_gb=(BLOCK + 2) * block_bytes / 2**30 if ram else 0.0,  # one chunk
            kv_offload_disk_dir=disk_dir,
            kv_offload_disk_gb=4.0,
            kv_offload_prefetch_wait_s=wait_s,
            kv_offload_disk_reads=disk_reads,
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

    def skipped(self) -> int:
        """Disk hits its engine computed instead of reading, since it started."""
        return self.engine.kv_offload.stats().disk_skipped_blocks  # type: ignore[union-attr]

    def _disk_only(self) -> bool:
        store = self.engine.kv_offload.store  # type: ignore[union-attr]
        assert store.disk is not None
        in_ram = store.ram is not None and any(store.ram.holds(h) for h in self.hashes)
        return not in_ram and all(store.disk.holds(h) for h in self.hashes)

    def round(self) -> float:
        e, one = self.engine, SamplingParams(max_tokens=1, temperature=0.0)
        for f in self.fillers:  # P out of the pool and RAM, onto the disk only
            if self.cold:  # every disk read cold, the fillers' prefetches too (what the disk's cost is)
                self._drop_page_cache()
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
    n = args.prompt_tokens or 2048
    if n < 512:  # the pool holds P, its turn and the decoders, and two fillers as long must turn it over
        raise ValueError(f"tier-stall needs --prompt-tokens of at least 512, got {n}")
    model, tok = load_model(args.model)
    compare = getattr(args, "compare", None) or "wait"
    mbps = getattr(args, "disk_read_mbps", None)
    cold = bool(args.cold_disk or mbps)
    specs = COMPARE[compare]
    first, second = list(specs)
    load_before = load_avg()
    with tempfile.TemporaryDirectory(prefix="splitserve-tier-stall-") as tmp:
        throttle = throttle_reads(tmp, int(mbps * 1e6)) if mbps else contextlib.nullcontext()
        with throttle:
            sides = {
                name: Side(model, tok, wait, n, f"{tmp}/{name}", cold, reads, ram=compare == "wait")
                for name, (wait, reads) in specs.items()
            }
            try:
                if compare == "disk-reads":  # one hit each, not counted: auto measures the disk on it
                    for s in sides.values():
                        s.round()
                        s.tokens.clear()
                        s.figures.clear()
                alternate({name: s.round for name, s in sides.items()}, args.rounds, "tier-stall")
            finally:
                # since each engine started, its warm-up round and the fillers' hits included
                skipped = {name: s.skipped() for name, s in sides.items()}
                for s in sides.values():
                    s.engine.close()
    fig = {name: s.figures for name, s in sides.items()}
    out: dict[str, Any] = {
        "model": model.config.model_id,
        "compare": compare,
        "prompt_tokens": n,
        "new_tokens": NEW,
        "decoders": DECODERS,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "tokens_equal": sides[first].tokens == sides[second].tokens,
        "cold_disk": cold,
        "disk_read_mbps": mbps,
    }
    for name in specs:
        for key in ("stall_ms", "ttft_ms", "decode_step_ms", "deferred_steps"):
            out[f"{name}_{key}"] = spread([f[key] for f in fig[name]], 1)
        out[f"{name}_disk_skipped_blocks"] = skipped[name]
    out["stall_ratio"] = ratio_stats(
        [f["stall_ms"] for f in fig[second]], [f["stall_ms"] for f in fig[first]]
    )  # second / first, per round: > 1, the first side kept the running requests' steps shorter
    # wait: wait / no_wait (what waiting for the prefetch costs the hit itself); disk-reads: always /
    # auto (> 1: auto's choice was the faster one)
    num, den = (first, second) if compare == "wait" else (second, first)
    out["ttft_ratio"] = ratio_stats([f["ttft_ms"] for f in fig[num]], [f["ttft_ms"] for f in fig[den]])
    out["load_before"], out["load_after"] = load_before, load_avg()
    return out
