"""A request inside an engine: its tokens, its KV blocks, and how far its KV has been computed."""

from __future__ import annotations

import itertools
from enum import Enum
from typing import TYPE_CHECKING

from common.engine.api import RemoteKV
from common.sampling_params import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from common.text.grammar import GrammarMatcher


class SequenceStatus(Enum):
    WAITING = "waiting"  # queued, or preempted by recompute (holds no blocks)
    RUNNING = "running"  # holds blocks, scheduled every step
    SWAPPED = "swapped"  # preempted by swap: its KV sits in host memory
    PARKED = "parked"  # holds blocks, not scheduled: a KV transfer writes (receive) or reads (send) them
    FINISHED = "finished"


class Sequence:
    _ids = itertools.count()

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        *,
        seq_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        remote_kv: RemoteKV | None = None,
        tenant: str = "",
        cache_root: int = -1,
    ) -> None:
        assert token_ids, "a sequence needs at least one prompt token"
        self.seq_id = seq_id if seq_id is not None else str(next(Sequence._ids))
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.priority = priority  # lower runs first
        self.tenant = tenant  # whose request: the fair policy shares the engine between tenants ("" too)
        self.cache_root = cache_root  # prefix-cache chain root of its cache salt (common/prefix_hash.py)
        self.arrival_time = arrival_time
        self.arrival_order = 0  # set by the scheduler: breaks ties between equal arrival times
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.group_tables: list[list[int]] = []  # layer groups 1.. (common/kv/layer_groups.py)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, found in the prefix cache at admission
        self.num_hashed_blocks = 0
        # KV received window-only: kept out of the prefix cache (scheduler; not with layer groups)
        self.kv_partial = False
        self.num_swapped_blocks = 0  # blocks of KV held in host memory while SWAPPED
        self.swap_width = 0  # its block table's length when swapped out (holes and all)
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # token positions billed to the tenant (common/engine/scheduler.py): each position once, however
        # often it is computed (a prefill chunk, a recompute after preemption)
        self.num_charged_tokens = 0
        self.remote_kv = remote_kv  # the prompt's KV comes from ("receive") or goes to ("send") elsewhere
        self.grammar: GrammarMatcher | None = None  # structured output: advanced over every output token
        # params.prompt_logprobs: one entry per prompt token computed so far (None for the first)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        # the offload tiers' prefetch started on its arrival: the keys it brings from the disk into RAM,
        # and until when (the scheduler's clock) its admission may wait for them while others run
        self.prefetch_keys: list[int] | None = None
        self.prefetch_deadline = 0.0

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
