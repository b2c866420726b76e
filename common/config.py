"""Typed, frozen settings. Flags and SPLITSERVE_* environment variables fill them at start-up;
values discovered at start-up (the KV block count) are computed once and passed explicitly."""

from __future__ import annotations

import socket
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class EngineConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SPLITSERVE_", frozen=True, extra="forbid", env_ignore_empty=True
    )

    model: str | None = Field(None, description="GGUF file or safetensors folder; default SmolLM2-135M")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when a GPU is visible")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 on a GPU, float32 on the CPU"
    )
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="auto: the Triton kernels on a GPU, the torch reference on the CPU"
    )
    block_size: int = Field(16, ge=1, description="tokens per KV cache block")
    kv_cache_memory_mb: int | None = Field(
        None, ge=1, description="paged KV cache size; default 512 on the CPU, from free memory on a GPU"
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="overrides kv_cache_memory_mb")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU: share of the card's memory for weights, activations and KV"
    )
    cuda_graphs: bool = Field(True, description="GPU: replay decode-only steps from captured CUDA graphs")
    swap_space_mb: int = Field(256, ge=0, description="host memory for swapped-out sequences")
    max_num_seqs: int = Field(16, ge=1, description="sequences running in one batch at most")
    max_num_batched_tokens: int = Field(512, ge=1, description="per-step token budget")
    max_model_len: int | None = Field(None, ge=1, description="default: the model's context length")
    policy: Literal["fcfs", "priority", "fair", "static"] = Field(
        "fcfs", description="fair: tenants share the engine by weight (deficit round robin)"
    )
    preemption_mode: Literal["auto", "swap", "recompute"] = Field(
        "auto",
        description="a preempted sequence's KV: swapped to host memory or recomputed (auto: whichever is "
        "estimated cheaper, swap only if the host space fits)",
    )
    aging_s: float = Field(1.0, gt=0, description="priority, fair: each this long waited is one level up")
    tenant_weights: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default_factory=dict,
        description='fair: tenant -> weight, JSON in the environment ({"a": 3, "b": 1}); others weigh 1',
    )
    fair_quantum_tokens: int | None = Field(
        None, ge=1, description="fair: tokens of credit per round at weight 1; default max_num_batched_tokens"
    )
    fair_bulk_prefill_tokens: int | None = Field(
        None,
        ge=1,
        description="fair: prefill tokens per step beside a just-arrived tenant's request (which goes "
        "whole); default max_num_batched_tokens (small: a sparse tenant's request waits less for a step)",
    )
    fair_burst_s: float = Field(
        2.0,
        ge=0,
        allow_inf_nan=False,
        description="fair: a tenant that left part of its share of the batch unused with nothing queued "
        "may run over its share later, up to this many seconds of the whole batch (0: never)",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="what the KV cache stores: auto (the model dtype), a narrower float, or fp8 with a "
        "calibrated power-of-two scale per layer and KV head",
    )
    kv_exact_prefill: bool = Field(
        True,
        description="fp8 KV: a prefill chunk attends to its own keys and values as computed, only earlier "
        "ones through the cache (a prompt's first token as with bf16 KV); off: every read through the "
        "cache, as decode reads, so a prefix hit computes exactly what a miss does",
    )
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of a prefix already held")
    kv_offload_ram_gb: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="host RAM for prefix-cache KV blocks evicted from the KV cache, read back on a later "
        "hit instead of recomputed (0: off)",
    )
    kv_offload_disk_dir: str | None = Field(
        None,
        description="a folder for the disk tier of evicted KV blocks (blocks evicted twice; each service "
        "takes a slot-N folder of its own, emptied at start); none: off",
    )
    kv_offload_disk_gb: float = Field(
        16.0, gt=0, allow_inf_nan=False, description="the disk tier's size limit, per service"
    )
    kv_offload_prefetch_wait_s: float = Field(
        5.0,
        ge=0,
        allow_inf_nan=False,
        description="how long a request may wait, while others run, for the offload tiers to bring its "
        "blocks from the disk into RAM before it is admitted (its admission then reads RAM; reading the "
        "disk at admission would stall every running request's step); 0: never wait",
    )
    kv_offload_disk_reads: Literal["auto", "always"] = Field(
        "auto",
        description="auto: a disk tier hit is read only while the disk's recent read cost per block is "
        "below recomputing the block at this engine's prefill speed (a slow or throttled disk is then "
        "left alone and the prompt computed); always: read every disk hit",
    )
    kv_offload_load: Literal["auto", "layerwise", "inline", "whole"] = Field(
        "auto",
        description="how a tier hit's blocks go into the KV cache: layerwise (each layer copied while the "
        "layers before it compute: a copy stream on a GPU, a copy thread on a CPU), inline (each layer just "
        "before it is read, no overlap), whole (all of it before the step); auto: layerwise on a GPU, whole "
        "on a CPU, where the copies compete with the step for the same cores (bench tier-load)",
    )
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads; default all cores")
    engine: Literal["torch", "sim"] = Field(
        "torch",
        description="sim: the real scheduler, KV accounting and services with the forward replaced by a "
        "sleep of the step's roofline time on --sim-profile's hardware, and tokens drawn deterministically "
        "(docs/simulation.md)",
    )
    sim_profile: str = Field(
        "llama3-8b-h100",
        description="engine=sim: a shipped profile (llama3-8b-h100, llama3-8b-h200, llama3-70b-h100-tp4, "
        "llama3-70b-h200-tp2) or a profile JSON file",
    )
    sim_kv_block_bytes: int = Field(
        1024, ge=64, description="engine=sim: bytes of one block of the real KV pool the transfers move"
    )
    sim_seed: int = Field(0, description="engine=sim: the token draw's seed (a request's own seed wins)")
    sim_output_len: int | None = Field(
        None, ge=1, description="engine=sim: the n-th output token is EOS; default never (max_tokens ends)"
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks the model is sharded over (Megatron-style, one process each, rank 0 the engine's; "
        "CPU/gloo only; in a service each rank moves its own KV heads, prefill and decode may differ); each "
        "rank uses num_threads, default cores // tensor_parallel_size",
    )

    @model_validator(mode="after")
    def _sim_fields_need_sim(self) -> EngineConfig:
        """A sim_* setting on the torch engine would be ignored: an error instead."""
        given = sorted(f for f in self.model_fields_set if f.startswith("sim_"))
        if given and self.engine != "sim":
            raise ValueError(f"{', '.join(given)} only apply with engine=sim")
        return self


def http_url(host: str, port: int, tls: bool) -> str:
    """`http(s)://host:port`, an IPv6 address in brackets."""
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


def resolve_advertise_host(v: str | None) -> str | None:
    """An advertise_host setting: 'auto' becomes the address this machine's hostname resolves to (a
    container's own IP); ValueError when it does not resolve."""
    if v != "auto":
        return v
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        msg = f"advertise_host=auto: this machine's hostname {name!r} does not resolve ({e})"
        raise ValueError(msg) from e


class ServiceConfig(BaseSettings):
    """A prefill or decode service process: where it listens and whom it tells."""

    model_config = SettingsConfigDict(
        env_prefix="SPLITSERVE_", frozen=True, extra="ignore", env_ignore_empty=True
    )

    role: Literal["prefill", "decode"]
    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8100, ge=0, le=65535, description="the internal HTTP API's port")
    advertise_host: str | None = Field(
        None,
        description="the address other processes reach this one at, registered in Redis (service URL, "
        "KV endpoint); default: host. Set it when host is 0.0.0.0 (containers: service name or pod IP); "
        "'auto': the address this machine's hostname resolves to (a container's own IP: replicas of one "
        "compose service each register themselves)",
    )
    worker_id: str | None = Field(None, description="default: <role>-<advertised host>-<port>")
    redis_url: str | None = Field(None, description="worker registry and request records; none: standalone")
    kv_backend: Literal["auto", "nixl", "tcp", "torch_dist"] = Field(
        "auto",
        description="decode: how prefill services write KV here; auto = nixl where it imports, else tcp",
    )
    kv_port: int = Field(0, ge=0, le=65535, description="decode: KV receiver port (0: any free port)")
    max_queue: int = Field(256, ge=1, description="requests waiting for KV blocks before new ones get 503")
    served_model_name: str | None = Field(
        None, description="the model name this service registers (what the router serves it as)"
    )
    heartbeat_s: float = Field(1.0, gt=0)
    lease_s: float = Field(
        5.0, gt=0, description="transfer-ledger lease TTL: a silent peer's blocks are freed after it"
    )
    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="SIGTERM: requests in progress get this long to finish; the rest are ended (the "
        "router migrates them) and the process exits 0",
    )

    ssl_certfile: str | None = Field(None, description="serve the internal HTTP API over HTTPS (PEM chain)")
    ssl_keyfile: str | None = Field(None, description="the private key for ssl_certfile")

    @field_validator("advertise_host")
    @classmethod
    def _resolve_auto(cls, v: str | None) -> str | None:
        return resolve_advertise_host(v)

    @property
    def public_host(self) -> str:
        """The host other processes reach this one at."""
        return self.advertise_host or self.host

    @property
    def url(self) -> str:
        return http_url(self.public_host, self.port, bool(self.ssl_certfile))

    @property
    def worker_name(self) -> str:
        return self.worker_id or f"{self.role}-{self.public_host}-{self.port}"
