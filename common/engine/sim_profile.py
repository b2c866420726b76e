"""A hardware profile for the simulated engine (`--engine sim`) and the roofline arithmetic that turns a
scheduled step into seconds. Pure functions of the profile and the batch: no torch, no clock.

A profile is a model (parameters, shape, bytes per weight and per KV element), a GPU (peak dense FLOP/s,
memory bandwidth, memory size), the tensor-parallel degree and three efficiencies (the share of peak
FLOP/s and of peak bandwidth a real engine reaches, and a fixed per-step cost: launches, sampling, host
work). Shipped profiles live in `sim_profiles/*.json` (docs/simulation.md derives each number); a path to
a JSON file of the same shape works too, and a key that is not understood is an error.

One step's time, over the batch actually scheduled: each scheduled sequence computes `n` new tokens on top
of `c` tokens already in its KV (a decode row is n = 1; a prefill chunk has c = the tokens before it):

    flops = sum over rows of  2 * params * n  +  4 * layers * heads * head_dim * (n * c + n * (n + 1) / 2)
    bytes = weight_bytes  +  sum over rows of  kv_bytes_per_token * (c + n)   (KV read, and written)
    step  = max(flops / (tp * peak_flops * eff_flops), bytes / (tp * bandwidth * eff_bandwidth)) + overhead

A prefill-heavy step is compute-bound (the FLOPs term wins), a decode step memory-bound (the weights and
the batch's KV read once). Tensor parallelism splits both terms over `tp` GPUs; its all-reduces are not
modelled (docs/simulation.md says what that leaves out).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROFILE_DIR = Path(__file__).with_name("sim_profiles")


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SimModelSpec(_Strict):
    name: str
    num_params: float = Field(gt=0)
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    max_position_embeddings: int = Field(ge=1)
    bytes_per_weight: float = Field(gt=0)
    kv_bytes_per_element: float = Field(gt=0)

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_weight

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token over every layer (the whole model, all ranks)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element


class GPUSpec(_Strict):
    name: str
    peak_flops: float = Field(gt=0, description="dense bf16 FLOP/s")
    memory_bandwidth: float = Field(gt=0, description="bytes/s")
    memory_bytes: int = Field(ge=1)


class Efficiency(_Strict):
    flops: float = Field(gt=0, le=1, description="share of peak FLOP/s reached (prefill)")
    bandwidth: float = Field(gt=0, le=1, description="share of peak bandwidth reached (decode)")
    step_overhead_s: float = Field(ge=0, description="fixed cost of every step")


class SimProfile(_Strict):
    name: str
    model: SimModelSpec
    gpu: GPUSpec
    tensor_parallel_size: int = Field(ge=1)
    gpu_memory_utilization: float = Field(gt=0, le=1)
    reserved_bytes: int = Field(ge=0, description="per GPU: activations, CUDA context, graphs")
    efficiency: Efficiency

    @classmethod
    def load(cls, name_or_path: str) -> SimProfile:
        """A shipped profile by name (`llama3-8b-h100`) or a JSON file's path. ValueError naming the
        profile and what is wrong (unknown name, unknown or missing key, bad value)."""
        path = Path(name_or_path)
        if not path.suffix:
            path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ValueError(f"sim profile {name_or_path!r}: no such file; shipped: {', '.join(shipped())}")
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except (ValidationError, json.JSONDecodeError) as e:
            raise ValueError(f"sim profile {path}: {e}") from None

    @property
    def digest(self) -> str:
        """Names this profile's numbers in the KV preflight (two sims of different profiles differ)."""
        return "sim:" + hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks one GPU holds: gpu_memory_utilization of its memory, less its share of the weights
        and the reserve, over its share of a block (each rank holds num_kv_heads / tp of every block)."""
        tp = self.tensor_parallel_size
        budget = self.gpu_memory_utilization * self.gpu.memory_bytes
        budget -= self.model.weight_bytes / tp + self.reserved_bytes
        per_block = self.model.kv_bytes_per_token / tp * block_size
        blocks = int(budget // per_block)
        if blocks < 1:
            raise ValueError(f"sim profile {self.name}: the weights leave no GPU memory for the KV cache")
        return blocks


def shipped() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def step_flops(model: SimModelSpec, rows: Iterable[tuple[int, int]]) -> float:
    """FLOPs of a step whose rows are (new tokens n, tokens already cached c): the matmuls over every
    parameter for each new token, and causal attention (QK^T and PV) over c + i + 1 keys for the i-th."""
    attn = 4 * model.num_layers * model.num_heads * model.head_dim
    return sum(2 * model.num_params * n + attn * (n * c + n * (n + 1) / 2) for n, c in rows)


def step_bytes(model: SimModelSpec, rows: Iterable[tuple[int, int]]) -> float:
    """Bytes a step moves through GPU memory: every weight once, each row's KV read and written."""
    return model.weight_bytes + sum(model.kv_bytes_per_token * (c + n) for n, c in rows)


def step_seconds(profile: SimProfile, rows: list[tuple[int, int]]) -> float:
    """The roofline time of one step (module doc); 0 for an empty step."""
    if not rows:
        return 0.0
    tp, gpu, eff = profile.tensor_parallel_size, profile.gpu, profile.efficiency
    compute = step_flops(profile.model, rows) / (tp * gpu.peak_flops * eff.flops)
    memory = step_bytes(profile.model, rows) / (tp * gpu.memory_bandwidth * eff.bandwidth)
    return max(compute, memory) + eff.step_overhead_s
