"""KV offload tiers behind the real SmolLM2 engine's pool (common/kv/offload.py, common/kv/tiers.py).

Three prompts cycle through a pool that holds two: every repeat finds its prefix evicted. Tiers off,
it is recomputed; tiers on, it is read back from RAM or disk and only the suffix is computed. Each
run sends the same requests one at a time (the same batch shape on both sides), and the greedy tokens
must be equal, request by request, with a tier hit counted. Then the faults (a truncated, flipped or
deleted file, a disk too small for a chunk, a disk whose writes hang): each is a miss, recomputed, and
every output still equals the tiers-off run's — 0 wrong outputs.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.config import EngineConfig, ServiceConfig
from common.engine.llm_engine import LLMEngine
from common.kv import offload
from common.kv.offload import KVOffload
from common.kv.tiers import TierStore
from common.prefix_hash import prefix_chain
from common.sampling_params import SamplingParams
from common.security.secret import InternalSecret
from common.service.base import Service
from common.service.metrics import EngineCollector
from tests.support.tiers import LONG, ORDER, QUESTIONS, WAIT_S, damage, run_in_turn, slow_copier, tier

MAX_TOKENS = 4
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
# TINY_DISK: the tests on a tiny model read their disk hits "always": it computes a block in about the
# time this disk reads one, so "auto" could leave the disk alone, and they are about what a read returns


@pytest.fixture(scope="module")
def prompts(smollm) -> list[list[int]]:  # type: ignore[no-untyped-def]
    _, tok = smollm
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


def _config(prompts: list[list[int]], **tiers: object) -> EngineConfig:
    """A pool of one request's blocks and two more: most of the last prompt is evicted by the next."""
    per_request = max(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts)
    return EngineConfig(num_kv_blocks=per_request + 2, max_num_seqs=1, **tiers)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(smollm, prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    model, tok = smollm
    engine = LLMEngine(model, tok, _config(prompts))
    outs = run_in_turn(engine, prompts, LONG, PARAMS)
    assert engine.block_manager.prefix_hits < sum((len(prompts[p]) - 1) // 16 for p in LONG[3:]) // 2, (
        "the pool must be too small to keep the repeated prompts"
    )
    return outs


def test_ram_tier_hits_give_the_same_tokens(smollm, prompts, reference) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm
    engine = LLMEngine(model, tok, _config(prompts, kv_offload_ram_gb=0.25))
    try:
        assert run_in_turn(engine, prompts, ORDER, PARAMS) == reference[: len(ORDER)]
        ram = tier(engine, "ram")
        assert ram.hits > 0 and ram.hits == engine.block_manager.tier_hits
        assert ram.verify_failures.total() == 0 and 0 < ram.bytes <= ram.capacity_bytes
        # the service's /metrics shows them
        registry = CollectorRegistry()
        registry.register(EngineCollector(engine.load, lambda: 0, list, engine.kv_offload.stats))  # type: ignore[union-attr]
        text = generate_latest(registry).decode()
        assert f'splitserve_kv_tier_hits_total{{tier="ram"}} {float(ram.hits)}' in text
        assert 'splitserve_kv_tier_verify_failures_total{cause="checksum",tier="ram"} 0.0' in text
        assert 'splitserve_kv_tier_read_seconds_count{tier="ram"}' in text
    finally:
        engine.close()


@pytest.mark.parametrize("load", ["layerwise", "inline", "whole", "auto"])
def test_tier_hits_put_in_layer_by_layer_give_the_same_tokens(
    smollm, prompts, reference, monkeypatch, load
) -> None:  # type: ignore[no-untyped-def]
    """The read blocks go into the pool while the step computes, each layer's copy started late (a slowed
    copier): every layer's attention waits for its own, and the tokens equal the tiers-off run's. The
    same with the copies made just before each layer (inline), all before the step (whole), and what
    auto means on this device."""
    slow_copier(monkeypatch)
    model, tok = smollm
    engine = LLMEngine(model, tok, _config(prompts, kv_offload_ram_gb=0.25, kv_offload_load=load))
    try:
        assert engine.kv_offload is not None
        loads = engine.kv_offload.loads
        # auto: whole on a CPU pool (its copies compete with the step for the cores: bench tier-load)
        want = {"layerwise": "thread", "auto": "whole"}.get(load, load)
        assert (loads.mode if loads is not None else "whole") == want
        assert run_in_turn(engine, prompts, ORDER, PARAMS) == reference[: len(ORDER)]
        assert engine.block_manager.tier_hits > 0
        if loads is not None:
            assert loads.loaded_blocks == engine.block_manager.tier_hits and not loads.pending
    finally:
        engine.close()


def test_disk_tier_hits_give_the_same_tokens(smollm, prompts, reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm
    engine = LLMEngine(
        model, tok, _config(prompts, kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gb=0.25)
    )
    try:
        assert run_in_turn(engine, prompts, ORDER, PARAMS) == reference[: len(ORDER)]
        disk = tier(engine, "disk")
        assert disk.hits > 0 and disk.hits == engine.block_manager.tier_hits
        assert engine.kv_offload.stats().filtered_blocks > 0  # type: ignore[union-attr]  # one-offs kept off
        assert disk.verify_failures.total() == 0
    finally:
        engine.close()


@pytest.mark.parametrize("disk_reads", ["auto", "always"])
def test_a_disk_dearer_than_recomputing_is_left_alone(  # type: ignore[no-untyped-def]
    smollm, prompts, reference, tmp_path, disk_reads, monkeypatch
) -> None:
    """Requests 6, 7 and 8 each find their prompt on the disk. The engine's recompute cost is set to
    almost nothing (what a fast prefill beside a slow or throttled disk looks like), so once the first
    read has measured the disk, a disk hit costs more than it saves: with `auto` the next two prompts
    are computed instead (counted in `disk_skipped_blocks`), with `always` they are read. The tokens
    are the tiers-off run's either way. A disk left alone is probed again on the tiers' writer thread
    once nothing has read it for DISK_PROBE_S."""
    model, tok = smollm
    cfg = _config(
        prompts, kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gb=0.25, kv_offload_disk_reads=disk_reads
    )
    engine = LLMEngine(model, tok, cfg)
    try:
        off = engine.kv_offload
        assert off is not None and off.recompute_s_per_block is not None
        off.recompute_s_per_block = lambda: 1e-9
        hits_after: list[int] = []
        outs = run_in_turn(
            engine, prompts, LONG, PARAMS, before=lambda i: hits_after.append(tier(engine, "disk").hits)
        )
        assert outs == reference
        disk = tier(engine, "disk")
        read = [b - a for a, b in zip(hits_after[6:], [*hits_after[7:], disk.hits], strict=True)]
        skipped = off.stats().disk_skipped_blocks
        assert off.store.disk_read_s_per_block() is not None
        if disk_reads == "auto":
            assert read[0] > 0 and read[1:] == [0, 0], f"only the first disk hit is read: {read}"
            assert skipped > 0 and not off.disk_worth()
            # read by nothing for DISK_PROBE_S (here: at once): the writer thread measures it again
            monkeypatch.setattr(offload, "DISK_PROBE_S", 0.0)
            assert not off.disk_worth() and off.store.wait_idle(WAIT_S) and off.store.disk_probes == 1
        else:
            assert all(r > 0 for r in read) and skipped == 0 and off.disk_worth()
    finally:
        engine.close()


FAULTS = {6: (0, "truncated"), 7: (1, "checksum"), 8: (2, "missing")}  # request -> (its prompt, fault)


def test_a_damaged_disk_tier_is_recomputed_never_wrong(smollm, prompts, reference, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each prompt's records damaged just before the request that would read them back: truncated,
    one flipped bit, deleted."""
    model, tok = smollm
    engine = LLMEngine(
        model, tok, _config(prompts, kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gb=0.25)
    )
    assert engine.kv_offload is not None
    store = engine.kv_offload.store

    def before(i: int) -> None:
        if i in FAULTS:
            p, fault = FAULTS[i]
            damage(store, prompts[p], fault)

    try:
        assert run_in_turn(engine, prompts, LONG, PARAMS, before) == reference
        disk = tier(engine, "disk")
        assert all(disk.verify_failures[fault] >= 1 for _, fault in FAULTS.values()), disk.verify_failures
        assert disk.hits == 0 and engine.block_manager.tier_hits == 0, "nothing damaged was loaded"
    finally:
        engine.close()


def test_a_full_disk_is_a_miss_not_an_error(smollm, prompts, reference, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm
    tiny = 64 / 2**30  # 64 bytes: no record fits
    engine = LLMEngine(
        model, tok, _config(prompts, kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gb=tiny)
    )
    try:
        assert run_in_turn(engine, prompts, ORDER, PARAMS) == reference[: len(ORDER)]
        disk = tier(engine, "disk")
        assert disk.write_failures["too_large"] > 0 and disk.hits == 0 and disk.bytes == 0
    finally:
        engine.close()


class HungDisk(TierStore):
    """A disk whose writes hang until released (a slow or stalled device)."""

    release = threading.Event()

    def _write_file(self, path: Path, rec: bytearray) -> None:
        assert self.release.wait(120), "the test never released the disk"
        super()._write_file(path, rec)


def test_a_hung_disk_never_stalls_the_engine(smollm, prompts, reference, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every write hangs for the whole run: the engine finishes anyway (no step waits on a write), the
    write queue fills and drops are counted, and nothing is read back that was not written."""
    model, tok = smollm
    engine = LLMEngine(model, tok, _config(prompts, kv_offload_ram_gb=0.25))
    assert engine.kv_offload is not None
    engine.kv_offload.store.close()
    store = HungDisk(
        engine.kv_offload.store.digest, 16, engine.kv_cache.spec.bytes_per_block, ram_bytes=2**28,
        disk_dir=tmp_path, disk_bytes=2**28, queue_chunks=1,
    )  # fmt: skip
    engine.kv_offload = engine.block_manager.tier = KVOffload(engine.kv_cache, store)
    HungDisk.release.clear()
    try:
        outs = []
        for i, p in enumerate(LONG):
            if i < 5:  # until the first disk write (prompt 0's second eviction) the writer keeps up
                assert store.wait_idle(WAIT_S)
            outs.append(engine.generate([prompts[p]], PARAMS)[0].token_ids)
        assert outs == reference
        assert not store.wait_idle(0), "the disk write is still hanging"
        assert store.stats().dropped_blocks > 0 and tier(engine, "disk").writes == 0
        assert tier(engine, "ram").hits > 0, "RAM reads go on while the disk hangs"
    finally:
        HungDisk.release.set()
        engine.close()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_narrow_kv_dtypes_round_trip_through_the_tiers(tiny, tmp_path, kv_dtype) -> None:  # type: ignore[no-untyped-def]
    """A tier record holds the cache's own bytes (bf16, or fp8 with its scales named in the digest):
    read back, they give the tokens a recompute gives (on the tiny model: fast)."""
    model, tok = tiny
    prompts = [tok.encode(q) for q in QUESTIONS]
    base = _config(prompts).model_copy(update={"kv_cache_dtype": kv_dtype})
    off = LLMEngine(model, tok, base)
    want = run_in_turn(off, prompts, LONG, PARAMS)
    tiers = {"kv_offload_ram_gb": 0.01, "kv_offload_disk_dir": str(tmp_path), "kv_offload_disk_gb": 0.01}
    tiers["kv_offload_disk_reads"] = "always"  # a tiny model: see TINY_DISK
    on = LLMEngine(model, tok, base.model_copy(update=tiers))
    try:
        assert run_in_turn(on, prompts, LONG, PARAMS) == want
        assert on.block_manager.tier_hits > 0
        assert all(t.verify_failures.total() == 0 for t in on.kv_offload.stats().tiers)  # type: ignore[union-attr]
    finally:
        on.close()


def test_a_prefetch_on_arrival_is_read_from_ram_and_gives_the_same_tokens(tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Prompt 0's blocks on the disk only (a RAM tier of one request's blocks: the next two prompts
    push it out): when it arrives again, the engine's add_request starts a prefetch; once it finished,
    the admission reads those blocks from RAM (no disk read of its own) and the tokens equal a
    recompute's. The test waits for the prefetch (a condition); the engine never does."""
    model, tok = tiny
    prompts = [tok.encode(q) for q in QUESTIONS]
    base = _config(prompts)
    off = LLMEngine(model, tok, base)
    want = run_in_turn(off, prompts, ORDER, PARAMS)
    per_request = max(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts)
    ram_gb = (per_request + 1) * off.kv_cache.spec.bytes_per_block / 2**30
    tiers = {"kv_offload_ram_gb": ram_gb, "kv_offload_disk_dir": str(tmp_path), "kv_offload_disk_gb": 0.01}
    tiers["kv_offload_disk_reads"] = "always"  # a tiny model: see TINY_DISK
    on = LLMEngine(model, tok, base.model_copy(update=tiers))
    assert on.kv_offload is not None
    store = on.kv_offload.store
    try:
        outs = run_in_turn(on, prompts, ORDER[:-1], PARAMS)
        assert store.wait_idle(WAIT_S) and store.ram is not None and store.disk is not None
        chain = prefix_chain(prompts[0], 16)
        assert any(store.disk.holds(h) and not store.ram.holds(h) for h in chain), "disk-only blocks"
        disk_reads = tier(on, "disk").read_latency.counts
        rid = on.add_request(prompts[0], PARAMS)
        assert store.wait_prefetched(WAIT_S) and store.stats().prefetch.started == 1
        tokens: list[int] = []
        while on.has_unfinished():
            tokens += [t for o in on.step().outputs if o.request_id == rid for t in o.token_ids]
        assert outs + [tokens] == want
        pf = store.stats().prefetch
        assert (pf.completed, pf.in_time, pf.late, pf.dropped) == (1, 1, 0, 0) and pf.blocks > 0
        assert tier(on, "disk").read_latency.counts == disk_reads, "the admission read no disk chunk"
        assert on.block_manager.tier_hits > 0
        on.block_manager.check_integrity()
    finally:
        on.close()


def test_the_service_registry_shows_each_tier(tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A service's /metrics registry (common/service/base.py) carries the tiers' figures, by tier; its
    registry load says whether it reads disk hits now (what a router predicts from)."""
    model, tok = tiny
    cfg = EngineConfig(kv_offload_ram_gb=0.01, kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gb=0.01)
    engine = LLMEngine(model, tok, cfg)
    try:
        svc = Service(ServiceConfig(role="decode"), engine, InternalSecret())
        text = generate_latest(svc.metrics.registry).decode()
        for which in ("ram", "disk"):
            for name in ("bytes", "capacity_bytes", "blocks", "hits_total", "misses_total", "writes_total"):
                assert f'splitserve_kv_tier_{name}{{tier="{which}"}}' in text, (name, which)
            assert f'splitserve_kv_tier_verify_failures_total{{cause="truncated",tier="{which}"}} 0.0' in text
            assert f'splitserve_kv_tier_write_failures_total{{cause="full",tier="{which}"}} 0.0' in text
            assert f'splitserve_kv_tier_read_seconds_bucket{{le="+Inf",tier="{which}"}} 0.0' in text
        assert "splitserve_kv_tier_dropped_blocks_total 0.0" in text
        assert "splitserve_kv_tier_unoffered_blocks_total 0.0" in text
        for name in ("started", "dropped", "completed", "in_time", "late"):
            assert f"splitserve_kv_tier_prefetches_{name}_total 0.0" in text, name
        assert "splitserve_kv_tier_prefetched_blocks_total 0.0" in text
        assert "splitserve_kv_tier_disk_skipped_blocks_total 0.0" in text
        assert svc.load()["kv_tier_disk_reads"] is True, "its load says it reads disk hits (none measured)"
    finally:
        engine.close()
