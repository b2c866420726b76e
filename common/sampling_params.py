"""Per-request sampling settings: one typed struct from the router to the sampler, validated where it
is made and again wherever it is decoded (it travels inside GenerateRequest and PrefillRequest)."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # applied where text exists (the router, offline generate), never on the wire
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return msgspec.structs.replace(self, **changes)
