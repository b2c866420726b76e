"""`splitserve sim-calibrate`: fit a sim profile's fixed per-step cost to a real GPU run.

The input is the `gpu_check.json` that scripts/gpu_check.sh writes on a GPU machine: its `gpu` field
(nvidia-smi's name, memory, driver) and its `batching` result (the continuous-batching engine's output
tokens, tokens/s and step count on that GPU, the default model SmolLM2-135M). The measured mean step is
output_tokens / tok_s / steps; the roofline of that same model on the profile's GPU (its weights, read
once a step, at the profile's bandwidth efficiency) is what the hardware needs; the rest is the per-step
cost of the engine on that machine (launches, sampling, Python), which becomes the profile's
`efficiency.step_overhead_s`. A 135M model is launch-bound on an H100 (the roofline is ~0.1 ms), so this
run cannot fit the FLOPs or bandwidth efficiencies: they stay the profile's (docs/simulation.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from common.engine.sim_profile import SimProfile


def measured_step_s(batching: dict[str, Any]) -> float:
    """The mean step of gpu_check's batching run (continuous batching), in seconds."""
    try:
        tokens, tok_s, steps = (
            batching[k] for k in ("output_tokens", "continuous_tok_s", "continuous_steps")
        )
    except KeyError as e:
        raise ValueError(f"gpu_check.json: its batching result has no {e} (skipped or failed run?)") from None
    if not (tok_s > 0 and steps > 0):
        raise ValueError(f"gpu_check.json: batching measured tok_s={tok_s}, steps={steps}")
    return float(tokens) / float(tok_s) / float(steps)


def gguf_params(path: str) -> int:
    """Parameters of a GGUF model, from its tensor table (no weights read)."""
    from common.text.model_info import read_gguf_header

    return sum(math.prod(t.shape) for t in read_gguf_header(path).tensors)


def fit(profile: SimProfile, check: dict[str, Any], model_params: int) -> tuple[SimProfile, dict[str, Any]]:
    """The profile with step_overhead_s fitted to the check's batching run (module doc), and the figures."""
    gpu = str(check.get("gpu", ""))
    family = profile.gpu.name.split()[1] if " " in profile.gpu.name else profile.gpu.name  # "H100"
    if family not in gpu:
        raise ValueError(f"gpu_check.json ran on {gpu!r}, the profile {profile.name} is a {profile.gpu.name}")
    step = measured_step_s(check.get("batching") or {})
    weights = model_params * 2  # the check runs bf16 on a GPU
    roofline = weights / (profile.gpu.memory_bandwidth * profile.efficiency.bandwidth)
    overhead = max(0.0, step - roofline)
    eff = profile.efficiency.model_copy(update={"step_overhead_s": round(overhead, 6)})
    fitted = profile.model_copy(update={"name": f"{profile.name}-calibrated", "efficiency": eff})
    figures = {
        "gpu": gpu,
        "profile": fitted.name,
        "measured_step_ms": round(step * 1e3, 3),
        "roofline_step_ms": round(roofline * 1e3, 4),
        "step_overhead_ms": round(overhead * 1e3, 3),
        "was_step_overhead_ms": round(profile.efficiency.step_overhead_s * 1e3, 3),
    }
    return fitted, figures


def add_parser(sub: Any) -> None:
    c = sub.add_parser(
        "sim-calibrate",
        help="fit a sim profile's per-step cost to scripts/gpu_check.sh's output",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    c.add_argument("gpu_check", help="the gpu_check.json a GPU run wrote")
    c.add_argument("--profile", required=True, help="the profile to fit (a shipped name or a JSON file)")
    c.add_argument("--out", required=True, help="where to write the fitted profile (JSON)")
    c.add_argument("--model", help="the GGUF the check ran (default: the default model, SmolLM2-135M)")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from common.text.model_info import resolve_model

    try:
        check = json.loads(Path(args.gpu_check).read_text())
        fitted, figures = fit(
            SimProfile.load(args.profile), check, gguf_params(resolve_model(args.model).path)
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text(fitted.model_dump_json(indent=2) + "\n")
    print(json.dumps({**figures, "out": args.out}))
    return 0
