"""Token sampling: greedy for the whole batch at once, stochastic rows one by one.

Each request with a seed owns a torch.Generator, so its samples do not depend on which other
requests share its step.
"""

from __future__ import annotations

import torch

from common.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> list[int]:
        """logits: (N, vocab) float32, one row per request that samples this step."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._sample_row(logits[i], p, self._generator(request_ids[i], p.seed))
        return tokens

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        row = row.float() / p.temperature  # (vocab,)
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # drop a token once the mass before it already reaches top_p (the first always stays)
            drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
            sorted_logits[drop] = float("-inf")
            row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
        probs = torch.softmax(row, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen).item())
