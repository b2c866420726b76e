"""What crosses the engine's boundary: typed commands in, one `StepResult` out per step, and the
engine's load as one `EngineLoad` value.

A service never reaches into the engine: it submits commands (run on the engine thread between two
steps), reads what each step did from its result, and reads how loaded the engine is from the last
`EngineLoad` the engine thread published. Nothing else about a request leaves the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from common.sampling_params import SamplingParams, TokenLogprob

RemoteKV = Literal["receive", "send"]
"""How a request's KV relates to another service: "receive" (decode service: reserve blocks for the
prompt and wait until a prefill service has written them), "send" (prefill service: the KV connector
streams the prompt's KV out layer by layer and holds its blocks until the transfer let go)."""


# --- commands ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first (priority policy)
    remote_kv: RemoteKV | None = None
    num_output_tokens: int = 0  # the last n of token_ids are output already (a migrated request)
    tenant: str = ""  # whose request (fair policy: tenants share the engine by weight; "" is one too)
    cache_salt: str = ""  # prefix-cache namespace (common/prefix_hash.py cache_root); "" is the shared one


@dataclass(frozen=True)
class KVArrived:
    """Decode service: a prefill service wrote every layer of the prompt and sampled token 0; the
    request joins the running batch at the next step (token 0 is not output again: the router has it)."""

    request_id: str
    first_token: int


@dataclass(frozen=True)
class Finish:
    """End the request wherever it is, with this reason; its blocks are freed as soon as no KV transfer
    holds them (the connector says). Finishing an ended request frees blocks a transfer held; an
    unknown id is a no-op."""

    request_id: str
    reason: str


Command = AddRequest | KVArrived | Finish


# --- results ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    """The request got its KV blocks this step: a reservation (remote_kv="receive"), or admission to
    compute its prompt here."""

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    # layer groups 1.. (common/kv/layer_groups.py): their block tables, as long as block_ids
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class TokenOutput:
    """New output tokens of one request; `index` is the output position of token_ids[0]. The request's
    last output has a finish_reason, and may have no token (token 0 from a prefill service ended it)."""

    request_id: str
    token_ids: list[int]
    index: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when params.logprobs asks
    # when params.prompt_logprobs asks: on the request's first output, one per prompt token (None first)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepResult:
    admitted: list[Admission] = field(default_factory=list)
    outputs: list[TokenOutput] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_scheduled: int = 0  # sequences whose tokens the step computed
    num_padding: int = 0  # of those, finished members a static batch still computes (baseline only)
    num_tokens: int = 0  # tokens the step computed

    @property
    def finished(self) -> list[TokenOutput]:
        return [o for o in self.outputs if o.finished]

    @property
    def is_empty(self) -> bool:
        return not (self.admitted or self.outputs or self.preempted or self.num_scheduled)


@dataclass(frozen=True)
class EngineLoad:
    """How loaded the engine is, as of its last step or command: the figures a service publishes (/health,
    the registry heartbeat, /metrics). Built by the engine thread (`LLMEngine.load`) and handed over
    whole; a reader never sees one half old and half new."""

    running: int = 0  # counted against max_num_seqs: running, and reservations waiting for their KV
    parked: int = 0  # of `running`, the reservations still waiting for their KV (nothing generated yet)
    waiting: int = 0  # queued: waiting for KV blocks, or for a reservation
    queued_tokens: int = 0  # tokens of the queued requests: the prompt work ahead of a new one
    oldest_arrival: float | None = None  # time.monotonic() the longest-queued request arrived; None: empty
    free_blocks: int = 0  # free KV blocks, evictable cached ones included
    total_blocks: int = 0
    pages_per_block: int = 1  # with layer groups the blocks above are pages, this many to a block of tokens
    prefill_tps: float = 0.0  # recent steps' speed (common/engine/speed.py), 0 until measured
    long_prefill_tps: float = 0.0  # the same over steps of long prompts only (a block's recompute cost)
    decode_step_ms: float = 0.0
    # a prompt step's ms as prefill_step_ms + prefill_ms_per_token x its tokens (speed.py), 0 until
    # fitted; step_tokens: the most tokens one step computes (max_num_batched_tokens)
    prefill_step_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    step_tokens: int = 0
    # a decode-only step's ms as decode_step_fixed_ms + decode_ms_per_seq x its sequences, 0 until fitted
    decode_step_fixed_ms: float = 0.0
    decode_ms_per_seq: float = 0.0
    preempted_swap: int = 0  # preemptions since start, by kind
    preempted_recompute: int = 0
    prefix_queries: int = 0  # full prompt blocks looked up in the prefix cache since start, and found
    prefix_hits: int = 0
    tier_hits: int = 0  # prompt blocks the offload tiers read back at admission since start (not pages)
    kv_clamped: int = 0  # fp8 KV values saturated to the format's range since start (read once a second)

    def queue_wait_s(self, now: float) -> float:
        """How long the longest-queued request has waited at `now` (time.monotonic()): the queue's sojourn
        time, which keeps growing while a long step runs. 0 with an empty queue."""
        return 0.0 if self.oldest_arrival is None else max(0.0, now - self.oldest_arrival)
