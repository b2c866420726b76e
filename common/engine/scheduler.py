"""Iteration-level (continuous-batching) scheduler. Plain Python: no torch, no I/O.

Every step re-decides the batch (Orca). Order of work within one step's token budget (Sarathi):
  1. running sequences that decode (one token each), then the first request of each tenant the policy
     names a newcomer, then running prefills, chunked to the budget; a sequence that needs a new KV
     block and finds none preempts the running sequence the policy picks (`victim`)
  2. sequences swapped out to host memory come back before anything new is admitted
  3. waiting sequences are admitted, in the policy's order, while KV blocks, `max_num_seqs` and the
     budget allow; with every batch slot taken, the policy may have one start in place of a running one.
     One whose offload-tier prefetch still brings its blocks from the disk into RAM waits (head of
     line) while others run, rather than read the disk on the engine's thread and stall them
The queue policy (`fcfs`, `priority` with aging, tenant fair share `fair`) is an object chosen once from
`SchedulerConfig.policy` and called at a few hooks: common/engine/policy/base.py says which and when.
The static-batching baseline is its own scheduler (common/engine/static_batching.py). `tenant_served`
counts each tenant's billed tokens under every policy.

Remote KV: a decode service's request waits in `reserving` until its prompt's blocks can be reserved,
then sits in `parked` (holding them, never scheduled) until `kv_arrived`. A prefill service's request
that finished while its KV is still being sent keeps its blocks in `parked` too, until the engine
finishes it again once the transfer let go (`holds_blocks`, asked of the KV connector).

Sliding windows (a block manager with a `window`: every layer of the model slides): after each step a
sequence's blocks that lie wholly before its next query's window are released (`release_window`; its
table keeps HOLEs there), so a sequence holds about window / block_size + 2 blocks however long it
grows. A reservation for a prompt whose KV arrives window-only takes only the window's blocks, and a
swap-in only the blocks it still reads. A local admission takes the blocks of the prompt's first chunk
only, and each later step those of its next chunk (`room`, `grow`): a long prompt, or a preempted
sequence recomputed, holds at most a chunk and the window before it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.engine.policy import QueuePolicy, make_policy
from common.engine.scheduler_config import SchedulerConfig as SchedulerConfig
from common.engine.sequence import Sequence, SequenceStatus
from common.kv.block_manager import BlockManager

log = logging.getLogger("splitserve.scheduler")


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
        self.policy: QueuePolicy = make_policy(config, clock)  # the order of work (module doc)
        self._bulk: int | None = None  # prefill tokens left in this step beside newcomers' (None: no bound)

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
        self.policy.arrived(seq)

    def has_work(self) -> bool:
        """Anything a step would do (parked sequences wait for a transfer, not for a step)."""
        return bool(self.waiting or self.running or self.swapped or self.reserving)

    @property
    def num_active(self) -> int:
        """Sequences counted against max_num_seqs: running, and reservations waiting for their KV."""
        return len(self.running) + self.num_parked

    @property
    def num_parked(self) -> int:
        """Reservations waiting for their KV (in num_active, generating nothing yet)."""
        return sum(s.status is SequenceStatus.PARKED for s in self.parked.values())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.reserving)

    def oldest_arrival(self) -> float | None:
        """When the longest-waiting queued sequence (waiting or reserving) arrived; None with an empty
        queue."""
        arrivals = [s.arrival_time for q in (self.waiting, self.reserving) for s in q]
        return min((a for a in arrivals if a is not None), default=None)

    def queue_wait_s(self) -> float:
        """How long the longest-waiting queued sequence has waited (0 with an empty queue): the
        queue's sojourn time, which routers compare with how soon a new request must start."""
        oldest = self.oldest_arrival()
        return 0.0 if oldest is None else max(0.0, self.clock() - oldest)

    def queued_tokens(self) -> int:
        """Tokens of the queued sequences (waiting and reserving): the prompt work ahead of a new
        request."""
        return sum(s.num_tokens for q in (self.waiting, self.reserving) for s in q)

    # --- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        # the first request of each tenant the policy names a newcomer goes into the step whole, ahead
        # of other prefill work; all other prefill tokens of the step are bounded by `_bulk` (if the
        # policy sets one), and wait a step where a newcomer starts
        self._bulk = self.policy.begin_step(self)
        budget, short = self._run(decodes, out, budget)
        if (newcomers := self.policy.newcomers()) and not short:
            budget = self._admit(out, budget, newcomers=newcomers)
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
        needs a new KV block and finds none preempts the policy's victim. Returns the budget left, and
        whether memory was short (something was preempted)."""
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
            # blocks for every token; with a window, for this chunk's only (the window before it is held)
            target = seq.num_tokens if self.bm.window is None else seq.num_computed_tokens + n
            while target > len(seq.block_table) * bs and not self.bm.can_grow(seq, target):
                budget += self._preempt(self.policy.victim(self), out)
                if seq.status is not SequenceStatus.RUNNING:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.bm.grow(seq, target)
            n = self._room(seq, self._chunk(seq, budget))
            self._take(seq, n, out)
            budget -= n
        return budget, len(out.preempted) > preempted

    def _room(self, seq: Sequence, n: int) -> int:
        """n, or fewer: the tokens seq's blocks have room for (a windowed prefill holds one chunk's)."""
        room = len(seq.block_table) * self.bm.block_size - seq.num_computed_tokens
        assert room > 0 or n == 0, f"{seq.seq_id} was given no block for its next token"
        return min(n, room)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of seq's uncomputed tokens this step can take: the budget, and for a prefill the
        policy's bound (what is left of it this step)."""
        n = min(seq.num_uncomputed_tokens, budget)
        return min(n, self._bulk) if self._bulk is not None and seq.num_uncomputed_tokens > 1 else n

    def _take(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        if self._bulk is not None and seq.num_uncomputed_tokens > 1:
            self._bulk -= n
        out.scheduled.append((seq, n))

    def _reserve(self, out: SchedulerOutput) -> None:
        """Admission control for remote prefill: reserve the prompt's blocks, in the policy's order."""
        taken: list[Sequence] = []
        order = self.policy.admission_order(self.reserving, self, by_priority=False)
        while True:
            full = self.num_active >= self.config.max_num_seqs
            # as in _admit: every batch slot taken, the policy may still have one start
            seq = self.policy.claimant(self.reserving, taken, self) if full else next(order, None)
            if seq is None or self._defer(seq):
                break
            if full and self._make_room(seq, out) is None:
                break
            # decoding starts at the prompt's end: the blocks before its window are holes from the start
            # (the prefill service sends no layer of them; common/connector/prefill.py)
            first = self.bm.first_live(seq.num_tokens)
            if not self.bm.can_allocate(seq, first=first):
                break
            self.bm.allocate(seq, first=first)
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
        w = self.config.kv_window
        if self.bm.hits_need_windows_only:
            # layer groups (common/kv/layer_groups.py): a sliding group's pages the transfer did not
            # write go now, unhashed (a larger window's group may have been reserved more than its
            # window); what stays is whole, and a prefix hit takes a sliding page only for the window
            # it reads, so the prompt joins the prefix cache as it is (a later turn's hit)
            self.bm.release_window(seq, seq.num_computed_tokens)
            self.bm.commit(seq, seq.num_computed_tokens)
        elif w is not None and seq.num_tokens - w + 1 >= self.bm.block_size:
            # the sliding layers of the blocks before their window were not sent: correct for this
            # sequence (it never reads them), wrong for another that shares the prefix and would
            seq.kv_partial = True
        else:
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
            # windowed: the table it had (its holes then, released up to its computed tokens, and the
            # blocks it held) and room for its next token; else blocks for every token
            first = self.bm.first_live(seq.num_computed_tokens)
            size = seq.num_tokens
            if self.bm.window is not None:
                size = min(size, max(seq.swap_width * self.bm.block_size, seq.num_computed_tokens + 1))
            if not self.bm.can_allocate(seq, size, use_prefix_cache=False, first=first):
                break
            self.swapped.popleft()
            self.bm.allocate(seq, size, use_prefix_cache=False, first=first)
            self.bm.release_window(seq, seq.num_computed_tokens)  # each group's holes as when it left
            self.swap_blocks_used -= seq.num_swapped_blocks
            seq.num_swapped_blocks = 0
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.swap_in.append(seq)
            n = self._room(seq, min(seq.num_uncomputed_tokens, budget))
            out.scheduled.append((seq, n))
            budget -= n
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, newcomers: set[str] | None = None) -> int:
        """Admit waiting sequences in the policy's order while the budget, the batch and the KV blocks
        allow. `newcomers`: admit only the first sequence of each of these tenants, whole (no `_bulk`
        bound), and stop at any other. Returns the budget left."""
        if self.swapped or not self.waiting:
            return budget  # swapped sequences come back first
        taken: list[Sequence] = []
        order = self.policy.admission_order(self.waiting, self, by_priority=True)
        while budget > 0:
            full = self.num_active >= self.config.max_num_seqs
            # every batch slot taken: the policy may still have one start, in place of a running one
            seq = self.policy.claimant(self.waiting, taken, self) if full else next(order, None)
            if seq is None or (newcomers is not None and seq.tenant not in newcomers):
                break
            if self._defer(seq):
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
            room = None if self.bm.window is None else chunk  # windowed: the first chunk's blocks only
            if not self.bm.can_allocate(seq, use_prefix_cache=cache, room=room):
                break  # head-of-line blocking on purpose: skipping ahead would starve long prompts
            self.bm.allocate(seq, use_prefix_cache=cache, room=room)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            taken.append(seq)
            out.admitted.append(seq)
            self._charge_admission(seq)
            if newcomers is not None:
                newcomers.discard(seq.tenant)
                n = self._room(seq, min(seq.num_uncomputed_tokens, budget))
                out.scheduled.append((seq, n))
            else:
                n = self._room(seq, self._chunk(seq, budget))
                self._take(seq, n, out)
            budget -= n
        self.waiting = _without(self.waiting, taken)
        return budget

    def _defer(self, seq: Sequence) -> bool:
        """Whether seq's admission (or reservation) waits this step: its blocks are on their way from
        the disk into RAM (the tiers' prefetch thread) and other sequences run, which step meanwhile,
        where its admission would read the disk on the engine's thread and stall them; it is admitted,
        reading RAM, once the prefetch is done."""
        if self.running and self._prefetching(seq):
            self.stats["prefetch_deferred"] += 1
            return True
        return False

    def _prefetching(self, seq: Sequence) -> bool:
        """Whether the prefetch started on seq's arrival still brings its blocks into RAM (and its wait
        has not run out: kv_offload_prefetch_wait_s bounds it, a stuck disk must not hold it back)."""
        keys, tier = seq.prefetch_keys, self.bm.tier
        if keys is None:
            return False
        if tier is None or self.clock() > seq.prefetch_deadline or not tier.prefetching(keys):
            seq.prefetch_keys = None  # done, or waited for long enough: the admission reads what it finds
            return False
        return True

    # --- billing and slots (what the policy is told and reads) --------------------------------------
    def _charge_admission(self, seq: Sequence) -> None:
        """Bill an admission (or a reservation: the prompt a prefill service computes for it): the
        positions not found in the prefix cache and not billed before (a recompute after preemption
        is the engine's cost, not the tenant's)."""
        self._charge(seq, seq.num_tokens - max(seq.num_charged_tokens, seq.num_cached_tokens))
        seq.num_charged_tokens = max(seq.num_charged_tokens, seq.num_tokens)

    def _charge(self, seq: Sequence, tokens: int) -> None:
        """Tokens served to seq's tenant: counted in tenant_served, and told to the policy."""
        if tokens <= 0:
            return
        self.tenant_served[seq.tenant] += tokens
        self.policy.charge(seq.tenant, tokens)

    def tenant_slots(self) -> Counter[str]:
        """Batch slots per tenant: running sequences and reservations waiting for their KV."""
        slots = Counter(s.tenant for s in self.running)
        slots.update(s.tenant for s in self.parked.values() if s.status is SequenceStatus.PARKED)
        return slots

    # --- preemption -------------------------------------------------------------------------------
    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """Every batch slot taken, seq the policy's claimant: the running sequence the policy displaces
        for it is preempted (recompute: it goes back to the front of the queue) so that seq can start
        now. None if no slot was freed; else the token budget the victim gave back."""
        victim = self.policy.displace(seq, out.admitted, self)
        if victim is None:
            return None
        self.stats["preempt_fair_share"] += 1
        return self._preempt(victim, out, kind="recompute")

    def _preemption_kind(self, seq: Sequence) -> str:
        cfg, n_blocks = self.config, self.bm.num_held(seq)
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
            held = self.bm.live_pages(seq)  # holes hold nothing: none is copied out, or back in
            seq.swap_width = len(seq.block_table)
            out.swap_out.append((seq, held))
            seq.num_swapped_blocks = len(held)
            self.swap_blocks_used += seq.num_swapped_blocks
            self.bm.free(seq)  # its block table is empty while it is out: fresh blocks on swap-in
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            seq.kv_partial = False  # recomputed here: every layer's KV, whole
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)  # first in line to come back (fair: first of its tenant's)
            self.policy.requeued(seq)
        return refund

    # --- after the model ran ----------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish sequences; returns those finished."""
        finished: list[Sequence] = []
        for (seq, n), tok in zip(out.scheduled, sampled, strict=True):
            seq.num_computed_tokens += n
            if not seq.kv_partial:
                self.bm.commit(seq, seq.num_computed_tokens)
            # after the commit: a block released hashed stays in the prefix cache (its KV is whole)
            self.bm.release_window(seq, seq.num_computed_tokens)
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
