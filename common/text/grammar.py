"""Structured outputs: a `Guide` compiled with llguidance into a per-sequence token matcher.

The sampler asks each sequence's `GrammarMatcher` for a bitmask of the tokens the grammar allows next,
masks the logits with it, and feeds the sampled token back (`accept`). A matcher can be rebuilt from
the tokens generated so far (`GrammarCompiler.matcher(guide, output_ids)`), so a sequence that moves
between services (token 0 sampled by a prefill service, a migration) carries no grammar state: only
its guide and its ids.

JSON is generated compactly: no whitespace between tokens, "," and ":" as separators. llguidance's
default (`whitespace_flexible`) allows any run of whitespace, which a small model can fill forever;
we force it off, even over a schema's own `x-guidance`, so whitespace can never be the loop.

This module imports no torch, not even lazily: the router imports it (to validate guides) and the
router is kept free of torch (see [tool.importlinter] in pyproject.toml). Applying a bitmask to
logits is the sampler's job.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

import llguidance

from common.sampling_params import Guide

if TYPE_CHECKING:
    from common.text.tokenizer import Tokenizer

# Applied after the schema's own "x-guidance" options, so a request cannot turn whitespace back on.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}
_CACHE_SIZE = 256


class Bitmask(Protocol):
    """What `fill_bitmask` needs of its tensor: a torch.Tensor, typed structurally because torch must
    not be imported here at all (import-linter counts lazy and TYPE_CHECKING imports too)."""

    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def dtype(self) -> object: ...
    @property
    def device(self) -> Any: ...
    def dim(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


class GuideError(ValueError):
    """An invalid guide; the message is meant for the client (a 400)."""


def _json_grammar(schema: Any) -> str:
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GuideError("a JSON schema must be a JSON object (or true)")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)


def _choice_grammar(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except ValueError as e:
        raise GuideError(f"invalid choice guide: not a JSON list of strings ({e})") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GuideError("invalid choice guide: expected a non-empty JSON list of strings")
    # Lark string literals take JSON's escapes, so json.dumps quotes any string safely.
    alternatives = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


def guide_grammar(guide: Guide) -> str:
    """The llguidance grammar for `guide`. Only the guide's syntax is checked here (malformed JSON,
    a choice that is not a list of strings); `validate_guide` checks the grammar itself."""
    if guide.kind == "json_object":
        return _json_grammar({"type": "object"})
    if guide.kind == "json_schema":
        try:
            schema = json.loads(guide.spec)
        except ValueError as e:
            raise GuideError(f"invalid JSON schema: not valid JSON ({e})") from None
        return _json_grammar(schema)
    if guide.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(guide.spec)
    if guide.kind == "choice":
        return _choice_grammar(guide.spec)
    if guide.kind == "grammar":
        if not guide.spec.strip():
            raise GuideError("invalid grammar: it is empty")
        return llguidance.LLMatcher.grammar_from_lark(guide.spec)
    raise GuideError(f"unknown guide kind {guide.kind!r}")


_WHAT = {
    "json_schema": "JSON schema",
    "json_object": "JSON object guide",
    "regex": "regex",
    "choice": "choice guide",
    "grammar": "grammar",
}


def _message(guide: Guide, error: str) -> str:
    """One readable line or a few: llguidance appends parser-state dumps that mean nothing to a client."""
    error = error.split("\n<state>", 1)[0].strip()
    return f"invalid {_WHAT.get(guide.kind, 'guide')}: {error}"


@lru_cache(maxsize=_CACHE_SIZE)
def _check(guide: Guide) -> str:
    """The error message for `guide`, "" if it is valid (cached: the router checks every request)."""
    try:
        grammar = guide_grammar(guide)
    except GuideError as e:
        return str(e)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return _message(guide, messages[0] if messages else "unknown error") if is_error else ""


def validate_guide(guide: Guide) -> None:
    """Check a guide without a tokenizer (the router's check before a request is placed)."""
    error = _check(guide)
    if error:
        raise GuideError(error)


class GrammarMatcher:
    """One sequence's grammar state. Made by `GrammarCompiler.matcher`."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self._m = matcher
        self._words = words  # int32 words per bitmask row

    def fill_bitmask(self, bitmask: Bitmask, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`: a 2-D int32 CPU torch.Tensor of
        ceil(vocab_size / 32) words per row, bit i of word w allowing id 32*w + i (llguidance's layout,
        as the sampler's `token_bitmask` makes). Once the grammar is complete only EOS is
        allowed."""
        if str(bitmask.dtype) != "torch.int32" or bitmask.dim() != 2 or bitmask.device.type != "cpu":
            raise ValueError("the bitmask must be a 2-D int32 CPU tensor")
        if bitmask.shape[1] != self._words:
            raise ValueError(f"bitmask rows must hold {self._words} int32 words, not {bitmask.shape[1]}")
        v = bitmask[row]
        if not v.is_contiguous():
            raise ValueError("the bitmask row must be contiguous")
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), self._words * 4)

    def accept(self, token_id: int) -> bool:
        """Advance over one sampled token; False (and the matcher is in error for good) if refused."""
        return self._m.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and nothing but EOS may follow: the sequence should stop here."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete (EOS allowed), though it could go on."""
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        """Why a token was refused ("" if none was)."""
        return self._m.get_error()


class GrammarCompiler:
    """Compiles guides for one tokenizer and hands out matchers. A compiled guide is kept (LRU) as an
    initial-state matcher; each sequence gets a copy of it, which costs about a microsecond."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = _CACHE_SIZE) -> None:
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"the model's vocabulary ({vocab_size}) is smaller than its tokenizer's "
                f"({tokenizer.vocab_size}); structured outputs need every token id to have a logit"
            )
        eos = list(tokenizer.eos_token_ids) or None
        # n_vocab above the tokenizer's size: the padding ids exist in the logits but are never allowed.
        self._lltok = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._cache: OrderedDict[Guide, llguidance.LLMatcher | str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # guides compiled (cache misses), for tests and metrics

    def _compiled(self, guide: Guide) -> llguidance.LLMatcher:
        with self._lock:
            hit = self._cache.get(guide)
            if hit is not None:
                self._cache.move_to_end(guide)
        if hit is None:
            hit = self._compile(guide)
            with self._lock:
                self._cache[guide] = hit
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):  # a guide that failed once fails again without recompiling
            raise GuideError(hit)
        return hit

    def _compile(self, guide: Guide) -> llguidance.LLMatcher | str:
        self.compiles += 1
        try:
            grammar = guide_grammar(guide)
        except GuideError as e:
            return str(e)
        m = llguidance.LLMatcher(self._lltok, grammar, log_level=0)
        return _message(guide, m.get_error()) if m.is_error() else m

    def matcher(self, guide: Guide, output_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for `guide`, advanced over the tokens already generated."""
        m = self._compiled(guide).deep_copy()
        for i, t in enumerate(output_ids):
            if not m.consume_token(int(t)):
                raise GuideError(
                    f"the output so far does not match the guide: token {t} at position {i} is refused"
                )
        return GrammarMatcher(m, self._words)
