"""CUDA graphs for decode-only steps.

A decode step of a small model is dominated by kernel launches (≈ 10 per layer); a captured graph
replays all of them in one launch. Graphs replay fixed shapes and fixed addresses, so every input lives
in a static buffer sized for the largest batch, and a step of n sequences replays the graph captured for
the smallest size b >= n. The b - n padding rows have context length 0 and slot -1: the attention kernel
gives them zeros and `store_kv` skips them, so they never touch a real block.

`capture=False` runs the very same padded, static-buffer forward eagerly: that is how the padding logic
is tested on the CPU (with the Triton kernels interpreted), and what a GPU falls back to for batch
sizes it has no graph for (the runner sends steps larger than the largest graph down the normal path).
"""

from __future__ import annotations

import torch

from common.kv.kv_cache import PagedKVCache
from common.model.attention import AttentionMetadata, KernelMetadata
from common.model.llama import LlamaForCausalLM


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        capture: bool = True,
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.sizes = sorted(set(batch_sizes))
        device = kv_cache.k.device
        b = self.sizes[-1]

        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.long, device=device)
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=device)  # decode: one row each
        self.context_lens = i32(b)
        self.block_tables = i32(b, max_blocks_per_seq)
        self.seq_ids = torch.arange(b, dtype=torch.int32, device=device)
        self.no_seqs = i32(0)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served from a captured graph (for tests and /health)
        if capture:
            self.capture()

    def _forward(self, b: int) -> torch.Tensor:
        km = KernelMetadata(
            self.query_start[: b + 1],
            self.context_lens[:b],
            self.block_tables[:b],
            self.seq_ids[:b],
            self.no_seqs,
            0,
        )
        # the host-side lists serve only the torch reference path, which graphs never take
        meta = AttentionMetadata(list(range(b + 1)), [0] * b, [], self.slots[:b], kernel=km)
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_cache, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture largest first, so smaller graphs reuse the largest one's memory pool."""
        pool = None
        stream = torch.cuda.Stream()
        for b in reversed(self.sizes):
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the kernels and settle the allocator before capturing
                    self._forward(b)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def size_for(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)

    def run(
        self,
        input_ids: torch.Tensor,  # (n,) long, host or device
        positions: torch.Tensor,  # (n,)
        slots: torch.Tensor,  # (n,)
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:  # (n, hidden)
        n = len(context_lens)
        b = self.size_for(n)
        if b is None:
            raise ValueError(f"decode batch of {n} is larger than the largest captured size {self.sizes[-1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        self.input_ids[n:b].zero_()
        self.positions[n:b].zero_()
        self.slots[n:b].fill_(-1)
        ctx = torch.zeros(b, dtype=torch.int32)
        ctx[:n] = torch.tensor(context_lens, dtype=torch.int32)
        self.context_lens[:b].copy_(ctx, non_blocking=True)
        width = max(len(t) for t in block_tables)
        if width > self.block_tables.shape[1]:
            cap = self.block_tables.shape[1]
            raise ValueError(f"a sequence needs {width} blocks; the graphs' tables hold {cap}")
        table = torch.zeros((n, width), dtype=torch.int32)
        for i, t in enumerate(block_tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        # entries past a row's own blocks are stale but never read: the kernel stops at its context
        self.block_tables[:n, :width].copy_(table, non_blocking=True)
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        graph.replay()
        self.replays += 1
        return self.outputs[b][:n]
