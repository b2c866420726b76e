"""The sampler against a plain per-row reference of its semantics (common/engine/sampler.py's docstring),
plus the draws themselves: distributions, seeded reproducibility, masks, logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from common.engine.sampler import Sampled, Sampler, draw_seed, prompt_logprobs
from common.sampling_params import SamplingParams

NEG = -9999.0  # what the sampler returns for -inf
EOS = (1,)


class AllowOnly:
    """A GrammarMask allowing a fixed set of ids (llguidance's layout: bit t % 32 of int32 word t // 32)."""

    def __init__(self, ids: set[int]) -> None:
        self.ids = ids

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for t in self.ids:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor([w - 2**32 if w >= 2**31 else w for w in words], dtype=torch.int32)


@dataclass
class Row:
    params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [0])
    num_prompt_tokens: int = 1
    grammar: AllowOnly | None = None


def row(prompt: list[int] | None = None, output: list[int] | None = None, grammar=None, **params) -> Row:
    prompt = [0] if prompt is None else prompt
    return Row(SamplingParams(**params), [*prompt, *(output or [])], len(prompt), grammar)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


# ---- the reference: one row at a time, in the documented order ---------------------------------------


def ref_masked(raw: torch.Tensor, r: Row, eos: tuple[int, ...]) -> torch.Tensor:
    """Logits after bias, min_tokens, penalties and grammar (greedy rows take their argmax)."""
    p = r.params
    vocab = raw.numel()
    output = r.token_ids[r.num_prompt_tokens :]
    blocked = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))

    def pipeline(min_tokens_mask: bool) -> torch.Tensor:
        x = raw.float().clone()
        for t, b in p.logit_bias:
            if t < vocab:
                x[t] += b
        if min_tokens_mask:
            for t in blocked:
                if t < vocab:
                    x[t] = -math.inf
        for t in set(r.token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t in set(output):
            x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
        if r.grammar is not None:
            for t in range(vocab):
                if t not in r.grammar.ids:
                    x[t] = -math.inf
        return x

    active = len(output) < p.min_tokens
    x = pipeline(active)
    if active and not torch.isfinite(x).any():
        x = pipeline(False)  # min_tokens steps aside for a grammar that can only end
    return x


def ref_processed(raw: torch.Tensor, r: Row, eos: tuple[int, ...]) -> torch.Tensor:
    """The logits a row's token is drawn from."""
    p = r.params
    x = ref_masked(raw, r, eos)
    if p.greedy:
        return x
    x = x / p.temperature
    if p.top_k:
        kth = sorted(x.tolist(), reverse=True)[min(p.top_k, x.numel()) - 1]
        x = torch.where(x < kth, -math.inf, x)
    if p.top_p < 1:
        probs = torch.softmax(x, dim=-1).tolist()
        before = 0.0
        for t in sorted(range(x.numel()), key=lambda t: -x[t].item()):
            assume(abs(before - p.top_p) > 1e-4)  # no float coin-flips at the cut
            if before >= p.top_p:
                x[t] = -math.inf
            before += probs[t]
    if p.min_p:
        probs = torch.softmax(x, dim=-1)
        cut = p.min_p * probs.max()
        assume(bool(((probs - cut).abs() > 1e-6).all()))
        x = torch.where(probs < cut, -math.inf, x)
    return x


def ref_logprobs(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(torch.log_softmax(x, dim=-1), nan=NEG, neginf=NEG)


def check_logprob(s: Sampled, expected: torch.Tensor, k: int) -> None:
    """The token's logprob and the top k against a full reference logprob vector."""
    assert s.logprob is not None
    torch.testing.assert_close(s.logprob.logprob, expected[s.token_id].item())
    assert len(s.logprob.top) == k
    ids = [t for t, _ in s.logprob.top]
    vals = [v for _, v in s.logprob.top]
    assert len(set(ids)) == k
    assert vals == sorted(vals, reverse=True)
    torch.testing.assert_close(vals, sorted(expected.tolist(), reverse=True)[:k])
    torch.testing.assert_close(vals, [expected[t].item() for t in ids])  # ties may order ids either way


# ---- property test ------------------------------------------------------------------------------------


@st.composite
def cases(draw):
    vocab = draw(st.sampled_from([37, 50, 64]))
    ids = st.integers(0, vocab - 1)
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        prompt = draw(st.lists(ids, min_size=1, max_size=8))
        output = draw(st.lists(ids, max_size=6))
        allowed = draw(st.none() | st.sets(ids, min_size=1, max_size=12))
        params = SamplingParams(
            max_tokens=16,
            temperature=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7])),
            top_k=draw(st.sampled_from([0, 1, 5, 100])),
            top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
            min_p=draw(st.sampled_from([0.0, 0.05, 0.3])),
            seed=draw(st.none() | st.integers(0, 2**32)),
            min_tokens=draw(st.integers(0, 8)),
            stop_token_ids=tuple(draw(st.sets(ids, max_size=3))),
            ignore_eos=draw(st.booleans()),
            repetition_penalty=draw(st.sampled_from([1.0, 0.7, 1.3, 2.0])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.5, -1.0, 2.0])),
            presence_penalty=draw(st.sampled_from([0.0, 1.5, -0.5])),
            logit_bias=tuple(draw(st.dictionaries(ids, st.floats(-100, 100), max_size=4)).items()),
            logprobs=draw(st.none() | st.integers(0, 6)),
            logprobs_mode=draw(st.sampled_from(["processed", "raw"])),
        )
        rows.append(
            Row(params, prompt + output, len(prompt), None if allowed is None else AllowOnly(allowed))
        )
    seed = draw(st.integers(0, 2**31))
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    return logits, rows


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_matches_reference(case) -> None:
    logits, rows = case
    before = logits.clone()
    expected = [ref_processed(logits[i], r, EOS) for i, r in enumerate(rows)]
    for x, r in zip(expected, rows, strict=True):
        if r.params.greedy:
            top2 = x.topk(2).values
            assume(not torch.isfinite(top2[1]) or top2[0] - top2[1] > 1e-3)

    out = Sampler(EOS)(logits, rows)

    assert torch.equal(logits, before)  # the caller's logits stay raw
    assert len(out) == len(rows)
    for i, (s, r, x) in enumerate(zip(out, rows, expected, strict=True)):
        p = r.params
        if p.greedy:
            assert s.token_id == int(x.argmax())
        else:
            assert torch.isfinite(x[s.token_id])  # drawn from what survived every mask and cut
        if p.logprobs is None:
            assert s.logprob is None
        else:
            lp = ref_logprobs(logits[i] if p.logprobs_mode == "raw" else x)
            check_logprob(s, lp, p.logprobs)


# ---- draws ----------------------------------------------------------------------------------------------


def test_penalized_distribution() -> None:
    """Empirical frequencies of penalized, tempered draws against the reference's probabilities.

    n = 6000 draws: total variation moves by at most 1/n per draw and its mean here is about 0.011, so by
    McDiarmid P(TV > 0.05) <= exp(-2 * 0.039^2 * n) ~ 1e-8. Each wrong variant below sits more than 0.14
    away from the right distribution, so the test passes one with a smaller probability still."""
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 1.2, -1.0])
    prompt, output = [0, 5, 1, 1, 6], [2, 3, 3, 3, 0]  # 5: a negative logit, multiplied
    kw = dict(temperature=0.6, repetition_penalty=2.5, presence_penalty=0.8, frequency_penalty=0.6)
    good = row(prompt, output, **kw)
    want = torch.softmax(ref_processed(base, good, EOS), dim=-1)

    wrong = [
        row(prompt, output, **{**kw, "repetition_penalty": 1.0}),
        row(prompt, output, **{**kw, "presence_penalty": 0.0}),
        row(prompt, output, **{**kw, "frequency_penalty": 0.0}),
        row(prompt, output, **{**kw, "temperature": 1.0}),
        row([4], prompt + output, **kw),  # frequency and presence over the prompt too
        row([7], output, **kw),  # repetition over the output only
    ]
    for w in wrong:
        other = torch.softmax(ref_processed(base, w, EOS), dim=-1)
        assert 0.5 * (other - want).abs().sum() > 0.14

    n = 6000
    out = Sampler(EOS)(base.repeat(n, 1), [good] * n)
    freq = torch.bincount(torch.tensor([s.token_id for s in out]), minlength=8).float() / n
    assert 0.5 * (freq - want).abs().sum() < 0.05


def old_sample(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> list[int]:
    """The sampler before penalties, grammars and logprobs (verbatim): seeded draws must not change."""

    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        row = row.float().cpu() / p.temperature  # (vocab,)
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
            sorted_logits[drop] = float("-inf")
            row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
        probs = torch.softmax(row, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen).item())

    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            gen = (
                None if p.seed is None else torch.Generator().manual_seed(draw_seed(p.seed, output_index[i]))
            )
            tokens[i] = _sample_row(logits[i], p, gen)
    return tokens


@pytest.mark.parametrize("slow_path", [False, True])
def test_seeded_draws_match_the_old_sampler(slow_path: bool) -> None:
    torch.manual_seed(0)
    vocab = 1000
    plain = [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.7, top_k=40, seed=8),
        SamplingParams(temperature=1.3, top_p=0.9, seed=9),
        SamplingParams(temperature=0.9, top_k=100, top_p=0.8, seed=2**40),
        SamplingParams(),
    ]
    sampler = Sampler(EOS)
    for step in range(8):
        logits = torch.randn(len(plain), vocab) * 2
        rows = [Row(p, [5, 6, *([9] * step)], 2) for p in plain]
        if slow_path:  # a neighbour that needs processing and logprobs must not change anyone's draw
            logits = torch.cat([logits, torch.randn(1, vocab)])
            rows.append(row(output=[3], temperature=1.0, repetition_penalty=1.2, logprobs=5))
        got = [s.token_id for s in sampler(logits, rows)][: len(plain)]
        assert got == old_sample(logits[: len(plain)], plain, [step] * len(plain))


def test_bf16_logits() -> None:
    logits = torch.randn(3, 40).to(torch.bfloat16)
    rows = [row(), row(temperature=1.0, seed=3), row(temperature=1.0, seed=3, logprobs=2, presence_penalty=1)]
    out = Sampler(EOS)(logits, rows)
    assert out[0].token_id == int(logits[0].float().argmax())
    assert out[1].token_id == old_sample(logits, [rows[1].params] * 3, [0] * 3)[1]
    assert out[2].logprob is not None and len(out[2].logprob.top) == 2


# ---- masks -------------------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_the_index() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 1], logits[0, 5], logits[0, 8] = 5.0, 4.0, 1.0  # EOS, a stop id, the best of the rest
    sampler = Sampler(EOS)

    def token(n_out: int, **kw) -> int:
        return sampler(logits, [row(output=[0] * n_out, min_tokens=3, stop_token_ids=(5,), **kw)])[0].token_id

    assert [token(n) for n in range(5)] == [8, 8, 8, 1, 1]
    assert [token(n, ignore_eos=True) for n in range(4)] == [1, 1, 1, 1]
    logits[0, 1] = -5.0
    assert [token(n, ignore_eos=True) for n in range(4)] == [8, 8, 8, 5]  # the stop id is still held back
    # stochastic rows too, and the processed logprobs say so
    out = sampler(
        logits.repeat(200, 1), [row(min_tokens=2, stop_token_ids=(5,), temperature=1.0, logprobs=10)] * 200
    )
    assert {s.token_id for s in out}.isdisjoint({1, 5})
    assert out[0].logprob is not None
    assert dict(out[0].logprob.top).get(5, NEG) == NEG


def test_min_tokens_yields_to_a_grammar_that_can_only_end() -> None:
    logits = torch.randn(2, 40)
    rows = [
        row(min_tokens=4, grammar=AllowOnly({1})),
        row(min_tokens=4, temperature=1.0, grammar=AllowOnly({1})),
    ]
    assert [s.token_id for s in Sampler(EOS)(logits, rows)] == [1, 1]


def test_logit_bias_forbids_and_forces() -> None:
    logits = torch.randn(1, 30)
    best = int(logits.argmax())
    low = int(logits.argmin())
    sampler = Sampler()
    assert sampler(logits, [row(logit_bias=((best, -100.0),))])[0].token_id != best
    assert sampler(logits, [row(logit_bias=((low, 100.0),))])[0].token_id == low
    out = sampler(logits.repeat(100, 1), [row(temperature=1.0, logit_bias=((low, 100.0),))] * 100)
    assert {s.token_id for s in out} == {low}
    out = sampler(logits.repeat(300, 1), [row(temperature=1.0, logit_bias=((best, -100.0),))] * 300)
    assert best not in {s.token_id for s in out}
    # ids past the vocabulary are ignored rather than crashing the step
    assert sampler(logits, [row(logit_bias=((10_000, 50.0),))])[0].token_id == best


def test_min_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    sampler = Sampler()
    torch.manual_seed(5)
    for min_p, survivors in [(0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})]:
        out = sampler(logits.repeat(600, 1), [row(temperature=1.0, min_p=min_p, logprobs=4)] * 600)
        assert {s.token_id for s in out} == survivors
        lp = out[0].logprob
        assert lp is not None
        kept = {t for t, v in lp.top if v > NEG}
        assert kept == survivors
        torch.testing.assert_close(
            [v for _, v in lp.top][: len(survivors)],
            torch.log_softmax(logits[0, sorted(survivors)], dim=-1).tolist(),
        )


def test_grammar_mask() -> None:
    vocab = 50
    allowed = {3, 31, 33, 40}  # either side of the first int32 word, and its sign bit
    logits = torch.randn(1, vocab)
    logits[0, 31] = logits[0, 40] = -20.0
    g = AllowOnly(allowed)
    sampler = Sampler(EOS)
    greedy = sampler(logits, [row(grammar=g, logprobs=5)])[0]
    assert greedy.token_id == max(allowed, key=lambda t: logits[0, t].item())
    assert greedy.logprob is not None
    assert {t for t, v in greedy.logprob.top if v > NEG} == allowed
    out = sampler(logits.repeat(300, 1), [row(grammar=g, temperature=2.0)] * 300)
    assert {s.token_id for s in out} <= allowed
    only31 = sampler(logits, [row(grammar=AllowOnly({31}), temperature=1.0)])[0]
    assert only31.token_id == 31
    # raw logprobs ignore the grammar
    raw = sampler(logits, [row(grammar=g, logprobs=3, logprobs_mode="raw")])[0]
    assert raw.logprob is not None
    check_logprob(raw, ref_logprobs(logits[0]), 3)


def test_grammar_that_allows_nothing_ends_the_sequence() -> None:
    logits = torch.randn(2, 40)
    rows = [row(grammar=AllowOnly(set()), logprobs=1), row(grammar=AllowOnly(set()), temperature=1.0)]
    out = Sampler(EOS)(logits, rows)
    assert [s.token_id for s in out] == [EOS[0], EOS[0]]
    assert out[0].logprob is not None and out[0].logprob.logprob == NEG


# ---- logprobs -----------------------------------------------------------------------------------------


def test_logprob_shapes_and_modes() -> None:
    logits = torch.randn(5, 30)
    rows = [
        row(),
        row(logprobs=0),
        row(logprobs=3, logit_bias=((2, 10.0),)),
        row(logprobs=3, logit_bias=((2, 10.0),), logprobs_mode="raw"),
        row(logprobs=20, temperature=0.5, top_k=4),
    ]
    out = Sampler()(logits, rows)
    assert out[0].logprob is None
    assert out[1].logprob is not None and out[1].logprob.top == ()
    torch.testing.assert_close(out[1].logprob.logprob, torch.log_softmax(logits[1], -1).max().item())
    biased = logits[2].clone()
    biased[2] += 10.0
    check_logprob(out[2], ref_logprobs(biased), 3)
    assert out[2].token_id == 2 == out[2].logprob.top[0][0]  # type: ignore[union-attr]
    check_logprob(out[3], ref_logprobs(logits[3]), 3)
    tempered = ref_logprobs(ref_processed(logits[4], rows[4], ()))
    check_logprob(out[4], tempered, 20)
    assert sum(v > NEG for _, v in out[4].logprob.top) == 4  # type: ignore[union-attr]


def test_prompt_logprobs() -> None:
    logits = torch.randn(6, 40)
    next_ids = [3, 0, 39, 7, 7, 12]
    lp = torch.log_softmax(logits, dim=-1)
    for k in (0, 1, 5):
        out = prompt_logprobs(logits, next_ids, k)
        assert len(out) == 6
        for i, e in enumerate(out):
            torch.testing.assert_close(e.logprob, lp[i, next_ids[i]].item())
            vals, ids = lp[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
            assert [t for t, _ in e.top] == ids.tolist()
            torch.testing.assert_close([v for _, v in e.top], vals.tolist())
    masked = logits.clone()
    masked[0, 3] = -math.inf
    assert prompt_logprobs(masked, next_ids, 2)[0].logprob == NEG
    assert prompt_logprobs(torch.empty(0, 40), [], 3) == []
