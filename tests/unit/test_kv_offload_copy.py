"""The offload tiers' copies between a pool and host bytes (common/kv/offload.py): `gather_blocks` out,
`put_blocks` back in, on the CPU (tests/gpu/test_cuda.py runs the same on a VRAM pool)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, KVScales, PagedKVCache
from common.kv.offload import gather_blocks, put_blocks

SPEC = KVCacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_out_and_back_in_are_byte_exact_and_touch_nothing_else(dtype: torch.dtype) -> None:
    spec = dataclasses.replace(SPEC, dtype=dtype)
    ones = torch.ones(spec.num_layers, spec.num_kv_heads)
    scales = KVScales(ones, ones) if dtype == torch.float8_e4m3fn else None  # the bytes are what matter
    src, dst = PagedKVCache(spec, scales=scales), PagedKVCache(spec, scales=scales)
    g = torch.Generator().manual_seed(0)
    src.k.view(torch.uint8).copy_(torch.randint(0, 120, src.k.view(torch.uint8).shape, generator=g))
    src.v.view(torch.uint8).copy_(torch.randint(0, 120, src.v.view(torch.uint8).shape, generator=g))
    out, into = [7, 3, 4, 12], [9, 0, 10, 2]
    data = gather_blocks(src, out).reshape(-1)
    assert data.numel() == len(out) * spec.bytes_per_block
    per = spec.bytes_per_block
    put_blocks(dst, into, [memoryview(data[i * per : (i + 1) * per].numpy().data) for i in range(len(out))])
    for a, b in ((dst.k, src.k), (dst.v, src.v)):
        assert torch.equal(a[:, into].view(torch.uint8), b[:, out].view(torch.uint8))
        rest = [i for i in range(spec.num_blocks) if i not in into]
        assert not a[:, rest].view(torch.uint8).any()
