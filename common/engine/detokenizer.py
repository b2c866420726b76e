"""Incremental detokenization that never splits a UTF-8 character across two deltas.

A byte-level BPE token can end in the middle of a multi-byte character; decoding it alone gives
U+FFFD. We decode a small window of recent tokens and emit text only once it no longer ends in U+FFFD.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: gives the decoder context (leading spaces)
        self.read_offset = 0  # tokens before this are already in self.text
        self.text = ""
        self.stop = stop
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feed one token; returns the new text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._apply_stop(delta)

    def _apply_stop(self, delta: str) -> str:
        """Cut the text at the first stop string; a stop string may straddle deltas."""
        if not self.stop:
            self.text += delta
            return delta
        before = len(self.text)
        self.text += delta
        window_start = max(0, before - max(len(s) for s in self.stop) + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self.text[before:] if len(self.text) > before else ""
        return delta
