"""A Triton kernel for multi-head latent attention's decode (DeepSeek; common/model/mla.py): one new
query per sequence, every query head against the one cached latent.

MLA caches, per token and layer, a latent of kv_lora_rank + qk_rope_head_dim values (`width`), stored
as one KV head whose first half is in the K cache and second half in the V cache (common/kv/kv_cache.py,
`KVCacheSpec.mla`). With the weights absorbed, attention is multi-query over that latent: head h's score
for position t is q[h] . latent[t] (the whole width), and its output sum_t p_t latent[t][:rank] (the
first kv_lora_rank values). So one program holds a tile of HEADS query heads of one sequence (all heads
share the keys: each latent tile is read once per head tile), walks the sequence's block table in tiles
of TILE positions, and for each tile reads the two halves (K cache: a, V cache: b):

    score = q[:, :half] . a + q[:, half:] . b          (two dots, no concatenated copy)
    acc_a += p @ a,  acc_b += p @ b[:, :rank - half]   (the value is the latent's first `rank` values)

with the online softmax of common/kernels/paged_attention.py (running max and sum per row, fp32). The
output (T, n_heads, rank) is [acc_a, acc_b[:, :rank - half]] / sum.

What it does not do (the torch path, `mla_paged_attention`, runs these): prefill chunks, fp8 caches
(the latent's rotation and scales), splitting a long context over several programs (flash-decoding).
The torch path is the reference; tests/unit/test_triton_kernels.py compares them under TRITON_INTERPRET.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot needs every dimension >= 16 on the GPU: tiles are padded (and masked) up to it
TILE_N = 32  # latent positions per inner iteration
HEAD_TILE = 16  # query heads per program


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # (T, n_heads, width)
    a_ptr,  # K cache, this layer: (num_blocks, block_size, 1, half): the latent's first half
    b_ptr,  # V cache, this layer: its second half
    out_ptr,  # (T, n_heads, rank)
    rows_ptr,  # (D,) the decode sequences' rows in q and out
    blocks_ptr,  # (D, max_blocks) their block tables
    lens_ptr,  # (D,) their context lengths (the new token included)
    n_heads,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ab,
    stride_as,
    stride_bb,
    stride_bs,
    stride_bt,
    HALF: tl.constexpr,  # width // 2
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two
    REST: tl.constexpr,  # rank - HALF: the value dims in the second half
    HEADS: tl.constexpr,  # query heads per program
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 dots in full precision (no TF32)
    UPCAST: tl.constexpr,  # compute the dots in fp32 (the interpreter's bf16 dot is wrong)
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    ctx = tl.load(lens_ptr + i)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h_ok = head < n_heads
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    q_at = q_ptr + row * stride_qt + head[:, None] * stride_qh + d[None, :]
    qa = tl.load(q_at, mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # (HEADS, HALF_PAD)
    qb = tl.load(q_at + HALF, mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        qa = qa.to(tl.float32)
        qb = qb.to(tl.float32)

    m_i = tl.full([HEADS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS], dtype=tl.float32)
    acc_a = tl.zeros([HEADS, HALF_PAD], dtype=tl.float32)
    acc_b = tl.zeros([HEADS, HALF_PAD], dtype=tl.float32)
    offs = tl.arange(0, TILE)
    for start in range(0, ctx, TILE):
        pos = start + offs
        p_ok = pos < ctx
        page = tl.load(blocks_ptr + i * stride_bt + pos // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
        within = pos % BLOCK_SIZE
        mask = p_ok[:, None] & d_ok[None, :]
        a = tl.load(
            a_ptr + page[:, None] * stride_ab + within[:, None] * stride_as + d[None, :], mask=mask, other=0.0
        )
        b = tl.load(
            b_ptr + page[:, None] * stride_bb + within[:, None] * stride_bs + d[None, :], mask=mask, other=0.0
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            s = tl.dot(qa, tl.trans(a), input_precision="ieee") + tl.dot(
                qb, tl.trans(b), input_precision="ieee"
            )
        else:
            s = tl.dot(qa, tl.trans(a)) + tl.dot(qb, tl.trans(b))
        s = tl.where(p_ok[None, :] & h_ok[:, None], s * scale, float("-inf"))  # (HEADS, TILE) fp32

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row: nothing visible
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pa = tl.dot(p.to(a.dtype), a, input_precision="ieee")
            pb = tl.dot(p.to(b.dtype), b, input_precision="ieee")
        else:
            pa = tl.dot(p.to(a.dtype), a)
            pb = tl.dot(p.to(b.dtype), b)
        acc_a = acc_a * alpha[:, None] + pa
        acc_b = acc_b * alpha[:, None] + pb
        m_i = m_new

    norm = tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_at = out_ptr + row * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_at, (acc_a / norm).to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
    tl.store(
        o_at + HALF, (acc_b / norm).to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & (d < REST)[None, :]
    )


def mla_decode_launch(
    q: torch.Tensor,  # (T, n_heads, width)
    k_cache: torch.Tensor,  # (num_blocks, block_size, 1, width // 2): this layer's first halves
    v_cache: torch.Tensor,  # the same shape: the second halves
    out: torch.Tensor,  # (T, n_heads, rank), written at `rows`
    rows: torch.Tensor,  # (D,) the decode sequences' rows
    blocks: torch.Tensor,  # (D, max_blocks) their block tables
    lens: torch.Tensor,  # (D,) their context lengths
    scale: float,
) -> None:
    """Decode attention over the latent for the sequences at `rows` (module doc); the other rows of
    `out` are left as they are."""
    T, n_heads, width = q.shape
    half, rank = width // 2, out.shape[2]
    if (
        width % 2
        or k_cache.shape != v_cache.shape
        or k_cache.dim() != 4
        or k_cache.shape[2:] != (1, half)
        or not half <= rank <= width
        or out.shape[:2] != (T, n_heads)
    ):
        raise ValueError(
            f"MLA decode: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}, out "
            f"{tuple(out.shape)}: want caches (blocks, block_size, 1, {half}) and out (T, n_heads, rank) "
            f"with {half} <= rank <= {width}"
        )
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"MLA decode: a {k_cache.dtype} cache with {q.dtype} queries (fp8 runs on the torch path)"
        )
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("MLA decode: the last dimension of q, out and the caches must be contiguous")
    d = rows.shape[0]
    if d == 0:
        return
    blocks = blocks.to(torch.int32).contiguous()
    lens = lens.to(torch.int32).contiguous()
    rows = rows.to(torch.int32).contiguous()
    heads = max(MIN_DOT, min(HEAD_TILE, triton.next_power_of_2(n_heads)))
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    grid = (d, triton.cdiv(n_heads, heads))
    _mla_decode_kernel[grid](
        q, k_cache, v_cache, out, rows, blocks, lens, n_heads, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), blocks.stride(0),
        HALF=half, HALF_PAD=max(MIN_DOT, triton.next_power_of_2(half)), REST=rank - half, HEADS=heads,
        BLOCK_SIZE=k_cache.shape[1], TILE=TILE_N, IEEE=q.dtype == torch.float32 or interpreted,
        UPCAST=interpreted and q.dtype != torch.float32,
    )  # fmt: skip
