"""IncrementalDetokenizer as the router uses it: UTF-8 safe deltas, stop strings cut the text, and
no part of a stop string is ever emitted (a possible start of one is held back until resolved)."""

from __future__ import annotations

import random

from common.text.detokenizer import IncrementalDetokenizer
from tests.support.router_fakes import model_info


class CharTokenizer:
    """Token i is the i-th string of a fixed vocabulary: lets a test choose token boundaries."""

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = vocab

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids)


def _run(pieces: list[str], stop: tuple[str, ...]) -> tuple[list[str], IncrementalDetokenizer]:
    tok = CharTokenizer(pieces)
    d = IncrementalDetokenizer(tok, stop)
    out = []
    for i in range(len(pieces)):
        out.append(d.add(i))
        if d.stopped:
            break
    if not d.stopped:
        out.append(d.flush())
    return out, d


def test_possible_stop_prefix_is_held_then_released() -> None:
    out, d = _run(["x", "a", "b", "d"], ("abc",))
    assert out == ["x", "", "", "abd", ""] and not d.stopped and d.text == "xabd"


def test_stop_across_tokens_is_cut_and_never_emitted() -> None:
    out, d = _run(["x", "a", "b", "cyz"], ("abc",))
    assert out == ["x", "", "", ""] and d.stopped and d.text == "x"


def test_overlapping_prefixes_and_several_stops() -> None:
    out, d = _run(["a", "a", "a", "b", "q"], ("aab", "zz"))
    assert "".join(out) == "a" and d.stopped and d.text == "a"
    out, d = _run(["hello ", "wor", "ld"], ("world", "lo w"))
    assert "".join(out) == "hel" and d.text == "hel"


def test_without_stop_strings_every_delta_is_immediate() -> None:
    out, d = _run(["a", "b", "c"], ())
    assert out == ["a", "b", "c", ""] and d.text == "abc"


def test_random_splits_match_truncation_and_never_overshoot() -> None:
    rng = random.Random(0)
    alphabet = "ab c"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2))
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        hits = [i for s in stops if (i := text.find(s)) != -1]
        expected = text[: min(hits)] if hits else text
        out, d = _run(pieces, stops)
        emitted = ""
        for delta in out:
            emitted += delta
            assert expected.startswith(emitted), (text, stops, pieces, out)
        assert emitted == expected == d.text and d.stopped == bool(hits)


def test_real_tokenizer_never_emits_a_broken_character() -> None:
    tok = model_info().tokenizer
    text = "Grüße 😀🎉 日本語のテキスト and ascii"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, ("テキ",))
    deltas = [d.add(i) for i in ids]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == "Grüße 😀🎉 日本語の" and d.stopped
