"""Token sampling: greedy for the whole batch at once, stochastic rows one by one.

A seeded request draws each token from a generator seeded by (seed, output index). Its samples then
depend neither on which requests share its step nor on which service draws them: the prefill
service samples token 0 and the decode service the rest, and a migrated request continues exactly.
"""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) pairs over the seed space


def draw_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index) % (2**63)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
    ) -> list[int]:
        """logits: (N, vocab) float32, one row per request that samples this step; output_index:
        the position in its output of the token each row draws."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                gen = (
                    None
                    if p.seed is None
                    else torch.Generator().manual_seed(draw_seed(p.seed, output_index[i]))
                )
                tokens[i] = self._sample_row(logits[i], p, gen)
        return tokens

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        # on the host: seeded generators are CPU generators, and the same seed must draw the same
        # token whichever device (CPU or GPU service) samples it
        row = row.float().cpu() / p.temperature  # (vocab,)
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
