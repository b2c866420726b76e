"""The paged, selectively batched forward must give the same logits as the dense one-sequence forward."""

from __future__ import annotations

import random

import pytest
import torch

from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.model.attention import AttentionMetadata

pytestmark = pytest.mark.slow

BLOCK = 4
TOL = 1e-4


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
def test_one_flattened_step_matches_dense(smollm) -> None:
    model, tokenizer = smollm
    seqs = prompts(tokenizer, 5)
    cache = make_cache(model)
    tables = shuffled_tables([len(s) for s in seqs], 64, seed=0)
    meta, positions = make_meta([(t, 0, len(s)) for t, s in zip(tables, seqs, strict=True)])
    input_ids = torch.tensor([tok for s in seqs for tok in s])
    done_layers: list[int] = []
    hidden = model(input_ids, positions, cache, meta, on_layer_done=done_layers.append)  # (T, hidden)
    assert done_layers == list(range(model.config.num_layers))
    logits = model.compute_logits(hidden)  # (T, vocab)
    assert logits.dtype == torch.float32 and logits.shape == (len(input_ids), model.config.vocab_size)
    for i, s in enumerate(seqs):
        ref = model.dense_forward(torch.tensor(s))
        got = logits[meta.query_start_loc[i] : meta.query_start_loc[i + 1]]
        assert (got - ref).abs().max().item() <= TOL, f"sequence {i}"


@torch.inference_mode()
def test_chunked_prefill_and_decode_match_dense(smollm) -> None:
    """Each step every unfinished sequence contributes a random chunk (1 token = a decode step);
    every token's logits, whichever step computed it, must equal the dense forward's."""
    model, tokenizer = smollm
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
        assert diff <= TOL, f"sequence {i}: max abs diff {diff}"
