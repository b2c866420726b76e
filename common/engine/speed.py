"""How fast this engine has been lately: moving averages of its own steps, published in the service's
registry load so that a router can predict a new request's TTFT and TPOT (router/slo.py).

A step that computes prompt tokens costs a fixed part (the weights read once, the step's own overhead)
and a part per token. Tokens per second averaged over recent steps mixes the two: with short prompts
among long ones it under-rates a long prompt's speed and over-rates a short one's (measured on
SmolLM2-135M, prompts of 24 and 400 tokens two to one: a 400-token step took ~510 ms and was predicted
at ~960). So the engine also fits `step_ms = fixed + per_token x tokens` over recent prompt steps, by
exponentially weighted least squares, and publishes the two terms once its steps have spread enough in
size to tell them apart.

A decode step is the same and more so: its time hardly grows with the batch at small batches (the
weights are read once for all the sequences; SmolLM2 on this CPU: 76 ms at 1 sequence, 82 ms at 16).
So decode-only steps get the same fit, `step_ms = fixed + per_seq x sequences`, from which a router
predicts what one more sequence costs the batch."""

from __future__ import annotations

from common.cluster.capacity import full_step_tps


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
        # a prompt step's time as fixed + per token x its tokens (module doc); both 0 until fitted
        self.prefill_step_ms = 0.0
        self.prefill_ms_per_token = 0.0
        self._prefill_fit = _Fit()  # x: the step's tokens, y: its ms
        # a decode-only step's time as fixed + per sequence x its sequences; both 0 until fitted
        self.decode_step_fixed_ms = 0.0
        self.decode_ms_per_seq = 0.0
        # x: the step's sequences, y: its ms; a step no longer at 16 sequences than at 1 is flat, not unknown
        self._decode_fit = _Fit(flat=True)

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
            # all the tokens it computed, decode rows included
            if (fit := self._prefill_fit.add(prefill_tokens + decode_seqs, seconds * 1000.0)) is not None:
                self.prefill_step_ms, self.prefill_ms_per_token = fit
        elif decode_seqs:
            self.decode_step_ms = _ewma(self.decode_step_ms, seconds * 1000.0, self.ALPHA)
            if (fit := self._decode_fit.add(decode_seqs, seconds * 1000.0)) is not None:
                self.decode_step_fixed_ms, self.decode_ms_per_seq = fit

    def full_step_tps(self, step_tokens: int) -> float:
        """Prompt tokens per second of a step of `step_tokens` tokens, by the fit (else the average)."""
        return full_step_tps(self.prefill_step_ms, self.prefill_ms_per_token, step_tokens, self.prefill_tps)


class _Fit:
    """y = fixed + slope x x by exponentially weighted least squares over recent (x, y) pairs (each pair's
    weight decays by DECAY a pair). A fit once the pairs weigh MIN_WEIGHT and their x spread (standard
    deviation over mean) is at least MIN_SPREAD; pairs too alike in x to separate the two parts leave
    the last fit standing. A negative fixed part is none: proportional through the means. y falling with
    x is noise around a flat line: `flat` takes it as one (y = its mean), else no fit."""

    DECAY = 0.9  # ~10 pairs
    MIN_WEIGHT = 3.0
    MIN_SPREAD = 0.25

    def __init__(self, flat: bool = False) -> None:
        self._m = [0.0] * 5  # weighted sums: 1, x, x^2, y, x*y
        self.flat = flat

    def add(self, x: float, y: float) -> tuple[float, float] | None:
        """Add one pair; the (fixed, slope) fit it allows, or None (keep the last)."""
        d = self.DECAY
        self._m = [d * m + v for m, v in zip(self._m, (1.0, x, x * x, y, x * y), strict=True)]
        w, sx, sxx, sy, sxy = self._m
        if w < self.MIN_WEIGHT:
            return None
        mx, my = sx / w, sy / w
        var, cov = sxx / w - mx * mx, sxy / w - mx * my
        if var <= (self.MIN_SPREAD * mx) ** 2:
            return None
        if cov <= 0:
            return (my, 0.0) if self.flat else None
        slope = cov / var
        fixed = my - slope * mx
        if fixed < 0:
            return 0.0, my / mx
        return fixed, slope


def _ewma(old: float, new: float, alpha: float) -> float:
    return new if old == 0.0 else old + alpha * (new - old)
