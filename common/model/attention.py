"""Attention over the paged KV cache (selective batching).

Every other op of the step runs on the flattened (total_tokens, hidden) matrix; only attention needs to
know where one sequence ends and the next begins. In the torch path the decode sequences (one new token
each) go in one call, their block tables padded to the longest and the padding masked; each prefill
chunk goes on its own, over its own blocks. This torch version is the CPU reference; the Triton kernels
(common/kernels/paged_attention.py) must match it, and run instead when the metadata carries `kernel`
tensors (the model runner builds them for the Triton backend).

Per layer, two family options (common/model/config.py): `window` (sliding-window attention: a query at
position p sees keys p - window + 1 .. p) and `softcap` (gemma2: scores -> softcap * tanh(scores /
softcap), before the mask). With a window, the blocks wholly before a query's window are not read:
each sequence's keys are gathered from the block holding its first query's first visible key, and a
decode batch's entries before a row's window (and its padding) point at that row's own last block,
masked. So a block-table entry there may be a HOLE (common/kv/block_manager.py: a block released once
it slid out of every layer's window), which is never dereferenced: index_select would refuse -1.

Over an fp8 cache whose `exact_prefill` is on (the default), a prefill chunk (more than one new token)
attends to its own K/V as computed, not as stored: the rows of the chunk's own positions in what was
gathered are overwritten with them (common/kv/kv_cache.py says why and what it costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.kv.kv_cache import PagedKVCache


@dataclass
class KernelMetadata:
    """The same step as device tensors, for the Triton kernels (see common/kernels/paged_attention.py).

    Sequences are split into two launches: decode (one new token) and prefill (a chunk of several).
    Host-side ints size the grids, so a step needs no device-to-host read.
    """

    query_start_loc: torch.Tensor  # (S + 1,) int32
    context_lens: torch.Tensor  # (S,) int32
    block_tables: torch.Tensor  # (S, max_blocks) int32, padded with block 0
    decode_ids: torch.Tensor  # (D,) int32: sequences with one new token
    prefill_ids: torch.Tensor  # (P,) int32: the others
    max_prefill_tokens: int  # the most new tokens among prefill_ids

    @classmethod
    def build(
        cls,
        query_start_loc: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        device: torch.device,
    ) -> KernelMetadata:
        n_new = [b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)]
        width = max((len(t) for t in block_tables), default=1) or 1
        table = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for i, t in enumerate(block_tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        decode = [i for i, n in enumerate(n_new) if n == 1]
        prefill = [i for i, n in enumerate(n_new) if n != 1]

        def dev(x: list[int] | torch.Tensor) -> torch.Tensor:
            t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int32)
            return t.to(device, non_blocking=True)

        return cls(
            dev(query_start_loc),
            dev(context_lens),
            dev(table),
            dev(decode),
            dev(prefill),
            max((n_new[i] for i in prefill), default=0),
        )


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens sit in the flattened step, and where its KV lives.

    query_start_loc: len S+1; the new tokens of sequence i are rows [qsl[i], qsl[i+1]) of the step.
    context_lens:    len S; tokens of sequence i held in KV after this step (cached + new).
    block_tables:    per sequence, a (num_blocks_i,) long tensor of block ids.
    slot_mapping:    (T,) long; flat slot (block_id * block_size + offset) each new token's K/V goes to.
    """

    query_start_loc: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]
    slot_mapping: torch.Tensor
    kernel: KernelMetadata | None = field(default=None)
    # layer groups 1.. (common/kv/layer_groups.py): the same step through each group's block tables and
    # slots; this metadata is group 0's. Empty with one group.
    others: list[AttentionMetadata] = field(default_factory=list)
    _decodes: DecodeBatch | None = field(default=None, repr=False)  # built at the first layer

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of layer group `group` attends through."""
        return self.others[group - 1] if group else self

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def decode_batch(self, block_size: int) -> DecodeBatch | None:
        """The step's decode sequences (one new token each) as one padded batch; None with fewer than 2."""
        if self._decodes is None:
            self._decodes = DecodeBatch.build(self, block_size)
        return self._decodes if self._decodes.rows.numel() > 1 else None


@dataclass
class DecodeBatch:
    """The decode sequences of a step, for one attention call over all of them (the torch path):

    rows:   (D,) their rows in the step;
    blocks: (D, max_blocks) their block tables, padded with each row's last block, which also stands in
            for the row's HOLEs (blocks released before its window: masked by the window, never read);
    mask:   (D, 1, 1, max_blocks * block_size) bool, True for the positions each one has in KV;
    lens:   (D,) their context lengths (a sliding window's mask starts at len - window).
    """

    rows: torch.Tensor
    blocks: torch.Tensor
    mask: torch.Tensor
    lens: torch.Tensor

    def window_mask(self, window: int | None) -> torch.Tensor:
        """`mask`, less the positions before each sequence's window."""
        if window is None:
            return self.mask
        pos = torch.arange(self.mask.shape[-1], device=self.mask.device).unsqueeze(0)
        return self.mask & (pos >= (self.lens - window).unsqueeze(1))[:, None, None, :]

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> DecodeBatch:
        qsl = meta.query_start_loc
        seqs = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] == 1]
        device = meta.slot_mapping.device
        if len(seqs) < 2:
            empty = torch.empty(0, dtype=torch.long, device=device)
            return cls(empty, empty, empty.bool(), empty)
        width = max(len(meta.block_tables[i]) for i in seqs)
        blocks = torch.full((len(seqs), width), -1, dtype=torch.long, device=device)
        for j, i in enumerate(seqs):
            blocks[j, : len(meta.block_tables[i])] = meta.block_tables[i]
        last = torch.tensor([len(meta.block_tables[i]) - 1 for i in seqs], device=device).unsqueeze(1)
        blocks = torch.where(blocks < 0, blocks.gather(1, last), blocks)  # padding and holes
        lens = torch.tensor([meta.context_lens[i] for i in seqs], device=device)
        mask = torch.arange(width * block_size, device=device).unsqueeze(0) < lens.unsqueeze(1)
        rows = torch.tensor([qsl[i] for i in seqs], dtype=torch.long, device=device)
        return cls(rows, blocks, mask[:, None, None, :], lens)


def paged_attention(
    q: torch.Tensor,  # (T, n_heads, hd)
    k: torch.Tensor,  # (T, n_kv, hd) new tokens
    v: torch.Tensor,  # (T, n_kv, hd)
    layer: int,
    kv_cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # sliding window: each query sees its last `window` positions only
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
) -> torch.Tensor:  # (T, n_heads, hd)
    if meta.others:  # layer groups: this layer's block tables and slots
        meta = meta.for_group(kv_cache.group_of[layer])
    if meta.kernel is not None:
        return _triton_paged_attention(
            q, k, v, layer, kv_cache, meta.kernel, meta.slot_mapping, scale, window, softcap
        )
    kv_cache.write(layer, meta.slot_mapping, k, v)
    # an fp8 cache holds K and V rotated (common/kv/kv_cache.py): the query is rotated alike, the keys
    # and values read as they are, and the output rotated back at the end (a no-op for other caches)
    q = kv_cache.rotate(q)
    n_kv = k.shape[1]
    out = torch.empty_like(q)
    qsl = meta.query_start_loc
    bs = kv_cache.spec.block_size
    batch = meta.decode_batch(bs)
    if batch is not None:
        # every decode sequence in one call: its one query row against its own blocks, the padding masked
        d, hd = batch.blocks.shape[0], q.shape[2]
        kb, vb = kv_cache.read_blocks(layer, batch.blocks, rotated=True)  # (D, max_blocks, bs, n_kv, hd)
        kc = kb.view(d, -1, n_kv, hd).transpose(1, 2)  # (D, n_kv, L, hd)
        vc = vb.view(d, -1, n_kv, hd).transpose(1, 2)
        qd = q[batch.rows].unsqueeze(2)  # (D, n_heads, 1, hd)
        od = attend(qd, kc, vc, batch.window_mask(window), scale, softcap)
        out[batch.rows] = od.squeeze(2)
    for i in range(meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        if batch is not None and end - start == 1:
            continue  # computed above
        n_new, ctx = end - start, meta.context_lens[i]
        # the first key its first query sees (0 without a window): read from the block holding it on
        first = 0 if window is None else max(0, ctx - n_new - window + 1)
        off = first // bs * bs  # keys are gathered from position `off`: blocks before it never read
        table = meta.block_tables[i][first // bs :]
        kc, vc = kv_cache.gather(layer, table, ctx - off, rotated=True)  # (ctx - off, n_kv, hd)
        if kv_cache.exact_prefill and n_new > 1:  # fp8: the chunk's own K/V as computed (kv_cache.py)
            kc[ctx - n_new - off :] = kv_cache.rotate(k[start:end]).to(kc.dtype)
            vc[ctx - n_new - off :] = kv_cache.rotate(v[start:end]).to(vc.dtype)
        if n_new == 1:  # the step's one decode sequence (two or more went above)
            kd, vd = kc[first - off :].transpose(0, 1), vc[first - off :].transpose(0, 1)
            out[start] = decode_attention(q[start], kd, vd, scale, softcap)
            continue
        qi = q[start:end].transpose(0, 1)  # (n_heads, n_new, hd)
        ki, vi = kc.transpose(0, 1), vc.transpose(0, 1)  # (n_kv, ctx - off, hd)
        # query j (absolute position ctx - n_new + j) sees keys 0 .. ctx - n_new + j (those from off on)
        qpos = torch.arange(ctx - n_new, ctx, device=q.device).unsqueeze(1)
        kpos = torch.arange(off, ctx, device=q.device).unsqueeze(0)
        mask = kpos <= qpos  # (n_new, ctx)
        if window is not None:
            mask &= kpos > qpos - window
        oi = attend(qi, ki, vi, mask, scale, softcap)
        out[start:end] = oi.transpose(0, 1)
    return kv_cache.rotate(out)


def attend(
    q: torch.Tensor,  # (..., n_heads, L, hd)
    k: torch.Tensor,  # (..., n_kv, S, hd)
    v: torch.Tensor,  # (..., n_kv, S, hd)
    mask: torch.Tensor,  # bool, broadcasts to (..., n_heads, L, S): True where a key is visible
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:  # (..., n_heads, L, hd)
    """Masked attention, grouped-query (each group of n_heads // n_kv query heads shares one KV head).
    SDPA, which has no soft-capping; with `softcap` the scores are computed here (softmax in fp32)."""
    n_heads, n_kv = q.shape[-3], k.shape[-3]
    if softcap is None:
        # enable_gqa: the heads share KV without copying it
        gqa = n_heads != n_kv
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    k, v = k.repeat_interleave(n_heads // n_kv, dim=-3), v.repeat_interleave(n_heads // n_kv, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return torch.matmul(probs.to(v.dtype), v)


def decode_attention(
    q: torch.Tensor,  # (n_heads, hd): the sequence's one query row
    k: torch.Tensor,  # (n_kv, L, hd): its keys
    v: torch.Tensor,  # (n_kv, L, hd)
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:  # (n_heads, hd)
    """Attention of one query row (a lone decode sequence), grouped-query: the n_heads // n_kv query
    heads that share a KV head are one (group, hd) matrix against that head's keys, read in place.
    This takes about 40 % of SDPA's time on the CPU (SDPA with enable_gqa runs its math path for this
    shape, copying K and V per query head); for a padded, masked batch of decodes SDPA is faster, and
    paged_attention uses it there."""
    n_heads, hd = q.shape
    n_kv = k.shape[0]
    # (n_kv, group, L)
    scores = torch.matmul(q.view(n_kv, n_heads // n_kv, hd), k.transpose(1, 2)).mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # at least fp32 for bf16/fp16 (a no-op in fp32 and fp64)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return torch.matmul(probs.to(v.dtype), v).view(n_heads, hd)


def _triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    kv_cache: PagedKVCache,
    km: KernelMetadata,
    slot_mapping: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    from common.kernels.paged_attention import paged_attention_launch, store_kv

    kc, vc = kv_cache.layer_k(layer), kv_cache.layer_v(layer)
    sc = kv_cache.scales  # an fp8 cache's scales and offsets of this layer: (n_kv, hd) each, per channel
    ks, vs = (None, None) if sc is None else (sc.k[layer], sc.v[layer])
    ko = vo = None
    if sc is not None and kv_cache.offsets:  # offsets not all zero
        assert sc.k_off is not None and sc.v_off is not None
        ko, vo = sc.k_off[layer], sc.v_off[layer]
    kn = vn = None  # fp8 prefill chunks: their own K/V as computed, in the cache's units (kv_cache.py)
    if kv_cache.exact_prefill and km.max_prefill_tokens > 1:
        ku, vu = kv_cache.stored_units(k, layer, "k"), kv_cache.stored_units(v, layer, "v")
        store_kv(kv_cache.round_units(ku), kv_cache.round_units(vu), kc, vc, slot_mapping)  # computed once
        kn, vn = ku.to(q.dtype), vu.to(q.dtype)
    else:
        store_kv(kv_cache.quantize(k, layer, "k"), kv_cache.quantize(v, layer, "v"), kc, vc, slot_mapping)
    q = kv_cache.rotate(q)  # fp8: into the cache's rotated basis, the output back out of it (as above)
    out = torch.empty_like(q)
    common = (q, kc, vc, out, km.block_tables, km.query_start_loc, km.context_lens)
    for ids, most, decode in ((km.decode_ids, 1, True), (km.prefill_ids, km.max_prefill_tokens, False)):
        paged_attention_launch(
            *common, ids, scale, most, decode=decode, k_scale=ks, v_scale=vs, window=window, softcap=softcap,
            k_off=ko, v_off=vo, k_new=None if decode else kn, v_new=None if decode else vn,
        )  # fmt: skip
    return kv_cache.rotate(out)
