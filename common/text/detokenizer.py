"""Incremental detokenization that never splits a UTF-8 character across two deltas.

A byte-level BPE token can end in the middle of a multi-byte character; decoding it alone gives
U+FFFD. We decode a small window of recent tokens and emit text only once it no longer ends in U+FFFD.

With stop strings, text that could still turn out to be the start of a stop string is held back:
a streaming client must never see any part of a stop string. `flush()` releases what is held once
the sequence has ended for another reason (EOS, length).
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids one at a time with `add()`; it returns the text that is safe to show now.

    `text` is everything decoded so far (cut at the first stop string once one is seen), including
    text still held back; `stopped` turns true when a stop string was found.
    """

    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: gives the decoder context (leading spaces)
        self.read_offset = 0  # tokens before this are already in self.text
        self.text = ""
        self.stop = tuple(s for s in stop if s)  # an empty stop string would match everywhere
        self.stopped = False
        self._emitted = 0  # len(self.text) already returned by add()/flush()

    def add(self, token_id: int) -> str:
        """Feed one token; returns the new text it completes (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._apply_stop(delta)

    def flush(self) -> str:
        """The held-back tail: call once when generation ended without a stop string."""
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out

    def _apply_stop(self, delta: str) -> str:
        """Cut the text at the first stop string; a stop string may straddle deltas."""
        before = len(self.text)
        self.text += delta
        if not self.stop:
            return self._release(len(self.text))
        window_start = max(0, before - max(len(s) for s in self.stop) + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_len())

    def _held_len(self) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, end: int) -> str:
        # A tail held earlier can only grow into new text, never back into emitted text (it was the
        # longest such tail), so `end` never falls below what was emitted; max() is a guard.
        end = max(end, self._emitted)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
