"""What the services send back for one request, checked as it arrives: the output tokens in order, each
exactly once (token 0 from the prefill service on the split path, the rest from the decode service,
which after a migration continues where the client is), their logprobs when the request asked, the
prompt's logprobs (echo), the prefix-cache reuse and the decode service's finish reason. Anything that
breaks these rules is the service's bug: a 502, never shown to the client as text."""

from __future__ import annotations

from common.sampling_params import SamplingParams, TokenLogprob
from router.errors import APIError


class Output:
    def __init__(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.prompt_ids, self.sampling = prompt_ids, sampling
        self.ids: list[int] = []  # every output token handed out, from P or D, in order
        self.logprobs: list[TokenLogprob] = []  # sampling.logprobs: one per ids entry
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # sampling.prompt_logprobs
        self.num_cached_tokens = 0  # prompt tokens the prefilling service found in its prefix cache
        self.finish_reason: str | None = None  # D's, once its stream says finished

    @property
    def tokens(self) -> list[int]:
        """What a placement sends: the prompt and the output handed out so far."""
        return self.prompt_ids + self.ids

    def accept(
        self, index: int, token_ids: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> list[int]:
        """Tokens `index`.. of the output (the new ones, to hand out). A frame that does not continue
        exactly where we are is the decode service's bug, never shown to a client. Logprobs, when the
        request asked, come with every token."""
        if index != len(self.ids):
            want = len(self.ids)
            raise APIError(502, f"decode stream out of order (frame index {index}, expected {want})")
        if self.sampling.logprobs is not None and token_ids:
            if logprobs is None or len(logprobs) != len(token_ids):
                raise APIError(502, "a service sent tokens without the logprobs the request asked for")
            self.logprobs += logprobs
        self.ids += token_ids
        return list(token_ids)

    def take_prompt_logprobs(self, lps: list[TokenLogprob | None] | None) -> None:
        if lps is not None and self.prompt_logprobs is None:
            if len(lps) != len(self.prompt_ids):
                n = len(self.prompt_ids)
                raise APIError(502, f"prompt logprobs for {len(lps)} tokens; the prompt has {n}")
            self.prompt_logprobs = lps

    def next_sampling(self) -> SamplingParams:
        """The request's sampling for its next placement: the prompt is scored once (a request placed
        again after a migration or a failed prefill that already has the scores does not ask again)."""
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is not None:
            return self.sampling.replace(prompt_logprobs=None)
        return self.sampling
