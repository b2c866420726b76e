"""The paged, selectively batched forward must give the same logits as a dense forward.

One flattened step of several sequences is compared with the dense forward over the same flattened
tokens (block-diagonal causal attention, no cache): the matmuls see the same rows, so fp32 must agree
to 1e-4. Each sequence is also compared with the dense forward run alone, and a schedule of prefill
chunks and decode steps with the dense forward of the whole sequence. Those runs put a token in
matmuls of different row counts, and MKL picks a different GEMM kernel (summation order) per row
count: a 1-row and a 17-row matmul already differ by ~4e-5 at the logits, and 30 layers compound that
to ~1.5e-4 on logits of magnitude ~30 (relative ~5e-6). So those are checked exactly in float64
(1e-6: any indexing, masking or RoPE-position bug shows far above it) and to 3e-4 in float32.
These bounds were set on SmolLM2; the tests run the tiny test model (4 layers, the same head layout
and tokenizer), whose paths share every kernel and index with the real model's.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.model.attention import AttentionMetadata

BLOCK = 4
TOL = {torch.float64: 1e-6, torch.float32: 3e-4}


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["fp64", "fp32"])
def model_tok(request, tiny):
    if request.param == torch.float32:
        return tiny
    from common.model.loader import load_model
    from tests.support.tiny_model import tiny_model_path

    return load_model(tiny_model_path(), dtype=request.param)


def make_cache(model, num_blocks: int = 64) -> PagedKVCache:
    c = model.config
    spec = KVCacheSpec(c.num_layers, num_blocks, BLOCK, c.num_kv_heads, c.head_dim, model.dtype)
    return PagedKVCache(spec)


def make_meta(chunks: list[tuple[list[int], int, int]]) -> tuple[AttentionMetadata, torch.Tensor]:
    """chunks: per sequence (block_table, num_computed, n_new) -> metadata and the (T,) positions."""
    qsl, ctx, tables, slots, positions = [0], [], [], [], []
    for table, done, n_new in chunks:
        for pos in range(done, done + n_new):
            slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
            positions.append(pos)
        qsl.append(qsl[-1] + n_new)
        ctx.append(done + n_new)
        tables.append(torch.tensor(table, dtype=torch.long))
    meta = AttentionMetadata(qsl, ctx, tables, torch.tensor(slots, dtype=torch.long))
    return meta, torch.tensor(positions, dtype=torch.long)


def shuffled_tables(lengths: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Non-contiguous, interleaved block ids per sequence (as a long-running block pool hands out)."""
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = []
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(ids[:need])
        ids = ids[need:]
    return tables


def prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Hi",
        "In 1492, Columbus sailed the ocean blue; 3.14159 is pi. Ünïcödé and 日本語 too.",
        "def f(x):\n    return x * 2\n",
        "Paris",
    ]
    return [tokenizer.encode(t) for t in texts[:n]]


@torch.inference_mode()
def test_one_flattened_step_matches_dense(model_tok) -> None:
    model, tokenizer = model_tok
    seqs = prompts(tokenizer, 5)
    cache = make_cache(model)
    tables = shuffled_tables([len(s) for s in seqs], 64, seed=0)
    meta, positions = make_meta([(t, 0, len(s)) for t, s in zip(tables, seqs, strict=True)])
    input_ids = torch.tensor([tok for s in seqs for tok in s])
    done_layers: list[int] = []
    n_layers = model.config.num_layers

    def on_layer_done(i: int) -> None:
        # layer i's KV is already written and layer i+1's not yet: safe to ship layer i now
        assert cache.k[i].abs().sum() > 0 and cache.v[i].abs().sum() > 0
        assert i + 1 == n_layers or cache.k[i + 1].abs().sum() == 0
        done_layers.append(i)

    hidden = model(input_ids, positions, cache, meta, on_layer_done=on_layer_done)  # (T, hidden)
    assert done_layers == list(range(n_layers))
    logits = model.compute_logits(hidden)  # (T, vocab)
    assert logits.dtype == torch.float32 and logits.shape == (len(input_ids), model.config.vocab_size)
    flat_ref = model.dense_forward(input_ids, seq_lens=[len(s) for s in seqs])  # same rows, dense attention
    diff = (logits - flat_ref).abs().max().item()
    assert diff <= 1e-4 if model.dtype == torch.float32 else diff <= 1e-6, (
        f"flattened step: max abs diff {diff}"
    )
    for i, s in enumerate(seqs):
        ref = model.dense_forward(torch.tensor(s))
        got = logits[meta.query_start_loc[i] : meta.query_start_loc[i + 1]]
        diff = (got - ref).abs().max().item()
        assert diff <= TOL[model.dtype], f"sequence {i}: max abs diff {diff}"


@torch.inference_mode()
def test_chunked_prefill_and_decode_match_dense(model_tok) -> None:
    """Each step every unfinished sequence contributes a random chunk (1 token = a decode step);
    every token's logits, whichever step computed it, must equal the dense forward's."""
    model, tokenizer = model_tok
    seqs = prompts(tokenizer, 4)
    # extend each sequence so there are real decode-sized steps after the prefill chunks
    seqs = [s + tokenizer.encode(" and then some more words follow here") for s in seqs]
    cache = make_cache(model, num_blocks=96)
    tables = shuffled_tables([len(s) for s in seqs], 96, seed=1)
    done = [0] * len(seqs)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    rng = random.Random(2)
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        chunks, order, ids = [], [], []
        for i, s in enumerate(seqs):
            left = len(s) - done[i]
            if left == 0 or rng.random() < 0.2:  # sometimes a sequence sits a step out
                continue
            n = 1 if done[i] > 0 and rng.random() < 0.5 else rng.randint(1, min(left, 9))
            n = min(n, left)
            chunks.append((tables[i], done[i], n))
            order.append(i)
            ids.extend(s[done[i] : done[i] + n])
        if not chunks:
            continue
        meta, positions = make_meta(chunks)
        logits = model.compute_logits(model(torch.tensor(ids), positions, cache, meta))
        for j, i in enumerate(order):
            got[i].append(logits[meta.query_start_loc[j] : meta.query_start_loc[j + 1]])
            done[i] += chunks[j][2]
    for i, s in enumerate(seqs):
        ref = model.dense_forward(torch.tensor(s))
        diff = (torch.cat(got[i]) - ref).abs().max().item()
        assert diff <= TOL[model.dtype], f"sequence {i}: max abs diff {diff}"
