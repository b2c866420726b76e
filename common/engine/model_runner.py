"""Runs one scheduled step through the model with selective batching.

The step's tokens of every sequence, prefill chunks and decode tokens alike, are flattened into one
(T,) batch; the model runs its non-attention ops on (T, hidden) and attention per sequence over its
own paged KV. Logits are computed only for the rows that sample.

Inputs are built on the host and moved to the KV cache's device. With the Triton backend the metadata
also goes over as device tensors (`KernelMetadata`); decode-only steps on a GPU replay CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.engine.cuda_graphs import DecodeGraphs
from common.engine.sampler import Sampler
from common.engine.scheduler import SchedulerOutput
from common.kv.kv_cache import PagedKVCache
from common.model.attention import AttentionMetadata, KernelMetadata
from common.model.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: PagedKVCache, attention_backend: str = "torch"
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.sampler = Sampler()
        self.device = kv_cache.k.device
        self.use_kernels = attention_backend == "triton"
        self.graphs: DecodeGraphs | None = None
        self._host_tables: list[list[int]] = []

    def enable_graphs(self, batch_sizes: list[int], max_model_len: int, capture: bool = True) -> None:
        """Serve decode-only steps of up to max(batch_sizes) sequences from captured CUDA graphs."""
        assert self.use_kernels, "CUDA graphs need the Triton attention backend"
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_cache, batch_sizes, max_blocks, capture=capture)

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
        tables: list[list[int]] = []
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
            tables.append(bt[: -(-end // bs)])
            if end == seq.num_tokens:
                sample_rows.append(qsl[-1] - 1)
        self._host_tables = tables  # the block tables as lists, for the CUDA-graph path
        dev = self.device
        meta = self.attention_metadata(qsl, ctx_lens, tables, torch.tensor(slots, dtype=torch.long))
        ids_t = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        pos_t = torch.tensor(pos, dtype=torch.long).to(dev, non_blocking=True)
        return ids_t, pos_t, meta, sample_rows

    def attention_metadata(
        self, qsl: list[int], ctx_lens: list[int], tables: list[list[int]], slots: torch.Tensor
    ) -> AttentionMetadata:
        """Metadata for this runner's attention backend, on its device."""
        dev = self.device
        slot_t = slots.to(dev, non_blocking=True)
        if self.use_kernels:
            kernel = KernelMetadata.build(qsl, ctx_lens, tables, dev)
            return AttentionMetadata(qsl, ctx_lens, [], slot_t, kernel=kernel)
        table_t = [torch.tensor(t, dtype=torch.long, device=dev) for t in tables]
        return AttentionMetadata(qsl, ctx_lens, table_t, slot_t)

    @torch.inference_mode()
    def run(
        self, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None
    ) -> list[int | None]:
        """Forward the step and sample; one entry per scheduled sequence (None: chunk mid-prompt)."""
        input_ids, positions, meta, sample_rows = self.prepare(out)
        if self.graphs is not None and on_layer_done is None and self._decode_only(meta):
            hidden = self.graphs.run(
                input_ids, positions, meta.slot_mapping, meta.context_lens, self._host_tables
            )
        else:
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

    def _decode_only(self, meta: AttentionMetadata) -> bool:
        assert self.graphs is not None
        n = meta.num_seqs
        return meta.query_start_loc[-1] == n and self.graphs.size_for(n) is not None
