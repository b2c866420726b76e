"""SLO-aware admission: a request may carry TTFT / TPOT targets; the router predicts what each placement
would give and takes the first (in placement order) that meets them, or refuses the request at once
(429, with the prediction) when none can: a client with a deadline learns now, not after the miss.

Targets come from the `x-splitserve-ttft-slo-ms` / `x-splitserve-tpot-slo-ms` headers, else from the
API key's defaults (`ttft_slo_ms` / `tpot_slo_ms` in its limits). Predictions use what each service
measures and publishes in its heartbeat load:

    TTFT ≈ prefill_step_ms × steps + prefill_ms_per_token × work   [+ one decode step, local path]
           work = queued_tokens + uncached prompt tokens, steps = ceil(work / step_tokens)
    TPOT ≈ decode_step_fixed_ms + decode_ms_per_seq × (running + 1)   (one more sequence in its steps)

prefill_step_ms and prefill_ms_per_token are a fit of the service's recent prompt steps' times against
their sizes (common/engine/speed.py); until its steps have differed enough in size to fit, TTFT is
work / prefill_tps, the prompt tokens per second of recent steps (which under-rates a long prompt's
speed where short ones are common). decode_step_fixed_ms and decode_ms_per_seq are the same fit over
its decode-only steps against their sequences; until it exists, TPOT is decode_step_ms × (running + 1)
/ max(running, 1), the recent decode step taken as proportional to its batch (which over-rates what one
more sequence costs where the weights, read once a step, are most of it: 2x at one sequence). A
service that has not measured yet (no steps) is not predicted: it is taken as meeting any target, so a
cold cluster is never refused on a guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from router.errors import APIError

MAX_TARGET_MS = 3_600_000.0  # an hour: anything longer is not a latency target


@dataclass(frozen=True)
class Targets:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


def parse_target(value: str | None, header: str) -> float | None:
    """A header's target in ms (None when absent); a clear 400 for anything but a positive number."""
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= MAX_TARGET_MS:
        raise APIError(400, f"{header} must be a number of milliseconds in (0, {MAX_TARGET_MS:.0f}]", header)
    return ms


def predict_ttft_ms(load: dict[str, Any], uncached_tokens: int, local: bool) -> float | None:
    """Predicted time to first token on a service with this heartbeat load (None: not measured yet)."""
    work = int(load.get("queued_tokens", 0)) + max(uncached_tokens, 1)
    fixed, per_token = (
        float(load.get("prefill_step_ms") or 0.0),
        float(load.get("prefill_ms_per_token") or 0.0),
    )
    if per_token > 0:
        budget = int(load.get("step_tokens") or 0)
        ms = fixed * (math.ceil(work / budget) if budget > 0 else 1) + per_token * work
    else:
        tps = float(load.get("prefill_tps") or 0.0)
        if tps <= 0:
            return None
        ms = work / tps * 1000.0
    if local:  # the decode service also runs its current batch's step before the first token shows
        ms += float(load.get("decode_step_ms") or 0.0)
    return ms


def predict_tpot_ms(load: dict[str, Any]) -> float | None:
    """Predicted time per output token on a decode service once this request joins its batch."""
    running = int(load.get("running", 0))
    fixed, per_seq = (
        float(load.get("decode_step_fixed_ms") or 0.0),
        float(load.get("decode_ms_per_seq") or 0.0),
    )
    if fixed > 0 or per_seq > 0:
        return fixed + per_seq * (running + 1)
    step = float(load.get("decode_step_ms") or 0.0)
    if step <= 0:
        return None
    return step * (running + 1) / max(running, 1)


@dataclass(frozen=True)
class Prediction:
    ttft_ms: float | None
    tpot_ms: float | None

    def meets(self, t: Targets) -> bool:
        ttft_ok = t.ttft_ms is None or self.ttft_ms is None or self.ttft_ms <= t.ttft_ms
        tpot_ok = t.tpot_ms is None or self.tpot_ms is None or self.tpot_ms <= t.tpot_ms
        return ttft_ok and tpot_ok

    def describe(self) -> str:
        parts = []
        if self.ttft_ms is not None:
            parts.append(f"TTFT {self.ttft_ms:.0f} ms")
        if self.tpot_ms is not None:
            parts.append(f"TPOT {self.tpot_ms:.0f} ms")
        return ", ".join(parts) or "nothing measured"


def unattainable(t: Targets, best: Prediction) -> APIError:
    want = ", ".join(
        f"{name} {v:.0f} ms" for name, v in (("TTFT", t.ttft_ms), ("TPOT", t.tpot_ms)) if v is not None
    )
    return APIError(
        429,
        f"the latency target cannot be met now: the best placement predicts {best.describe()}, the request "
        f"asks for {want}; retry later or relax the target",
        code="slo_unattainable",
        headers={"Retry-After": "1"},
    )
