"""The `transfer` benchmark's kernel-copy baseline against a real second process: process_vm_writev puts
the same scattered blocks a backend moves into that process's cache, byte for byte."""

from __future__ import annotations

import random

import pytest
import torch

from bench.transfer import CmaBlocks, bench_spec
from common.kv.kv_cache import PagedKVCache


def test_cma_blocks_writes_the_scattered_blocks_into_another_process() -> None:
    spec = bench_spec(4)  # 4 MiB: 4 layers x 2 cache blocks moved of 4
    rng = random.Random(1)
    src_ids = rng.sample(range(0, spec.num_blocks, 2), spec.num_blocks // 2)
    dst_ids = rng.sample(range(0, spec.num_blocks, 2), spec.num_blocks // 2)
    src = PagedKVCache(spec)
    g = torch.Generator().manual_seed(1)
    src.k.copy_(torch.randn(src.k.shape, generator=g))
    src.v.copy_(torch.randn(src.v.shape, generator=g))
    try:
        cma = CmaBlocks(src, src_ids, dst_ids)
    except OSError as e:  # the kernel refuses cross-process writes (ptrace scope): nothing to measure
        pytest.skip(f"process_vm_writev is not allowed here: {e}")
    try:
        assert len(cma.calls) == spec.num_layers * len(src_ids) * 2  # one call per K or V block
        cma.check()  # the destination blocks hold the source blocks' values (written by the constructor)
        assert cma.target_checksum(dst_ids) != 0.0  # so the check above was not 0 == 0
        others = [i for i in range(spec.num_blocks) if i not in dst_ids]
        assert cma.target_checksum(others) == 0.0  # and nothing else was written
    finally:
        cma.close()
    assert not cma.proc.is_alive()
