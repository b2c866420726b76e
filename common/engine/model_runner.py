"""Runs one scheduled step through the model with selective batching.

The step's tokens of every sequence, prefill chunks and decode tokens alike, are flattened into one
(T,) batch; the model runs its non-attention ops on (T, hidden) and attention per sequence over its
own paged KV. Logits are computed only for the rows that sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.engine.sampler import Sampler
from common.engine.scheduler import SchedulerOutput
from common.kv.kv_cache import PagedKVCache
from common.model.attention import AttentionMetadata
from common.model.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.sampler = Sampler()
        self.device = kv_cache.k.device

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the step: (input_ids, positions, attention metadata, rows that sample)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        ctx_lens: list[int] = []
        tables: list[torch.Tensor] = []
        sample_rows: list[int] = []
        for seq, n in out.scheduled:
            # padding (static baseline) recomputes its last token in place: same cost, no new KV
            start = seq.num_tokens - 1 if seq.padding else seq.num_computed_tokens
            end = start + n
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            bt = seq.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + n)
            ctx_lens.append(end)
            tables.append(torch.tensor(bt[: -(-end // bs)], dtype=torch.long))
            if end == seq.num_tokens:
                sample_rows.append(qsl[-1] - 1)
        meta = AttentionMetadata(qsl, ctx_lens, tables, torch.tensor(slots, dtype=torch.long))
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta, sample_rows

    @torch.inference_mode()
    def run(
        self, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None
    ) -> list[int | None]:
        """Forward the step and sample; one entry per scheduled sequence (None: chunk mid-prompt)."""
        input_ids, positions, meta, sample_rows = self.prepare(out)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, on_layer_done=on_layer_done)
        result: list[int | None] = [None] * len(out.scheduled)
        if not sample_rows:
            return result
        logits = self.model.compute_logits(hidden[sample_rows])  # (N, vocab)
        sampling = [
            (i, seq) for i, (seq, n) in enumerate(out.scheduled) if meta.context_lens[i] == seq.num_tokens
        ]
        tokens = self.sampler(
            logits, [s.params for _, s in sampling], [s.num_output_tokens for _, s in sampling]
        )
        for (i, _), tok in zip(sampling, tokens, strict=True):
            result[i] = tok
        return result
