"""Per-request sampling settings: one typed struct from the router to the sampler, validated where it
is made and again wherever it is decoded (it travels inside GenerateRequest and PrefillRequest).

Everything a sampled token depends on is here or in the sequence's own token ids, so token 0 (sampled
by a prefill service) and every later token (sampled by a decode service) see the same state:
penalties count the tokens the sequence holds, a grammar is replayed over the output so far.
"""

from __future__ import annotations

from typing import Literal

import msgspec

MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's chat limit)

GuideKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class Guide(msgspec.Struct, frozen=True):
    """A structured-output constraint. `spec`: the JSON schema (json_schema), "" (json_object), the
    regular expression (regex), a JSON list of strings (choice), a Lark grammar (grammar). Compiled
    where tokens are sampled (common/text/grammar.py), once per distinct guide."""

    kind: GuideKind
    spec: str = ""


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One position's log-probabilities: the token's own, and the `top` most likely (id, logprob) pairs,
    best first (as many as asked)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0 means off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # applied where text exists (the router, offline generate), never on the wire
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this x the times the token is in the output
    repetition_penalty: float = 1.0  # CTRL/HF: logits of prompt and output tokens divided (>0) or multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # per output token: its logprob and the top `logprobs` (None: none)
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (raw logits)
    logprobs_mode: Literal["processed", "raw"] = "processed"  # of the distribution sampled from, or raw
    guide: Guide | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for tok, bias in self.logit_bias:
            if tok < 0 or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {tok}: {bias}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return msgspec.structs.replace(self, **changes)
