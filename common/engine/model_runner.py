"""Runs one scheduled step through the model with selective batching.

The step's tokens of every sequence, prefill chunks and decode tokens alike, are flattened into one
(T,) batch; the model runs its non-attention ops on (T, hidden) and attention over each sequence's
own paged KV. Logits are computed only for the rows that sample.

Inputs are built on the host and moved to the KV cache's device. With the Triton backend the metadata
also goes over as device tensors (`KernelMetadata`); decode-only steps on a GPU replay CUDA graphs.

When the step has KV to ship (a prefill service's connector built transfer metadata for it), the
connector's worker side is called once per layer, as soon as that layer's K/V are in the cache.

With tensor parallelism rank 0's runner hands each step's `StepInputs` to `share_step` (which sends it
to the other ranks) before its forward; a worker rank's runner runs it with `run_shard`, making the
same forward and logits calls, so every collective inside the model meets its peers.

Prompt logprobs are scored in slices of at most PROMPT_LOGPROB_ROWS rows: a long prompt chunk never
makes a (chunk x vocab) logits tensor (and its float32 log-softmax), only (slice x vocab) ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from common.engine.cuda_graphs import DecodeGraphs
from common.engine.kv_connector import KVConnector
from common.engine.sampler import Sampled, Sampler, prompt_logprobs
from common.engine.scheduler import SchedulerOutput
from common.kv.kv_cache import PagedKVCache
from common.model.attention import AttentionMetadata, KernelMetadata
from common.model.llama import LlamaForCausalLM

log = logging.getLogger("splitserve.engine")

# Rows of prompt logprobs scored at once: each slice makes (rows x vocab) logits and a float32 copy of
# them (~128 MiB each for a 128k vocabulary) however long the prompt chunk is.
PROMPT_LOGPROB_ROWS = 256


@dataclass
class StepInputs:
    """One step flattened on the host (see ModelRunner.prepare)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    # layer groups 1.. (common/kv/layer_groups.py): per group the slots and block tables, as above
    group_slots: list[list[int]] = field(default_factory=list)
    group_tables: list[list[list[int]]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    # prompt logprobs: (sequence index in out.scheduled, first row, first position, row count), in slices
    # of at most PROMPT_LOGPROB_ROWS rows (every rank makes the same compute_logits calls, one per slice)
    prompt_rows: list[tuple[int, int, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        attention_backend: str = "torch",
        connector: KVConnector | None = None,
        eos_token_ids: tuple[int, ...] = (),
        share_step: Callable[[StepInputs, Any], None] | None = None,
    ) -> None:
        self.model = model
        self.share_step = share_step  # tensor parallelism, rank 0: sends the step to the other ranks
        self.connector = connector or KVConnector()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.extra_groups = range(kv_cache.spec.groups.num_groups - 1)  # layer groups past group 0
        self.sampler = Sampler(eos_token_ids)
        self.device = kv_cache.k.device
        if attention_backend == "triton" and model.config.is_mla:
            # the latent has its own attention (common/model/mla.py): decode rows through its Triton kernel
            # (common/kernels/mla_attention.py), prefill chunks and fp8 caches on the torch path, on device
            log.warning(
                "%s (MLA): decode attention through the MLA Triton kernel, prefill chunks on the torch path",
                model.config.architecture,
            )
            attention_backend = "torch"
        self.use_kernels = attention_backend == "triton"
        self.graphs: DecodeGraphs | None = None

    def enable_graphs(self, batch_sizes: list[int], max_model_len: int, capture: bool = True) -> None:
        """Serve decode-only steps of up to max(batch_sizes) sequences from captured CUDA graphs."""
        if self.model.config.is_mla:
            log.warning("%s (MLA): no CUDA graphs (they need Triton)", self.model.config.architecture)
            return
        if self.kv_cache.spec.groups.num_groups > 1:  # the graphs hold one block table per sequence
            log.warning(
                "%s: no CUDA graphs with a KV block table per layer group (full and sliding layers)",
                self.model.config.architecture,
            )
            return
        assert self.use_kernels, "CUDA graphs need the Triton attention backend"
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_cache, batch_sizes, max_blocks, capture=capture)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Flatten the step on the host: token ids, positions, slots, and per sequence its new-token
        offsets, context length and block table."""
        bs = self.block_size
        step = StepInputs()
        groups = self.extra_groups
        step.group_slots, step.group_tables = [[] for _ in groups], [[] for _ in groups]
        # padding rows (static baseline) recompute their last token in place: same cost, no new KV
        rows = [(seq, seq.num_computed_tokens, n, True) for seq, n in out.scheduled]
        rows += [(seq, seq.num_tokens - 1, 1, False) for seq in out.padding]
        for i, (seq, start, n, samples) in enumerate(rows):
            end = start + n
            if samples and seq.prompt_logprobs is not None:
                # rows whose next token is a prompt token not scored yet (a recomputed prompt is not
                # scored twice); the row at position p scores token p + 1
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(end, seq.num_prompt_tokens - 1)
                for pos in range(first, last, PROMPT_LOGPROB_ROWS):
                    row0 = step.query_start_loc[-1] + pos - start
                    step.prompt_rows.append((i, row0, pos, min(PROMPT_LOGPROB_ROWS, last - pos)))
            step.ids.extend(seq.token_ids[start:end])
            step.positions.extend(range(start, end))
            bt = seq.block_table
            step.slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            step.query_start_loc.append(step.query_start_loc[-1] + n)
            step.context_lens.append(end)
            step.block_tables.append(bt[: -(-end // bs)])
            for g in groups:
                gt = seq.group_tables[g]
                step.group_slots[g].extend(gt[p // bs] * bs + p % bs for p in range(start, end))
                step.group_tables[g].append(gt[: -(-end // bs)])
            if samples and end == seq.num_tokens:
                step.sample_rows.append(step.query_start_loc[-1] - 1)
        return step

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
        self, out: SchedulerOutput, transfer: Any | None = None, commit: bool = True
    ) -> list[Sampled | None]:
        """Forward the step and sample; one entry per scheduled sequence (None: chunk mid-prompt).
        `transfer` is the connector's metadata for this step: each layer is handed to its worker side.
        Sequences that asked for prompt logprobs get this step's rows scored (seq.prompt_logprobs).
        commit=False computes all of it and keeps none (no prompt logprobs stored): a probe of whether
        the step raises (LLMEngine's fault isolation); its KV writes are the ones the step makes anyway."""
        step = self.prepare(out)
        if self.share_step is not None:  # with the other ranks' share of the step's KV writes
            self.share_step(step, self.connector.rank_meta(transfer) if transfer is not None else None)
        hidden = self.forward(step, transfer)
        result: list[Sampled | None] = [None] * len(out.scheduled)
        for i, row0, pos0, n in step.prompt_rows:
            self._score_prompt(out.scheduled[i][0], hidden[row0 : row0 + n], pos0, commit)
        if not step.sample_rows:
            return result
        logits = self.model.compute_logits(hidden[step.sample_rows])  # (N, vocab)
        sampling = [
            (i, seq) for i, (seq, _) in enumerate(out.scheduled) if step.context_lens[i] == seq.num_tokens
        ]
        tokens = self.sampler(logits, [seq for _, seq in sampling])
        for (i, _), tok in zip(sampling, tokens, strict=True):
            result[i] = tok
        return result

    def forward(self, step: StepInputs, transfer: Any | None = None) -> torch.Tensor:
        """The step's final hidden states (T, hidden); its K/V land in the cache."""
        ids = torch.tensor(step.ids, dtype=torch.long)
        positions = torch.tensor(step.positions, dtype=torch.long)
        slots = torch.tensor(step.slots, dtype=torch.long)
        on_layer_done = None
        if transfer is not None:
            connector = self.connector

            def on_layer_done(layer: int) -> None:
                connector.save_layer(layer, transfer)

        if self.graphs is not None and transfer is None and self._decode_only(step):
            # a tier hit of all but its last token is a one-token step, too: a replayed graph does not
            # call the layers' waits, so its loads are settled first
            self.kv_cache.settle_loads()
            # the graph's static buffers take the host tensors directly: no per-step metadata to build
            return self.graphs.run(ids, positions, slots, step.context_lens, step.block_tables)
        meta = self.attention_metadata(step.query_start_loc, step.context_lens, step.block_tables, slots)
        meta.others = [
            self.attention_metadata(
                step.query_start_loc, step.context_lens, t, torch.tensor(s, dtype=torch.long)
            )
            for s, t in zip(step.group_slots, step.group_tables, strict=True)
        ]
        dev = self.device
        hidden: torch.Tensor = self.model(
            ids.to(dev, non_blocking=True),
            positions.to(dev, non_blocking=True),
            self.kv_cache,
            meta,
            on_layer_done=on_layer_done,
        )
        return hidden

    @torch.inference_mode()
    def run_shard(self, step: StepInputs, transfer: Any | None = None) -> None:
        """A worker rank's part of the step rank 0 runs in `run`: the same forward (posting this
        rank's KV writes, `transfer`, to its connector), then the same compute_logits calls (prompt
        rows, then sampled rows), whose gathers rank 0 collects."""
        hidden = self.forward(step, transfer)
        for _, row0, _, n in step.prompt_rows:
            self.model.compute_logits(hidden[row0 : row0 + n])
        if step.sample_rows:
            self.model.compute_logits(hidden[step.sample_rows])

    def _score_prompt(self, seq: Any, hidden: torch.Tensor, pos0: int, commit: bool = True) -> None:
        """Logprobs of prompt tokens pos0 + 1 .. pos0 + n from the rows of positions pos0 .. pos0 + n - 1
        (one slice: n <= PROMPT_LOGPROB_ROWS)."""
        assert seq.prompt_logprobs is not None
        k = seq.params.prompt_logprobs or 0
        targets = seq.token_ids[pos0 + 1 : pos0 + 1 + hidden.shape[0]]
        scored = prompt_logprobs(self.model.compute_logits(hidden), targets, k)
        if commit:
            seq.prompt_logprobs.extend(scored)

    def _decode_only(self, step: StepInputs) -> bool:
        assert self.graphs is not None
        n = len(step.context_lens)
        return step.query_start_loc[-1] == n and self.graphs.size_for(n) is not None
