"""Where the engine runs: device, dtype, attention backend and KV cache size, resolved from the config.

Every choice is made here once, logged by the engine, and shown at /health: nothing falls back silently.
On a GPU the KV cache takes what is left of `gpu_memory_utilization` of the card once the weights are in
and a profiling step has shown the activations' peak (as vLLM and SGLang size theirs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from common.config import EngineConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CPU_KV_CACHE_MB = 512


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """ "torch" (the reference, any device) or "triton" (GPU kernels; on the CPU only under the
    Triton interpreter, TRITON_INTERPRET=1, which is how the tests run them)."""
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    if not triton_importable():
        raise ValueError(
            "attention_backend=triton but the triton package is not installed (pip install 'splitserve[gpu]')"
        )
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend=triton needs a CUDA device (or TRITON_INTERPRET=1 to interpret the kernels "
            "on the CPU, slowly)"
        )
    return "triton"


def kv_blocks_for_gpu(
    total_bytes: int,
    free_bytes: int,
    activation_peak_bytes: int,
    utilization: float,
    bytes_per_block: int,
) -> int:
    """Blocks that fit in `utilization` of the card, given what is free now (weights loaded, other
    processes' use already gone from `free_bytes`) and the activations' peak seen while profiling.

    budget = utilization * total - (total - free) - activation_peak, never more than free - peak.
    """
    used = total_bytes - free_bytes
    budget = min(int(utilization * total_bytes) - used, free_bytes) - activation_peak_bytes
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"no GPU memory left for the KV cache: {used / 2**30:.2f} GiB of {total_bytes / 2**30:.2f} GiB "
            f"in use, activations peak at {activation_peak_bytes / 2**30:.2f} GiB, gpu_memory_utilization="
            f"{utilization}; raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return int(blocks)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, 8, then every 8 up to max_num_seqs (itself included).
    A step of n sequences replays the smallest captured size >= n with padding rows."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    cuda_graphs: bool

    @classmethod
    def from_config(cls, config: EngineConfig) -> Placement:
        device = resolve_device(config.device)
        backend = resolve_attention_backend(config.attention_backend, device)
        return cls(
            device=device,
            dtype=resolve_dtype(config.dtype, device),
            attention_backend=backend,
            # graphs replay fixed launches: only the Triton path's metadata is all device tensors
            cuda_graphs=config.cuda_graphs and device.type == "cuda" and backend == "triton",
        )

    def describe(self) -> dict[str, str | bool]:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {
            "device": str(self.device),
            "device_name": name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.attention_backend,
            "cuda_graphs": self.cuda_graphs,
        }
