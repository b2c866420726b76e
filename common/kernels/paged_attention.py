"""Triton kernels for attention over the paged KV cache, and for writing new K/V into it.

One attention kernel, compiled in two specializations:

* **decode** (`BLOCK_Q = 1`): one program per (sequence, KV head, split) holds the one new query of every
  query head that shares that KV head (grouped-query attention reads each KV block once for the whole
  group) and walks its share of the sequence's block table. With few sequences the context is split
  over several programs (as flash-decoding does) so the GPU's multiprocessors all get work; each split
  leaves an unnormalized partial result and `_combine_splits_kernel` merges them;
* **varlen prefill** (`BLOCK_Q > 1`): one program per (sequence, KV head, tile of BLOCK_Q new tokens):
  the rows of its tile are (token, head-of-group) pairs, so a chunk's queries attend to the paged prefix
  and causally to themselves in one pass, whatever the chunk's length.

Both read K/V from the paged cache (new tokens are written there first by `store_kv`), in tiles of
TILE_N token positions that may span several pages: each position's page is looked up in the block
table, so any block size works. One exception, FRESH (prefill over an fp8 cache, the cache's
`exact_prefill`): a chunk's own positions are read from k_new/v_new, the step's K/V in the cache's units
(rotated, less the offset, over the scale) but not rounded to fp8, so a chunk sees its own keys as
computed and only earlier steps' through the cache (common/kv/kv_cache.py). Softmax is online
(running max and sum per row, fp32).

Layouts (as in common/kv/kv_cache.py, one layer's slice):
    q, out          (T, n_heads, head_dim)        rows of the flattened step
    k_cache,v_cache (num_blocks, block_size, n_kv_heads, head_dim)
    block_tables    (S, max_blocks) int32         padded with any valid id
    query_start_loc (S + 1,) int32                new tokens of seq i are rows [qsl[i], qsl[i+1])
    context_lens    (S,) int32                    tokens in KV after this step (cached + new)
    seq_ids         (N,) int32                    which sequences this launch covers
A sequence with context length 0 (CUDA-graph padding) produces zeros, and `store_kv` skips slot < 0.

An fp8 cache (QUANT) holds x / scale with one scale per (KV head, channel) (of this layer: k_scale,
v_scale, (n_kv_heads, head_dim) fp32, powers of two), written by `store_kv` as the caller quantized them;
attention reads the raw values in the query's dtype and applies the scales where they cost least: K's to
the query before the dot (q . (s * k) = (s * q) . k, channel by channel, once per program rather than
per key), V's to the output (sum_t p_t s v_t = s sum_t p_t v_t; one KV head per program, so each is one
head_dim vector). Multiplying by a power of two is exact, so this equals attention over the dequantized
values up to the order of the sums. Such a cache holds K and V rotated (common/kv/kv_cache.py
`kv_rotation`); the caller (common/model/attention.py) rotates q before the launch and `out` after it, so
the kernel never sees the rotation. It may hold them less a per-(KV head, channel) offset too (k_off,
v_off, the scales' shape; OFFSET, compiled in only when they are passed, which the caller does when
some offset is not zero): for K each query row's q . k_off, one constant over the row's keys, is added
to its scores (softmax would not miss it, a soft-cap would), and for V the offset is added to the
output (the probabilities sum to 1: added to the unnormalized sum times its running total, so split
decode merges it as it merges the rest).

Two per-layer options of some model families (see common/model/attention.py, the reference):
WINDOW (sliding-window attention: a query at position p sees keys p - window + 1 .. p; a program skips
the key tiles before its first query's window, and loads no position before that window's first key
either: the block-table entry there may be a HOLE, -1, for a block released once it slid out of every
layer's window, common/kv/block_manager.py) and SOFTCAP (gemma2: scores -> softcap * tanh(scores /
softcap), before masking). Both are compile-time switches, so a model without them runs the same code
as before.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from common.kv.kv_cache import FP8


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


# tl.dot needs every dimension >= 16 on the GPU: tiles are padded (and masked) up to that.
MIN_DOT = 16
TILE_N = 64  # key positions per inner iteration
PREFILL_ROWS = 64  # (token, head) rows per prefill program


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    seq_ids_ptr,
    part_acc_ptr,  # split decode: (N, n_heads, num_splits, head_dim) fp32 unnormalized outputs
    part_ml_ptr,  # split decode: (2, N, n_heads, num_splits) fp32 running max, running sum
    k_scale_ptr,  # QUANT: (n_kv_heads, head_dim) fp32 contiguous, this layer's
    v_scale_ptr,
    k_off_ptr,  # OFFSET: (n_kv_heads, head_dim) fp32 contiguous, this layer's
    v_off_ptr,
    k_new_ptr,  # FRESH: (T, n_kv_heads, head_dim) the step's own K in stored units, unrounded
    v_new_ptr,  # FRESH: the same for V (the same strides as K)
    num_splits,
    n_heads,
    scale,
    window,  # WINDOW: keys visible to a query at position p are p - window + 1 .. p
    softcap,  # SOFTCAP: scores -> softcap * tanh(scores / softcap)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_nt,  # FRESH: k_new/v_new's token and KV-head strides
    stride_nh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # new tokens per program
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV page
    TILE: tl.constexpr,  # key positions per iteration
    IEEE: tl.constexpr,  # fp32 dots in full precision (no TF32)
    UPCAST: tl.constexpr,  # compute the dots in fp32 (the interpreter's bf16 dot is wrong)
    SPLIT: tl.constexpr,  # decode with num_splits > 1: axis 2 is the split, results are partial
    QUANT: tl.constexpr,  # the cache holds fp8 values scaled per (KV head, channel)
    OFFSET: tl.constexpr,  # ... less an offset per (KV head, channel)
    WINDOW: tl.constexpr,  # sliding-window attention
    SOFTCAP: tl.constexpr,  # soft-capped scores
    FRESH: tl.constexpr,  # a prefill chunk's own keys and values read from k_new/v_new, not the cache
):
    launch_idx = tl.program_id(0)
    seq = tl.load(seq_ids_ptr + launch_idx)
    kv_head = tl.program_id(1)
    if SPLIT:
        q_tile = 0
        split = tl.program_id(2)
    else:
        q_tile = tl.program_id(2)
        split = 0

    q_start = tl.load(query_start_ptr + seq)
    n_new = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD  # which new token of the sequence
    g = rows % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (q_idx < n_new) & (g < GROUP)
    q_pos = ctx - n_new + q_idx  # absolute position: sees keys 0 .. q_pos

    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, HEAD_PAD)
    if UPCAST:
        q = q.to(tl.float32)
    if OFFSET:  # q . k_off: what K's offset adds to each of the row's scores
        k_off = tl.load(k_off_ptr + kv_head * HEAD_DIM + d, mask=d_ok, other=0.0)
        q_off = tl.sum(q.to(tl.float32) * k_off[None, :], axis=1)  # (BLOCK_M,)
    if QUANT:  # K's per-channel scales, folded into the query (exact: powers of two)
        k_scale = tl.load(k_scale_ptr + kv_head * HEAD_DIM + d, mask=d_ok, other=0.0)
        q = (q.to(tl.float32) * k_scale[None, :]).to(q.dtype)

    # keys this tile can see: up to the last valid query's position
    last_q = tl.minimum(n_new, (q_tile + 1) * BLOCK_Q) - 1
    kv_len = tl.maximum(ctx - n_new + last_q + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, TILE)
    # the first key tile any row of this program can see: 0, or with a window the tile holding the
    # first query's first visible key
    kv_lo = kv_len * 0
    kv_first = kv_len * 0  # positions before it are never loaded (their block may be a HOLE)
    if WINDOW:
        kv_first = tl.maximum(ctx - n_new + q_tile * BLOCK_Q - window + 1, 0)
        kv_lo = kv_first // TILE * TILE
    # this program's share of the key tiles (all of them unless SPLIT)
    tiles_per_split = tl.cdiv(tl.cdiv(tl.maximum(kv_len - kv_lo, 0), TILE), num_splits)
    lo = kv_lo + split * tiles_per_split * TILE
    hi = tl.minimum(lo + tiles_per_split * TILE, kv_len)
    for start in range(lo, hi, TILE):
        k_pos = start + offs_n
        k_ok = (k_pos < kv_len) & (k_pos >= kv_first)
        page = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        page = page.to(tl.int64)
        within = k_pos % BLOCK_SIZE
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_cache_ptr
            + page[:, None] * stride_kb
            + within[:, None] * stride_ks
            + kv_head * stride_kh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # (TILE, HEAD_PAD)
        v = tl.load(
            v_cache_ptr
            + page[:, None] * stride_vb
            + within[:, None] * stride_vs
            + kv_head * stride_vh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if QUANT:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if FRESH:  # the chunk's own positions: the values before fp8 rounded them (same units)
            own = k_pos >= ctx - n_new
            row = tl.where(own, q_start + k_pos - (ctx - n_new), q_start)  # in bounds where not own
            own_mask = (own & k_ok)[:, None] & d_ok[None, :]
            at = k_new_ptr + row[:, None] * stride_nt + kv_head * stride_nh + d[None, :]
            k = tl.where(own[:, None], tl.load(at, mask=own_mask, other=0.0).to(k.dtype), k)
            at = v_new_ptr + row[:, None] * stride_nt + kv_head * stride_nh + d[None, :]
            v = tl.where(own[:, None], tl.load(at, mask=own_mask, other=0.0).to(v.dtype), v)
        if IEEE:  # noqa: SIM108 (a constexpr branch: each specialization compiles one dot)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if OFFSET:
            s = s + q_off[:, None]
        s = s * scale  # (BLOCK_M, TILE) fp32
        if SOFTCAP:
            # tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|): Triton has no tanh the interpreter runs
            e = tl.exp(-2.0 * tl.abs(s / softcap))
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(s < 0, -t, t)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:  # noqa: SIM108
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if QUANT:  # V's per-channel scales, on the weighted sum
        acc = acc * tl.load(v_scale_ptr + kv_head * HEAD_DIM + d, mask=d_ok, other=0.0)[None, :]
    if OFFSET:  # V's offset: sum_t p_t (v_t + m) = sum_t p_t v_t + m, with the sum unnormalized
        acc = acc + l_i[:, None] * tl.load(v_off_ptr + kv_head * HEAD_DIM + d, mask=d_ok, other=0.0)[None, :]
    if SPLIT:
        part = (launch_idx * n_heads + head) * num_splits + split  # (BLOCK_M,)
        ml_stride = tl.num_programs(0) * n_heads * num_splits
        tl.store(part_ml_ptr + part, m_i, mask=row_ok)
        tl.store(part_ml_ptr + ml_stride + part, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :]
        )
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    query_start_ptr,
    seq_ids_ptr,
    num_splits,
    n_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One program per (sequence, query head): out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_start_ptr + tl.load(seq_ids_ptr + i))
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    part = (i * n_heads + head) * num_splits + s
    ml_stride = tl.num_programs(0) * n_heads * num_splits
    m = tl.load(part_ml_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + ml_stride + part, mask=s_ok, other=0.0)  # noqa: E741
    m_all = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # empty splits (m = -inf) weigh 0
    total = tl.sum(l * w, axis=0)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
    )
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_cb,
    stride_cs,
    ROW: tl.constexpr,  # n_kv_heads * head_dim, contiguous in both source and cache
    ROW_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    ok = (offs < ROW) & ((offs * 0 + slot) >= 0)  # slot < 0: a padding row, nothing to write
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + offs, mask=ok), mask=ok)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + offs, mask=ok), mask=ok)


def store_kv(
    k: torch.Tensor,  # (T, n_kv, hd)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # (num_blocks, block_size, n_kv, hd), one layer
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int; slot < 0: skip (padding)
) -> None:
    """Copy new K/V rows into their slots. k and v are already in the cache's dtype (an fp8 cache's
    caller scaled and cast them: PagedKVCache.quantize, so that both attention paths store the same
    bytes — Triton's interpreter rounds fp32 -> fp8 wrongly where the mantissa carries)."""
    T, n_kv, hd = k.shape
    if T == 0:
        return
    for name, t in (("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != hd:
            raise ValueError(f"store_kv: {name} rows must be contiguous (T, n_kv, hd)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.stride() != v_cache.stride():
        raise ValueError("store_kv: the K and V caches must be contiguous and of one layout")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"store_kv: K/V are {k.dtype}/{v.dtype}, the cache holds {k_cache.dtype}")
    row = n_kv * hd
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1),
        ROW=row, ROW_PAD=_pow2(row), BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip


def _quantized(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether `cache` is fp8 (then both scales are required)."""
    if cache.dtype not in FP8:
        return False
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {cache.dtype} KV cache needs its k_scale and v_scale")
    _check_per_channel(cache, ("k_scale", k_scale), ("v_scale", v_scale))
    return True


def _check_per_channel(cache: torch.Tensor, *named: tuple[str, torch.Tensor]) -> None:
    want = (cache.shape[2], cache.shape[3])  # (n_kv, head_dim)
    for name, s in named:
        if tuple(s.shape) != want or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"{name}: {tuple(s.shape)} {s.dtype}; want {want} float32, contiguous")


def _offset(cache: torch.Tensor, quant: bool, k_off: torch.Tensor | None, v_off: torch.Tensor | None) -> bool:
    """Whether the launch applies offsets: given (both, to an fp8 cache). The caller leaves out offsets
    that are all zero (PagedKVCache.offsets; checking here would wait for the device)."""
    if k_off is None and v_off is None:
        return False
    if not quant or k_off is None or v_off is None:
        raise ValueError("k_off and v_off: both, and only with an fp8 cache's k_scale and v_scale")
    _check_per_channel(cache, ("k_off", k_off), ("v_off", v_off))
    return True


def paged_attention_launch(
    q: torch.Tensor,  # (T, n_heads, hd)
    k_cache: torch.Tensor,  # (num_blocks, block_size, n_kv, hd)
    v_cache: torch.Tensor,
    out: torch.Tensor,  # (T, n_heads, hd), written for the covered sequences' rows
    block_tables: torch.Tensor,  # (S, max_blocks) int32
    query_start_loc: torch.Tensor,  # (S + 1,) int32
    context_lens: torch.Tensor,  # (S,) int32
    seq_ids: torch.Tensor,  # (N,) int32
    scale: float,
    max_new_tokens: int,  # the most new tokens any covered sequence has (sizes the grid)
    decode: bool,  # every covered sequence has exactly one new token
    num_splits: int | None = None,  # decode: programs per (sequence, KV head); None: decode_splits()
    k_scale: torch.Tensor | None = None,  # an fp8 cache: (n_kv, hd) fp32, what each channel was divided by
    v_scale: torch.Tensor | None = None,
    window: int | None = None,  # sliding window: each query sees its last `window` positions only
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    k_off: torch.Tensor | None = None,  # an fp8 cache: (n_kv, hd) fp32, what each channel had subtracted
    v_off: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,  # prefill over an fp8 cache: (T, n_kv, hd) the step's own K and V
    v_new: torch.Tensor | None = None,  # in stored units, unrounded (PagedKVCache.stored_units)
) -> None:
    n_seqs = seq_ids.numel()
    if n_seqs == 0:
        return
    n_heads, hd = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads do not divide into {n_kv} KV heads")
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged attention: the head dimension must be contiguous")
    group = n_heads // n_kv
    # Triton's CPU interpreter multiplies bf16 tiles wrongly in tl.dot (it works on their raw bits), so
    # interpreted runs compute half-precision dots in fp32; compiled GPU runs use the bf16 tensor cores.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    splits = 1
    if decode:
        group_pad, block_q = _pow2(group, MIN_DOT), 1
        splits = num_splits or decode_splits(n_seqs, n_kv, q.device)
        axis2 = splits
    else:
        group_pad = _pow2(group)
        block_q = max(1, PREFILL_ROWS // group_pad)
        axis2 = triton.cdiv(max_new_tokens, block_q)
    quant = _quantized(k_cache, k_scale, v_scale)
    offset = _offset(k_cache, quant, k_off, v_off)
    if window is not None and window < 1:
        raise ValueError(f"paged attention: window={window} must be at least 1")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"paged attention: softcap={softcap} must be positive")
    if (k_new is None) != (v_new is None):
        raise ValueError("paged attention: k_new and v_new come together")
    fresh = k_new is not None and v_new is not None
    if fresh:
        assert k_new is not None and v_new is not None
        if decode or not quant:
            raise ValueError("paged attention: k_new/v_new are for prefill chunks over an fp8 cache")
        if k_new.shape != v_new.shape or k_new.stride() != v_new.stride() or k_new.stride(2) != 1:
            raise ValueError("paged attention: k_new and v_new need one shape and strides, hd contiguous")
    part_acc = part_ml = out  # unused unless split
    if splits > 1:
        part_acc = torch.empty((n_seqs, n_heads, splits, hd), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((2, n_seqs, n_heads, splits), dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(n_seqs, n_kv, axis2)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens, seq_ids,
        part_acc, part_ml, k_scale if quant else out, v_scale if quant else out,
        k_off if offset else out, v_off if offset else out,
        k_new if fresh else out, v_new if fresh else out, splits, n_heads, scale,
        window or 0, softcap or 0.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        *(k_new.stride()[:2] if k_new is not None and fresh else (0, 0)),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=hd, HEAD_PAD=_pow2(hd, MIN_DOT), BLOCK_SIZE=k_cache.shape[1], TILE=TILE_N,
        IEEE=q.dtype == torch.float32 or interpreted,
        UPCAST=interpreted and q.dtype != torch.float32, SPLIT=splits > 1, QUANT=quant, OFFSET=offset,
        WINDOW=window is not None, SOFTCAP=softcap is not None, FRESH=fresh,
    )  # fmt: skip
    if splits > 1:
        _combine_splits_kernel[(n_seqs, n_heads)](
            part_acc, part_ml, out, query_start_loc, seq_ids, splits, n_heads,
            out.stride(0), out.stride(1),
            HEAD_DIM=hd, HEAD_PAD=_pow2(hd, MIN_DOT), SPLITS_PAD=_pow2(splits),
        )  # fmt: skip


MAX_SPLITS = 16


def decode_splits(n_seqs: int, n_kv_heads: int, device: torch.device) -> int:
    """How many programs share one sequence's context in a decode launch: enough for about two
    programs per multiprocessor, at most MAX_SPLITS. Depends on the batch alone, never on context
    lengths (which live on the device), so a CUDA graph captured for a batch size stays valid."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, (2 * sms) // (n_seqs * n_kv_heads)))
