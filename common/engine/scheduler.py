"""Iteration-level (continuous-batching) scheduler. Plain Python: no torch, no I/O.

Every step re-decides the batch (Orca). Order of work within one step's token budget (Sarathi):
  1. running sequences that decode (one token each), then (fair) the first request of a tenant that
     just arrived, then running prefills, chunked to the budget; a sequence that needs a new KV block
     and finds none preempts the least urgent running one
  2. sequences swapped out to host memory come back before anything new is admitted
  3. waiting sequences are admitted while KV blocks, `max_num_seqs` and the budget allow
Policies: `fcfs` (arrival order), `priority` (lower value first, aged so nothing starves) and `fair`
(below). The static-batching baseline is its own scheduler (common/engine/static_batching.py).

Tenant fair share (`fair`): admission is deficit round robin over tenants (Sequence.tenant; "" is one
too). Tenants with queued work form a round (one whose request arrives to an empty queue joins at the
head with one quantum: `_join`); the tenant at its head with no credit left (deficit <= 0) is credited
`fair_quantum_tokens * weight` and the turn passes; one with credit has its most urgent sequence
admitted (priority, aged as in `priority`; recompute-preempted sequences first) and keeps the turn while
its credit lasts. A newcomer's first request goes into the next step whole, ahead of other prefill work;
with `fair_bulk_prefill_tokens`, all other prefill tokens of a step are bounded by it (0 in a step where
a newcomer starts), so a flooding tenant's steps stay short. Credit is spent on tokens served: the
prompt positions an admission computes (prefix-cache hits are free, a recompute after preemption is the
engine's cost), then one per decode step; an admission may overdraw it, later credit pays the debt. A
tenant whose queue empties leaves the round and loses its credit: nothing is banked while idle. Rounds
in which nobody could be served are skipped in one go, so a deep debt never leaves capacity idle.
Decode-side reservations (`reserving`) follow the same round and credit. With every batch slot taken, a
queued tenant under its share of `max_num_seqs` starts in place of the least urgent sequence of the
tenant furthest over its own (recomputed: `_make_room`). A light tenant (asking RECENT_RATIO times fewer
tokens lately than another) may take a slot from it while that one runs as many sequences, and that one
never takes the light one's slots (`_may_take`). A tenant that left part of its share unused with nothing
queued earns a burst allowance (slot-seconds, capped at `fair_burst_s` of the whole batch; `_accrue`): it
may run over its share at the expense of a tenant without one, which does not take those slots back
until the allowance is spent, so a sparse tenant's few overlapping requests all start at once even
when a flood has just begun (its demand is not yet far below the flood's). Out of KV blocks,
preemption takes its victim from the tenant holding the most KV blocks per unit of weight (the one
furthest over its share of the cache), least urgent first. `tenant_served` counts each tenant's billed
tokens under every policy.

Remote KV: a decode service's request waits in `reserving` until its prompt's blocks can be reserved,
then sits in `parked` (holding them, never scheduled) until `kv_arrived`. A prefill service's request
that finished while its KV is still being sent keeps its blocks in `parked` too, until the engine
finishes it again once the transfer let go (`holds_blocks`, asked of the KV connector).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from common.engine.sequence import Sequence, SequenceStatus
from common.kv.block_manager import BlockManager

log = logging.getLogger("splitserve.scheduler")
RECENT_HALF_LIFE_S = 5.0  # fair: how fast tokens asked for stop counting as recent (_may_take)
RECENT_RATIO = 4.0  # fair: asking this many times less lately, a tenant may take a slot (_may_take)
# fair: a tenant with nothing running or queued for this long is forgotten (its demand and burst
# allowance; _forget_idle): it comes back as a new tenant, and the scheduler's state and the work of
# each step stay bounded by the tenants seen lately, not every tenant ever seen
FORGET_TENANT_S = 600.0

Policy = Literal["fcfs", "priority", "fair", "static"]
PreemptionMode = Literal["auto", "swap", "recompute"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # per-step token budget (decode tokens + prefill chunks)
    policy: Policy = "fcfs"
    preemption_mode: PreemptionMode = "auto"
    num_swap_blocks: int = 0  # host-memory blocks available to swapped-out sequences
    aging_s: float = 1.0  # priority, fair: waiting this long gains one priority level
    # fair: tenant -> weight (a tenant not named weighs 1.0); the credit a weight-1 tenant gets per
    # round, in tokens (None: max_num_batched_tokens)
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    fair_quantum_tokens: int | None = None
    # fair: prefill tokens per step, all together, beside the request of a tenant that just arrived to
    # an empty queue, which goes whole (None: the step budget). A small figure keeps the steps a
    # flooding tenant fills short, so a sparse tenant's request that arrives during one soon starts.
    fair_bulk_prefill_tokens: int | None = None
    # fair: a tenant that leaves part of its share of max_num_seqs unused while it has nothing queued
    # earns slot time to run over its share later, up to this many seconds of the whole batch (see
    # `_accrue`; 0: never): a sparse tenant's few overlapping requests are not held to its share.
    fair_burst_s: float = 2.0
    # Cost model for choosing swap or recompute (seconds). Defaults are CPU-ish; the engine
    # passes measured figures.
    swap_s_per_block: float = 2e-5  # copy one block out (and again back in)
    recompute_s_per_token: float = 2e-4  # prefill one token again

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.fair_quantum_tokens is not None and self.fair_quantum_tokens < 1:
            raise ValueError("fair_quantum_tokens must be positive")
        if self.fair_bulk_prefill_tokens is not None and self.fair_bulk_prefill_tokens < 1:
            raise ValueError("fair_bulk_prefill_tokens must be positive")
        if not (math.isfinite(self.fair_burst_s) and self.fair_burst_s >= 0):
            raise ValueError("fair_burst_s must be a finite number of seconds, 0 or more")
        bad = {t: w for t, w in self.tenant_weights.items() if not (math.isfinite(w) and w > 0)}
        if bad:
            raise ValueError(f"tenant weights must be positive and finite: {bad}")
        # a copy: the caller's dict may change, this config does not
        object.__setattr__(self, "tenant_weights", dict(self.tenant_weights))

    @property
    def quantum(self) -> int:
        """fair: tokens of credit per round for a tenant of weight 1."""
        return self.fair_quantum_tokens or self.max_num_batched_tokens

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)


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
        self.tenant_served: Counter[str] = Counter()  # tokens billed to each tenant (see _charge)
        # fair: the round of tenants with queued work ([0] has the turn) and each one's credit in tokens
        self._rr: deque[str] = deque()
        self._fresh: set[str] = set()  # tenants that joined on arrival and have not had their turn yet
        self._deficit: dict[str, float] = {}
        # fair: tokens asked for per tenant lately (decayed; see _may_take) and when each was last updated
        self._recent: dict[str, float] = {}
        self._recent_at: dict[str, float] = {}
        self._bulk: int | None = None  # fair_bulk_prefill_tokens left in this step (None: no bound)
        # fair: slot-seconds each tenant may still run over its share of the batch, and when they were
        # last brought up to date (see _accrue)
        self._allowance: dict[str, float] = {}
        self._allowance_at: float | None = None
        self._active_at: dict[str, float] = {}  # fair: when each known tenant last held a slot or queued
        self._forgot_at = 0.0  # fair: when _forget_idle last looked

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
        self._join(seq.tenant, arriving=True)
        if self.config.policy == "fair" and seq.num_preemptions == 0:
            asked = seq.num_prompt_tokens + seq.params.max_tokens
            self._recent[seq.tenant] = self._recent_demand(seq.tenant) + asked
            self._allowance.setdefault(seq.tenant, 0.0)  # a tenant not seen before has none
            self._active_at[seq.tenant] = self.clock()

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

    def queued_tokens(self) -> int:
        """Tokens of the queued sequences (waiting and reserving): the prompt work ahead of a new
        request. Safe to call from another thread (a queue changing meanwhile is read again, or as 0)."""
        for _ in range(3):
            try:
                return sum(s.num_tokens for q in (self.waiting, self.reserving) for s in q)
            except RuntimeError:  # a deque mutated during the iteration
                continue
        return 0

    def _effective_priority(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        """Sort key, most urgent first. Aging: each `aging_s` of waiting is worth one priority level."""
        arrival = seq.arrival_time or 0.0
        aged = self.config.policy in ("priority", "fair")
        prio = seq.priority - (now - arrival) / self.config.aging_s if aged else 0.0
        return (prio, arrival, seq.arrival_order)

    # --- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        # fair: the first request of a tenant that just arrived to an empty queue (a sparse tenant)
        # goes into the step whole, ahead of other prefill work. With fair_bulk_prefill_tokens, all
        # other prefill tokens of a step are bounded by it, and wait a step where a newcomer starts.
        self._bulk = self.config.fair_bulk_prefill_tokens if self.config.policy == "fair" else None
        if self.config.policy == "fair":
            self._accrue()
        budget, short = self._run(decodes, out, budget)
        if self._fresh and not short:
            budget = self._admit(out, budget, newcomers=set(self._fresh))
            if out.admitted and self._bulk is not None:
                self._bulk = 0
        budget, short_too = self._run(prefills, out, budget)
        if short or short_too:
            return out  # memory is short: admit nothing new this step
        self._reserve(out)
        budget = self._swap_in(out, budget)
        self._admit(out, budget)
        return out

    def _run(self, seqs: list[Sequence], out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Schedule running sequences' next tokens (decode or prefill chunk) within the budget; one that
        needs a new KV block and finds none preempts the least urgent running sequence. Returns the
        budget left, and whether memory was short (something was preempted)."""
        preempted = len(out.preempted)
        bs = self.bm.block_size
        for seq in seqs:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            while len(seq.token_ids) > len(seq.block_table) * bs and not self.bm.can_append(seq):
                budget += self._preempt(self._pick_victim(), out)
                if seq.status is not SequenceStatus.RUNNING:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.bm.append_slots(seq)
            n = self._chunk(seq, budget)
            self._take(seq, n, out)
            budget -= n
        return budget, len(out.preempted) > preempted

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of seq's uncomputed tokens this step can take: the budget, and for a prefill
        fair_bulk_prefill_tokens (what is left of it this step)."""
        n = min(seq.num_uncomputed_tokens, budget)
        return min(n, self._bulk) if self._bulk is not None and seq.num_uncomputed_tokens > 1 else n

    def _take(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        if self._bulk is not None and seq.num_uncomputed_tokens > 1:
            self._bulk -= n
        out.scheduled.append((seq, n))

    def _reserve(self, out: SchedulerOutput) -> None:
        """Admission control for remote prefill: reserve the prompt's blocks, in arrival order (fair:
        in the tenants' round)."""
        taken: list[Sequence] = []
        order = self._admission_order(self.reserving, by_priority=False)
        while True:
            if self.num_active < self.config.max_num_seqs:
                seq = next(order, None)
            else:  # fair: as in _admit
                seq = self._starved_head(self.reserving, taken)
                if seq is not None and self._make_room(seq, out) is None:
                    break
            if seq is None or not self.bm.can_allocate(seq):
                break
            self.bm.allocate(seq)
            seq.status = SequenceStatus.PARKED
            self.parked[seq.seq_id] = seq
            out.admitted.append(seq)
            taken.append(seq)
            self._charge_admission(seq)
        self.reserving = _without(self.reserving, taken)

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

    def _admit(self, out: SchedulerOutput, budget: int, newcomers: set[str] | None = None) -> int:
        """Admit waiting sequences in the policy's order while the budget, the batch and the KV blocks
        allow. `newcomers` (fair): admit only the first sequence of each of these tenants, whole (no
        fair_bulk_prefill_tokens bound), and stop at any other. Returns the budget left."""
        if self.swapped or not self.waiting:
            return budget  # swapped sequences come back first
        taken: list[Sequence] = []
        order = self._admission_order(self.waiting, by_priority=True)
        while budget > 0:
            full = self.num_active >= self.config.max_num_seqs
            # fair, every batch slot taken: a tenant under its share may still start, in place of one
            # over its own
            seq = self._starved_head(self.waiting, taken) if full else next(order, None)
            if seq is None or (newcomers is not None and seq.tenant not in newcomers):
                break
            chunk = min(seq.num_tokens, budget) if newcomers is not None else self._chunk(seq, budget)
            if chunk == 0:
                break
            if full:
                refund = self._make_room(seq, out)
                if refund is None:
                    break
                budget += refund
            # prompt logprobs need every prompt row computed: no prefix-cache hits for such a request
            cache = seq.prompt_logprobs is None
            if not self.bm.can_allocate(seq, use_prefix_cache=cache):
                break  # head-of-line blocking on purpose: skipping ahead would starve long prompts
            self.bm.allocate(seq, use_prefix_cache=cache)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            taken.append(seq)
            out.admitted.append(seq)
            self._charge_admission(seq)
            if newcomers is not None:
                newcomers.discard(seq.tenant)
                n = min(seq.num_uncomputed_tokens, budget)
                out.scheduled.append((seq, n))
            else:
                n = self._chunk(seq, budget)
                self._take(seq, n, out)
            budget -= n
        self.waiting = _without(self.waiting, taken)
        return budget

    def _admission_order(self, queue: deque[Sequence], by_priority: bool) -> Iterator[Sequence]:
        """The order queue's sequences are offered in: fcfs, priority (when by_priority) or the fair
        round. The caller takes each one yielded, or stops: it must not skip one."""
        if self.config.policy == "fair":
            yield from self._fair_order(queue)
        elif by_priority and self.config.policy == "priority":
            now = self.clock()
            yield from sorted(queue, key=lambda s: self._effective_priority(s, now))
        else:
            yield from queue

    # --- tenant fair share (policy "fair"; see the module doc) ------------------------------------
    def _join(self, tenant: str, arriving: bool = False) -> None:
        """A tenant with newly queued work joins the round. One whose request just arrived (it had
        nothing queued: a sparse tenant) goes to the head with one quantum of credit, so its request is
        next, as new flows are in FQ-CoDel: a light tenant's first token does not wait for a heavy one's
        credit to run out. It gets that once per idle period; while it stays backlogged it takes its
        turns like any. Otherwise (a preempted sequence's tenant) it joins the end with no credit."""
        if self.config.policy == "fair" and tenant not in self._deficit:
            if arriving:  # behind the other new tenants still waiting for their first turn
                self._deficit[tenant] = self.config.quantum * self.config.weight(tenant)
                self._rr.insert(
                    sum(1 for _ in itertools.takewhile(self._fresh.__contains__, self._rr)), tenant
                )
                self._fresh.add(tenant)
            else:
                self._deficit[tenant] = 0.0
                self._rr.append(tenant)

    def _fair_order(self, queue: deque[Sequence]) -> Iterator[Sequence]:
        """queue's sequences in deficit-round-robin order over their tenants. Within a tenant:
        recompute-preempted sequences first (back to the front of the line), then by effective
        priority (aged), then arrival."""
        now = self.clock()
        groups: dict[str, deque[Sequence]] = {}

        def key(s: Sequence) -> tuple[bool, tuple[float, float, int]]:
            return (s.num_preemptions == 0, self._effective_priority(s, now))

        for s in sorted(queue, key=key):
            groups.setdefault(s.tenant, deque()).append(s)
        other = self.waiting if queue is self.reserving else self.reserving
        elsewhere = {s.tenant for s in other}
        while (head := self._fair_next(groups, elsewhere)) is not None:
            yield head
            groups[head.tenant].popleft()  # taken (the caller was charged for it before asking again)

    def _fair_next(self, groups: dict[str, deque[Sequence]], elsewhere: set[str]) -> Sequence | None:
        """The most urgent sequence of the tenant whose turn it is; None when groups is empty, or when
        the turn is with a tenant whose work waits in the other queue (`elsewhere`).

        At the head of the round: a tenant with no credit left (deficit <= 0) is credited quantum *
        weight and the turn passes (classic DRR); one with credit offers its head and keeps the turn (the
        caller charges it; the next call sees what is left). Both queues share the round: a pass stops at
        a tenant with credit whose work is in the other queue, so that neither queue's tenants take
        every turn (the admission pass follows the reservation pass in a step; a reservation whose
        tenant has the turn at the end of it waits for the next step's)."""
        cfg, deficit, rr = self.config, self._deficit, self._rr
        for tenant, seqs in groups.items():
            if seqs:
                self._join(tenant)  # defensive: every queued sequence's tenant is in the round
        # a tenant with nothing queued anywhere leaves the round, and its credit goes with it
        for tenant in [t for t in rr if not groups.get(t) and t not in elsewhere]:
            rr.remove(tenant)
            del deficit[tenant]
            self._fresh.discard(tenant)
        ready = [t for t in rr if groups.get(t)]
        if not ready:
            return None
        if all(d <= 0 for d in deficit.values()):
            # skip, in one go, the rounds in which nobody would get credit enough to be served: a deep
            # debt (decode tokens billed while the tenant queued) never makes a step idle
            rounds = min(math.floor(-deficit[t] / (cfg.quantum * cfg.weight(t))) for t in rr)
            for t in rr:
                deficit[t] += rounds * cfg.quantum * cfg.weight(t)
        # someone has credit within two turns of the round now: the bound only guards the loop
        for _ in range(4 * len(rr) + 1):
            tenant = rr[0]
            if deficit[tenant] <= 0:
                deficit[tenant] += cfg.quantum * cfg.weight(tenant)
                rr.rotate(-1)
                self._fresh.discard(tenant)
            elif groups.get(tenant):
                self._fresh.discard(tenant)  # it has had its turn: later arrivals queue behind the round
                return groups[tenant][0]
            else:
                return None  # its turn: the other queue's pass serves it
        log.error("fair scheduler: no tenant of %s got credit; serving the richest", ready)
        richest = max(ready, key=lambda t: deficit[t] / cfg.weight(t))
        return groups[richest][0]

    def _charge_admission(self, seq: Sequence) -> None:
        """Bill an admission (or a reservation: the prompt a prefill service computes for it): the
        positions not found in the prefix cache and not billed before (a recompute after preemption
        is the engine's cost, not the tenant's)."""
        self._charge(seq, seq.num_tokens - max(seq.num_charged_tokens, seq.num_cached_tokens))
        seq.num_charged_tokens = max(seq.num_charged_tokens, seq.num_tokens)

    def _charge(self, seq: Sequence, tokens: int) -> None:
        """Tokens served to seq's tenant: counted in tenant_served, and spent from its credit while it
        is in the round (fair)."""
        if tokens <= 0:
            return
        self.tenant_served[seq.tenant] += tokens
        if seq.tenant in self._deficit:
            self._deficit[seq.tenant] -= tokens

    def _recent_demand(self, tenant: str) -> float:
        """Tokens `tenant` asked for lately (prompt + max_tokens of each request it sent), each one's
        weight halving every RECENT_HALF_LIFE_S: how heavy a tenant is, whatever it was served."""
        now = self.clock()
        last = self._recent_at.get(tenant, now)
        decayed = self._recent.get(tenant, 0.0) * 0.5 ** ((now - last) / RECENT_HALF_LIFE_S)
        self._recent[tenant], self._recent_at[tenant] = decayed, now
        return decayed

    def _accrue(self) -> None:
        """Bring every known tenant's burst allowance up to now, from the batch as it ran since the last
        call: a tenant that ran fewer sequences than its share of max_num_seqs with nothing queued (all
        it asked for was served) earns the slot-seconds it left unused; one that ran more than its share
        spends the excess. Capped at fair_burst_s * max_num_seqs, never below 0. A tenant that waits
        with queued work earns nothing, so a flooding tenant that a burst holds under its share does
        not earn a burst of its own (a sleeper's credit, as in CFS, not a waiter's), and what it has
        drains at the rate of its share besides: an allowance serves the burst that arrives with it,
        and is gone after a few seconds of backlog."""
        now = self.clock()
        last, self._allowance_at = self._allowance_at, now
        if last is None or now <= last or not self._allowance:
            return
        cfg = self.config
        dt, cap = now - last, cfg.fair_burst_s * cfg.max_num_seqs
        slots = self._slots()
        queued = {s.tenant for s in self.waiting} | {s.tenant for s in self.reserving}
        active = set(slots) | queued
        for tenant in active:
            self._active_at[tenant] = now
        if now - self._forgot_at >= FORGET_TENANT_S / 10:
            self._forget_idle(now)
        # shares among the tenants that hold slots or wait for one: a tenant that took every slot is
        # over its share while the others queue, not at a share of the whole batch
        active_weight = sum(cfg.weight(t) for t in active)  # once, not once per known tenant
        for tenant, left in self._allowance.items():
            share = self._share(tenant, active, active_weight)
            unused = share - slots[tenant]  # < 0: over its share
            if tenant in queued:
                # backlogged: it earns nothing, and what it kept is for a burst now, not for later (two
                # backlogged tenants that both kept some would share by the share rule until one ran
                # out, and the other then take its slots): it drains at the rate of its share
                unused = min(unused, 0.0) - share
            self._allowance[tenant] = min(cap, max(0.0, left + unused * dt))

    def _forget_idle(self, now: float) -> None:
        """Drop the fair-share state of tenants idle for FORGET_TENANT_S (see there)."""
        self._forgot_at = now
        idle = [t for t in self._allowance if now - self._active_at.get(t, now) >= FORGET_TENANT_S]
        for tenant in idle:
            for state in (self._allowance, self._recent, self._recent_at, self._active_at):
                state.pop(tenant, None)

    def _slots(self) -> Counter[str]:
        """Batch slots per tenant: running sequences and reservations waiting for their KV."""
        slots = Counter(s.tenant for s in self.running)
        slots.update(s.tenant for s in self.parked.values() if s.status is SequenceStatus.PARKED)
        return slots

    def _share(self, tenant: str, among: Collection[str], among_weight: float | None = None) -> float:
        """tenant's share of max_num_seqs, by weight, among the tenants `among` and itself;
        `among_weight`: their weights summed, when the caller has it for many tenants."""
        w = self.config.weight
        total = sum(w(t) for t in among) if among_weight is None else among_weight
        return self.config.max_num_seqs * w(tenant) / (total + (0.0 if tenant in among else w(tenant)))

    def _may_take(self, t: str, v: str, slots: Counter[str]) -> bool:
        """fair, every batch slot taken: may a queued request of tenant t start in place of one of v's?
        Between tenants of like demand (tokens asked for lately, per unit of weight, within
        RECENT_RATIO of each other): when t has burst allowance left (`_accrue`) and v has none, whatever
        their shares; when v has some and t none, never; otherwise when t runs fewer sequences than
        its share of max_num_seqs (one more would not take it over) while v runs more than its own.
        A light tenant (asking
        RECENT_RATIO times less than v) may take from v while v runs at least as many sequences as it,
        and v may never take from it: a light tenant whose few requests overlap is not held to its share
        of a small batch by a flooding one."""
        if t == v or not slots[v]:
            return False
        w = self.config.weight
        demand_t, demand_v = self._recent_demand(t) / w(t), self._recent_demand(v) / w(v)
        if demand_t * RECENT_RATIO < demand_v:  # t is light next to v
            return slots[v] >= slots[t]
        if demand_v * RECENT_RATIO < demand_t:  # v is light next to t: its few slots stay its own
            return False
        burst_t, burst_v = self._allowance.get(t, 0.0) > 0, self._allowance.get(v, 0.0) > 0
        if burst_t != burst_v:  # one of them may run over its share (_accrue), at the other's expense
            return burst_t
        # shares among the tenants holding slots and t
        return slots[t] + 1 <= self._share(t, slots) and slots[v] - 1 >= self._share(v, {*slots, t})

    def _starved_head(self, queue: deque[Sequence], taken: list[Sequence]) -> Sequence | None:
        """fair, every batch slot taken: the most urgent queued sequence of the tenant running the fewest
        sequences per unit of weight among those that may take a slot from another (`_may_take`);
        None if there is none. Such a sequence
        starts in place of one of that other tenant's (`_make_room`), outside the round's order: the
        round decides who goes first while there is room, this only who keeps a slot when there is not."""
        if self.config.policy != "fair":
            return None
        gone = {id(s) for s in taken}  # admitted this step, still in the queue until the pass ends
        queued = [s for s in queue if id(s) not in gone]
        slots, w = self._slots(), self.config.weight
        starved = [t for t in {s.tenant for s in queued} if any(self._may_take(t, v, slots) for v in slots)]
        if not starved:
            return None
        tenant = min(starved, key=lambda t: (slots[t] / w(t), t))
        now = self.clock()
        return min(
            (s for s in queued if s.tenant == tenant),
            key=lambda s: (s.num_preemptions == 0, self._effective_priority(s, now)),
        )

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """fair, every batch slot taken, seq's tenant under its share (`_under_share`): the least urgent
        running sequence of the tenant furthest over its share is preempted (recompute: it goes back to
        the front of its tenant's queue) so that seq can start now. Without this, a tenant that sends
        little waits for a flooding tenant's generations to end before its first token. None if no slot
        was freed; else the token budget the victim gave back."""
        slots, w = self._slots(), self.config.weight
        over = [v for v in slots if self._may_take(seq.tenant, v, slots)]
        fresh = {id(s) for s in out.admitted}  # admitted this very step: preempting them gains nothing
        victims = [s for s in self.running if s.tenant in over and id(s) not in fresh]
        if not victims:
            return None
        worst = max({s.tenant for s in victims}, key=lambda t: slots[t] / w(t))
        now = self.clock()
        victim = max(
            (s for s in victims if s.tenant == worst), key=lambda s: self._effective_priority(s, now)
        )
        self.stats["preempt_fair_share"] += 1
        return self._preempt(victim, out, kind="recompute")

    # --- preemption -------------------------------------------------------------------------------
    def _pick_victim(self) -> Sequence:
        """The least urgent running sequence; fair: of the tenant furthest over its share of the KV
        cache (most blocks held per unit of weight; ties: the most served per unit of weight)."""
        now = self.clock()
        candidates = self.running
        if self.config.policy == "fair":
            held: Counter[str] = Counter()
            for s in self.running:
                held[s.tenant] += len(s.block_table)
            w = self.config.weight
            worst = max(held, key=lambda t: (held[t] / w(t), self.tenant_served[t] / w(t)))
            candidates = [s for s in self.running if s.tenant == worst]
        return max(candidates, key=lambda s: self._effective_priority(s, now))

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

    def _preempt(self, seq: Sequence, out: SchedulerOutput, kind: str | None = None) -> int:
        """Take seq off the running batch (swap or recompute: `kind`, default the cheaper); returns budget
        given back if it was already scheduled."""
        refund = 0
        for i, (s, n) in enumerate(out.scheduled):
            if s is seq:
                del out.scheduled[i]
                refund = n
                break
        kind = kind or self._preemption_kind(seq)
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
            self.waiting.appendleft(seq)  # first in line to come back (fair: first of its tenant's)
            self._join(seq.tenant)
        return refund

    # --- after the model ran ----------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish sequences; returns those finished."""
        finished: list[Sequence] = []
        for (seq, n), tok in zip(out.scheduled, sampled, strict=True):
            seq.num_computed_tokens += n
            self.bm.commit(seq, seq.num_computed_tokens)
            if seq.num_computed_tokens > seq.num_charged_tokens:  # a decode step: a position new to the bill
                self._charge(seq, seq.num_computed_tokens - seq.num_charged_tokens)
                seq.num_charged_tokens = seq.num_computed_tokens
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


def _without(queue: deque[Sequence], taken: list[Sequence]) -> deque[Sequence]:
    """queue less the sequences taken from it: popped off its front when they were its first ones
    (fcfs), else a new deque without them (a reordered admission)."""
    if all(a is b for a, b in zip(taken, queue, strict=False)):
        for _ in taken:
            queue.popleft()
        return queue
    ids = {id(s) for s in taken}
    return deque(s for s in queue if id(s) not in ids)
