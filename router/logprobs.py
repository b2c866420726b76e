"""Logprobs in the OpenAI shapes, from the (logprob, top) pairs the services send with each token.

Chat: `choices[].logprobs.content[]` = {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}.
Completions: `choices[].logprobs` = {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}.
A token's text is its bytes decoded as UTF-8 with replacement (a multi-byte character split over tokens
shows as U+FFFD in each piece; `bytes` has the exact bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import llguidance

from common.sampling_params import TokenLogprob
from common.text.tokenizer import Tokenizer


class TokenTexts:
    """Each token id's exact bytes (byte-level BPE, byte-fallback and special tokens alike), cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ll: llguidance.LLTokenizer | None = None  # built on the first logprobs request (~0.2 s)
        self.bytes_of = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        if self._ll is None:
            t = self._tok
            self._ll = llguidance.LLTokenizer(
                t.tok.to_str(), n_vocab=t.vocab_size, eos_token=list(t.eos_token_ids)
            )
        return bytes(self._ll.decode_bytes([token_id]))

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")


def chat_content(texts: TokenTexts, ids: Sequence[int], lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """The `content` list of a chat choice's logprobs for these tokens."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text_of(token_id), "logprob": logprob, "bytes": list(texts.bytes_of(token_id))}

    return [
        {**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
        for t, lp in zip(ids, lps, strict=True)
    ]


class CompletionLogprobs:
    """Accumulates the `logprobs` object of a text completion (offsets count characters of the text
    returned, echoed prompt included)."""

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self.texts, self.offset = texts, offset

    def part(self, ids: Sequence[int], lps: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        """The logprobs object for these tokens, continuing the text offsets of the previous part."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp in zip(ids, lps, strict=True):
            text = self.texts.text_of(t)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:  # the first prompt token: nothing predicts it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(lp.logprob)
                top: dict[str, float] = {}
                for i, v in lp.top:
                    top.setdefault(self.texts.text_of(i), v)  # two ids may share a text: keep the likelier
                out["top_logprobs"].append(top)
        return out


def merge(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two completion logprobs objects as one (echoed prompt + completion)."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in b}
