"""Iteration-level (continuous-batching) scheduler. Plain Python: no torch, no I/O.

Every step re-decides the batch (Orca). Order of work within one step's token budget (Sarathi):
  1. running sequences that decode (one token each), then running prefills, chunked to the budget;
     a sequence that needs a new KV block and finds none preempts the least urgent running one
  2. sequences swapped out to host memory come back before anything new is admitted
  3. waiting sequences are admitted while KV blocks, `max_num_seqs` and the budget allow
Policies: `fcfs` (arrival order) and `priority` (lower value first, aged so nothing starves). The
static-batching baseline is its own scheduler (common/engine/static_batching.py).

Remote KV: a decode service's request waits in `reserving` until its prompt's blocks can be reserved,
then sits in `parked` (holding them, never scheduled) until `kv_arrived`. A prefill service's request
that finished while its KV is still being sent keeps its blocks in `parked` too, until the engine
finishes it again once the transfer let go (`holds_blocks`, asked of the KV connector).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from common.engine.sequence import Sequence, SequenceStatus
from common.kv.block_manager import BlockManager

log = logging.getLogger("splitserve.scheduler")

Policy = Literal["fcfs", "priority", "static"]
PreemptionMode = Literal["auto", "swap", "recompute"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # per-step token budget (decode tokens + prefill chunks)
    policy: Policy = "fcfs"
    preemption_mode: PreemptionMode = "auto"
    num_swap_blocks: int = 0  # host-memory blocks available to swapped-out sequences
    aging_s: float = 1.0  # priority policy: waiting this long gains one priority level
    # Cost model for choosing swap or recompute (seconds). Defaults are CPU-ish; the engine
    # passes measured figures.
    swap_s_per_block: float = 2e-5  # copy one block out (and again back in)
    recompute_s_per_token: float = 2e-4  # prefill one token again

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens) in step order
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # copy these blocks out first
    swap_in: list[Sequence] = field(default_factory=list)  # then copy saved KV into seq.block_table
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # got blocks this step (incl. reservations)
    # static baseline only: finished members still computed (their last token again), nothing sampled
    padding: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: tuple[int, ...] = (),
        clock: Callable[[], float] = time.monotonic,
        holds_blocks: Callable[[Sequence], bool] = lambda seq: False,
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.holds_blocks = holds_blocks  # does a KV transfer still use this finished sequence's blocks?
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.reserving: deque[Sequence] = deque()  # remote_kv="receive": waiting for a block reservation
        self.parked: dict[str, Sequence] = {}  # holding blocks, never scheduled (see the module doc)
        self.swap_blocks_used = 0
        self.stats: Counter[str] = Counter()
        self._arrivals = 0  # tie-break for equal arrival times: order of add()

    # --- queue ------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue seq; one whose prompt KV another service writes (remote_kv="receive") needs a reservation
        first."""
        seq.status = SequenceStatus.WAITING
        if seq.arrival_time is None:
            seq.arrival_time = self.clock()
        self._arrivals += 1
        seq.arrival_order = self._arrivals
        (self.reserving if seq.remote_kv == "receive" else self.waiting).append(seq)

    def has_work(self) -> bool:
        """Anything a step would do (parked sequences wait for a transfer, not for a step)."""
        return bool(self.waiting or self.running or self.swapped or self.reserving)

    @property
    def num_active(self) -> int:
        """Sequences counted against max_num_seqs: running, and reservations waiting for their KV."""
        return len(self.running) + sum(s.status is SequenceStatus.PARKED for s in self.parked.values())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.reserving)

    def queue_wait_s(self) -> float:
        """How long the longest-waiting queued sequence has waited (0 with an empty queue): the
        queue's sojourn time, which routers compare with how soon a new request must start. Safe to
        call from another thread (a queue changing meanwhile reads as 0)."""
        try:
            arrivals = [s.arrival_time for q in (self.waiting, self.reserving) for s in q]
        except RuntimeError:  # a deque mutated during the copy
            return 0.0
        known = [a for a in arrivals if a is not None]
        return max(0.0, self.clock() - min(known)) if known else 0.0

    def _effective_priority(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        """Sort key, most urgent first. Aging: each `aging_s` of waiting is worth one priority level."""
        arrival = seq.arrival_time or 0.0
        prio = (
            seq.priority - (now - arrival) / self.config.aging_s if self.config.policy == "priority" else 0.0
        )
        return (prio, arrival, seq.arrival_order)

    # --- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bs = self.bm.block_size
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            while len(seq.token_ids) > len(seq.block_table) * bs and not self.bm.can_append(seq):
                budget += self._preempt(self._pick_victim(), out)
                if seq.status is not SequenceStatus.RUNNING:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.bm.append_slots(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append((seq, n))
            budget -= n
        if out.preempted:
            return out  # memory is short: admit nothing new this step
        self._reserve(out)
        budget = self._swap_in(out, budget)
        self._admit(out, budget)
        return out

    def _reserve(self, out: SchedulerOutput) -> None:
        """Admission control for remote prefill: reserve the prompt's blocks, in arrival order."""
        while self.reserving and self.num_active < self.config.max_num_seqs:
            seq = self.reserving[0]
            if not self.bm.can_allocate(seq):
                break
            self.reserving.popleft()
            self.bm.allocate(seq)
            seq.status = SequenceStatus.PARKED
            self.parked[seq.seq_id] = seq
            out.admitted.append(seq)

    def kv_arrived(self, seq: Sequence, first_token: int) -> str | None:
        """The prefill service wrote every layer of the prompt and sampled the first token: the
        sequence joins the running batch at the next step. Returns a finish reason if that token
        already ends it."""
        assert seq.status is SequenceStatus.PARKED, f"{seq.seq_id} holds no reservation ({seq.status})"
        del self.parked[seq.seq_id]
        seq.num_computed_tokens = seq.num_tokens
        self.bm.commit(seq, seq.num_computed_tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        seq.append_token(first_token)
        reason = self._stop_reason(seq, first_token)
        if reason:
            self.finish(seq, reason)
        return reason

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and self.num_active < self.config.max_num_seqs:
            seq = self.swapped[0]
            if self.bm.blocks_needed(seq.num_tokens) > self.bm.num_free_blocks:
                break
            self.swapped.popleft()
            self.bm.allocate(seq, use_prefix_cache=False)
            self.swap_blocks_used -= seq.num_swapped_blocks
            seq.num_swapped_blocks = 0
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.swap_in.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append((seq, n))
            budget -= n
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        if self.swapped or not self.waiting:
            return  # swapped sequences come back first
        queue: list[Sequence] | deque[Sequence] = self.waiting
        if self.config.policy == "priority":
            now = self.clock()
            queue = sorted(self.waiting, key=lambda s: self._effective_priority(s, now))
        admitted: list[Sequence] = []
        for seq in queue:
            if budget == 0 or self.num_active >= self.config.max_num_seqs:
                break
            # prompt logprobs need every prompt row computed: no prefix-cache hits for such a request
            cache = seq.prompt_logprobs is None
            if not self.bm.can_allocate(seq, use_prefix_cache=cache):
                break  # head-of-line blocking on purpose: skipping ahead would starve long prompts
            self.bm.allocate(seq, use_prefix_cache=cache)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            out.admitted.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append((seq, n))
            budget -= n
        if self.config.policy == "priority":
            taken = {id(s) for s in admitted}
            self.waiting = deque(s for s in self.waiting if id(s) not in taken)
        else:
            for _ in admitted:
                self.waiting.popleft()

    # --- preemption -------------------------------------------------------------------------------
    def _pick_victim(self) -> Sequence:
        now = self.clock()
        return max(self.running, key=lambda s: self._effective_priority(s, now))

    def _preemption_kind(self, seq: Sequence) -> str:
        cfg, n_blocks = self.config, len(seq.block_table)
        fits = self.swap_blocks_used + n_blocks <= cfg.num_swap_blocks
        if cfg.preemption_mode == "recompute":
            return "recompute"
        if cfg.preemption_mode == "swap":
            if not fits:
                self.stats["swap_refused_no_host_space"] += 1
            return "swap" if fits else "recompute"
        swap_cost = 2 * n_blocks * cfg.swap_s_per_block
        recompute_cost = seq.num_computed_tokens * cfg.recompute_s_per_token
        return "swap" if fits and swap_cost < recompute_cost else "recompute"

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Take seq off the running batch; returns budget given back if it was already scheduled."""
        refund = 0
        for i, (s, n) in enumerate(out.scheduled):
            if s is seq:
                del out.scheduled[i]
                refund = n
                break
        kind = self._preemption_kind(seq)
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.stats[f"preempt_{kind}"] += 1
        out.preempted.append(seq)
        if kind == "swap":
            out.swap_out.append((seq, list(seq.block_table)))
            seq.num_swapped_blocks = len(seq.block_table)
            self.swap_blocks_used += seq.num_swapped_blocks
            self.bm.free(seq)  # its block table is empty while it is out: fresh blocks on swap-in
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)  # first in line to come back
        return refund

    # --- after the model ran ----------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish sequences; returns those finished."""
        finished: list[Sequence] = []
        for (seq, n), tok in zip(out.scheduled, sampled, strict=True):
            seq.num_computed_tokens += n
            self.bm.commit(seq, seq.num_computed_tokens)
            if tok is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            seq.append_token(tok)
            reason = self._stop_reason(seq, tok)
            if reason:
                self.finish(seq, reason)
                finished.append(seq)
        self.stats["steps"] += 1
        return finished

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        """Why seq ends with the token it just appended (None: it goes on). Called once per output
        token: it also advances the sequence's grammar."""
        p = seq.params
        if seq.grammar is not None:
            if not seq.grammar.accept(tok):  # the sampler masks what the grammar refuses: a bug if reached
                log.error("request %s: token %d refused by its grammar; ending it", seq.seq_id, tok)
                return "stop"
            if seq.grammar.is_finished:
                return "stop"
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        if seq.num_output_tokens <= p.min_tokens:
            return None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        return None

    # --- the end of a sequence ------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq (stop, length, abort, ...) wherever it is. Its blocks are freed, unless a KV transfer
        still uses them (`holds_blocks`): then they stay parked with it until finish() is called again,
        once the transfer let go. The one way a sequence ends and the one way its blocks go back."""
        if seq.status is not SequenceStatus.FINISHED:
            seq.finish_reason = reason
            self._leave(seq)
            seq.status = SequenceStatus.FINISHED
        if seq.block_table and self.holds_blocks(seq):
            self.parked[seq.seq_id] = seq
            return
        self.parked.pop(seq.seq_id, None)
        if seq.block_table:
            self.bm.free(seq)

    def _leave(self, seq: Sequence) -> None:
        """Take a live seq out of whichever queue holds it (its blocks stay with it)."""
        status = seq.status
        if status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif status is SequenceStatus.PARKED:
            del self.parked[seq.seq_id]
        elif status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap_blocks_used -= seq.num_swapped_blocks
            seq.num_swapped_blocks = 0
        elif status is SequenceStatus.WAITING:
            (self.reserving if seq in self.reserving else self.waiting).remove(seq)
