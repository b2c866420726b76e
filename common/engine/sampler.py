"""Token sampling: logits processing on the batch, then a batched argmax for greedy rows and a host draw
for each stochastic row.

Each row's logits go through, in this order (each step only over the rows that use it):

    raw logits
    + logit_bias
    min_tokens mask        EOS (unless ignore_eos) and stop_token_ids get -inf until min_tokens are out
    repetition_penalty     HF/CTRL, over prompt and output tokens
    frequency/presence     OpenAI, over the output tokens only
    grammar mask           structured outputs: -inf on every token the grammar refuses
    (greedy rows: argmax here)
    temperature, top_k, top_p, min_p, draw      stochastic rows, on the host

Biases come first so that a penalty scales what the client asked for, and the masks are -inf, which
every penalty leaves at -inf: so the min_tokens mask is applied last, where it can see what the grammar
left, and steps aside where it would forbid every token (a grammar that may only end now wins over
min_tokens: its output must stay valid). Temperature and the truncations shape only the draw, so greedy
rows skip them.

A seeded request draws each token from a generator seeded by (seed, output index). Its samples then
depend neither on which requests share its step nor on which service draws them: the prefill service
samples token 0 and the decode service the rest, and a migrated request continues exactly. Penalties
and grammars depend only on the sequence's token ids, which both services hold.

Logprobs are of the processed distribution (what the token was drawn from) or of the raw logits. A batch
that uses none of these features costs what sampling always did: one argmax, and one host draw per
stochastic row.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from common.sampling_params import SamplingParams, TokenLogprob

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) pairs over the seed space
_NO_LOGPROB = -9999.0  # returned in place of -inf and NaN: JSON cannot carry -inf
_NEG_INF = float("-inf")


def token_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """(rows, ceil(vocab / 32)) int32, every bit set: the layout llguidance's matchers fill. Made here,
    not with llguidance.torch.allocate_token_bitmask: importing llguidance.torch runs a torch.compile
    decorator, which imports dynamo and inductor and adds 2-3 s to every engine process's start."""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


def draw_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index) % (2**63)


class GrammarMask(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Fill row `row` of an int32 bitmask made by `token_bitmask(n, vocab)`: bit t % 32 of word
        t // 32 set allows token t."""
        ...


class SampleRow(Protocol):
    # read-only: a Sequence whose attributes are narrower (grammar: GrammarMatcher | None) still fits
    @property
    def params(self) -> SamplingParams: ...
    @property
    def token_ids(self) -> list[int]: ...  # prompt + output so far
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def grammar(self) -> GrammarMask | None: ...


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    logprob: TokenLogprob | None  # None unless params.logprobs is not None


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Sampled]:
        """logits: (N, vocab) float32 or bf16, one row per entry of `rows`; the token drawn for a row is
        its output number len(row.token_ids) - row.num_prompt_tokens."""
        n = len(rows)
        assert logits.dim() == 2 and logits.shape[0] == n, (tuple(logits.shape), n)
        if n == 0:
            return []
        params = [r.params for r in rows]
        out_index = [len(r.token_ids) - r.num_prompt_tokens for r in rows]
        x, dead = self._process(logits, rows, params, out_index)

        tokens = x.argmax(dim=-1).tolist() if any(p.greedy for p in params) else [0] * n
        stochastic = [i for i, p in enumerate(params) if not p.greedy and i not in dead]
        drawn_from: dict[int, torch.Tensor] = {}  # processed host rows whose logprobs are asked for
        if stochastic:
            # on the host: seeded generators are CPU generators, and the same seed must draw the same
            # token whichever device (CPU or GPU service) samples it; one copy for all the rows
            host = (x if len(stochastic) == n else x[stochastic]).float().cpu()
            for j, i in enumerate(stochastic):
                p = params[i]
                row = self._warp(host[j], p)
                gen = None
                if p.seed is not None:
                    gen = torch.Generator().manual_seed(draw_seed(p.seed, out_index[i]))
                tokens[i] = int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen).item())
                if p.logprobs is not None and p.logprobs_mode == "processed":
                    drawn_from[i] = row
        for i in dead:
            # the grammar allows nothing (a matcher in error): end the sequence rather than emit garbage
            tokens[i] = self.eos_token_ids[0] if self.eos_token_ids else int(logits[i].argmax())

        logprobs = self._logprobs(logits, x, params, tokens, drawn_from)
        return [Sampled(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]

    def _process(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRow],
        params: list[SamplingParams],
        out_index: list[int],
    ) -> tuple[torch.Tensor, set[int]]:
        """The logits after bias, penalties and masks (`logits` itself when no row needs any), and the
        rows whose grammar left no token."""
        vocab = logits.shape[1]
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        freq = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        grammars = [(i, g) for i, r in enumerate(rows) if (g := r.grammar) is not None]
        blocked = [
            (i, ids)
            for i, p in enumerate(params)
            if out_index[i] < p.min_tokens and (ids := self._blocked(p, vocab))
        ]
        if not (bias or rep or freq or grammars or blocked):
            return logits, set()

        x = logits.to(torch.float32, copy=True)  # the caller's logits stay raw
        dev = x.device
        if bias:
            r, t, b = zip(*bias, strict=True)
            values = torch.tensor(b, dtype=torch.float32, device=dev)
            x.index_put_((_ids(r, dev), _ids(t, dev)), values, accumulate=True)
        if rep:
            seen = _counts([rows[i].token_ids for i in rep], vocab, dev) > 0
            rp = _column([params[i].repetition_penalty for i in rep], dev)
            sub = x[rep]
            x[rep] = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
        if freq:
            counts = _counts([rows[i].token_ids[rows[i].num_prompt_tokens :] for i in freq], vocab, dev)
            fp = _column([params[i].frequency_penalty for i in freq], dev)
            pp = _column([params[i].presence_penalty for i in freq], dev)
            x[freq] = x[freq] - (fp * counts + pp * (counts > 0))
        dead: set[int] = set()
        if grammars:
            g_rows = [i for i, _ in grammars]
            bitmask = token_bitmask(len(grammars), vocab)
            for j, (_, g) in enumerate(grammars):
                g.fill_bitmask(bitmask, j)
            # unpacked with plain tensor ops: llguidance's apply_token_bitmask_inplace is torch.compile'd,
            # which stalls the first guided step for seconds and needs a C++ toolchain on a CPU service
            bits = (bitmask.to(dev, non_blocking=True).unsqueeze(-1) >> _SHIFTS.to(dev)) & 1
            allowed = bits.view(len(grammars), -1)[:, :vocab].bool()
            masked = x[g_rows].masked_fill(~allowed, _NEG_INF)
            x[g_rows] = masked
            alive = torch.isfinite(masked).any(dim=-1).tolist()
            dead = {i for i, ok in zip(g_rows, alive, strict=True) if not ok}
        if blocked:
            b_rows = [i for i, _ in blocked]
            local = [j for j, (_, ids) in enumerate(blocked) for _ in ids]
            ids = [t for _, ids in blocked for t in ids]
            sub = x[b_rows]
            masked = sub.index_put((_ids(local, dev), _ids(ids, dev)), torch.tensor(_NEG_INF, device=dev))
            keep = torch.isfinite(masked).any(dim=-1, keepdim=True)
            x[b_rows] = torch.where(keep, masked, sub)
        return x, dead

    def _blocked(self, p: SamplingParams, vocab: int) -> list[int]:
        """The ids min_tokens holds back."""
        ids = set(p.stop_token_ids) if p.ignore_eos else {*p.stop_token_ids, *self.eos_token_ids}
        return sorted(t for t in ids if 0 <= t < vocab)

    @staticmethod
    def _warp(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p over one host row (float32): the logits drawn from. Up to
        min-p this is the sampler's original arithmetic, op for op: seeded requests draw as before."""
        row = row / p.temperature  # (vocab,)
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, _NEG_INF)
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # drop a token once the mass before it already reaches top_p (the first always stays)
            drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
            sorted_logits[drop] = _NEG_INF
            row = torch.full_like(row, _NEG_INF).scatter(0, order, sorted_logits)
        if p.min_p > 0.0:
            probs = torch.softmax(row, dim=-1)
            row = row.masked_fill(probs < p.min_p * probs.max(), _NEG_INF)
        return row

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,
        x: torch.Tensor,
        params: list[SamplingParams],
        tokens: list[int],
        drawn_from: dict[int, torch.Tensor],
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not want:
            return out
        raw = [i for i in want if params[i].logprobs_mode == "raw"]
        # processed rows not drawn on the host: greedy ones (and rows whose grammar left nothing)
        processed = [i for i in want if params[i].logprobs_mode != "raw" and i not in drawn_from]
        groups: list[tuple[list[int], torch.Tensor]] = []
        if raw:
            groups.append((raw, logits[raw]))
        if processed:
            groups.append((processed, x[processed]))
        if drawn_from:
            groups.append((list(drawn_from), torch.stack(list(drawn_from.values()))))
        for idx, rows in groups:
            entries = _entries(
                torch.log_softmax(rows.float(), dim=-1),
                [tokens[i] for i in idx],
                [params[i].logprobs or 0 for i in idx],
            )
            for i, e in zip(idx, entries, strict=True):
                out[i] = e
        return out


def prompt_logprobs(logits: torch.Tensor, next_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """Raw logprobs: entry i is the logprob of next_ids[i] under logits row i, and the top k."""
    assert logits.shape[0] == len(next_ids), (tuple(logits.shape), len(next_ids))
    if not next_ids:
        return []
    return _entries(torch.log_softmax(logits.float(), dim=-1), list(next_ids), [k] * len(next_ids))


_SHIFTS = torch.arange(32, dtype=torch.int32)


def _entries(logprobs: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Per row of (m, vocab) logprobs: the token's logprob and the top ks[row], best first."""
    lp = torch.nan_to_num(logprobs, nan=_NO_LOGPROB, neginf=_NO_LOGPROB)
    chosen = lp.gather(1, _ids(tokens, lp.device).unsqueeze(1)).squeeze(1).tolist()
    k = min(max(ks), lp.shape[1])
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k:
        vals, ids = lp.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    return [
        TokenLogprob(c, tuple(zip(top_ids[j][:kj], top_vals[j][:kj], strict=True)) if kj else ())
        for j, (c, kj) in enumerate(zip(chosen, ks, strict=True))
    ]


def _ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _counts(histories: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(histories), vocab) float32: how many times each token id occurs in each history."""
    flat = torch.tensor(list(itertools.chain.from_iterable(histories)), dtype=torch.long)
    offsets = torch.repeat_interleave(
        torch.arange(len(histories)) * vocab, torch.tensor([len(h) for h in histories])
    )
    counts = torch.zeros(len(histories) * vocab, device=device)
    counts.scatter_add_(0, (flat + offsets).to(device), torch.ones(flat.numel(), device=device))
    return counts.view(len(histories), vocab)
