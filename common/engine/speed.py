"""How fast this engine has been lately: moving averages of its own steps, published in the service's
registry load so that a router can predict a new request's TTFT and TPOT (router/slo.py)."""

from __future__ import annotations


class StepSpeed:
    """Exponential moving averages over recent steps (each new step weighs ALPHA). Plain floats of the
    engine thread; other threads read them in the engine's published `EngineLoad`."""

    ALPHA = 0.2
    LONG_PREFILL = 256  # prompt tokens in a step for it to count towards `long_prefill_tps`

    def __init__(self) -> None:
        self.prefill_tps = 0.0  # prompt tokens per second of a step that computes prompt tokens
        # the same over steps of at least LONG_PREFILL prompt tokens only: what computing more of a long
        # prompt costs a token, without the fixed cost of a step that a short one is mostly made of (a
        # tier hit is weighed against it: common/kv/offload.py)
        self.long_prefill_tps = 0.0
        self.decode_step_ms = 0.0  # one step that only decodes (one token per running sequence)

    def observe(self, seconds: float, prefill_tokens: int, decode_seqs: int) -> None:
        """One step took `seconds` to compute `prefill_tokens` prompt tokens and one token for each of
        `decode_seqs` sequences. A mixed step counts towards prefill speed only: it is the prompt work
        a new request waits for."""
        if seconds <= 0:
            return
        if prefill_tokens:
            self.prefill_tps = _ewma(self.prefill_tps, prefill_tokens / seconds, self.ALPHA)
            if prefill_tokens >= self.LONG_PREFILL:
                self.long_prefill_tps = _ewma(self.long_prefill_tps, prefill_tokens / seconds, self.ALPHA)
        elif decode_seqs:
            self.decode_step_ms = _ewma(self.decode_step_ms, seconds * 1000.0, self.ALPHA)


def _ewma(old: float, new: float, alpha: float) -> float:
    return new if old == 0.0 else old + alpha * (new - old)
