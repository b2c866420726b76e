"""Tenant fair share (policy `fair`): the engine shared between tenants (Sequence.tenant; "" is one too).

Admission is deficit round robin over tenants. Tenants with queued work form a round (one whose
request arrives to an empty queue joins at the head with one quantum: `_join`); the tenant at its head
with no credit left (deficit <= 0) is credited `fair_quantum_tokens * weight` and the turn passes; one
with credit has its most urgent sequence admitted (priority, aged as in `priority`; recompute-preempted
sequences first) and keeps the turn while its credit lasts. A newcomer's first request goes into the
next step whole, ahead of other prefill work (`newcomers`); with `fair_bulk_prefill_tokens`, all other
prefill tokens of a step are bounded by it (0 in a step where a newcomer starts: `begin_step`), so a
flooding tenant's steps stay short. Credit is spent on tokens served (`charge`): the prompt positions
an admission computes (prefix-cache hits are free, a recompute after preemption is the engine's cost),
then one per decode step; an admission may overdraw it, later credit pays the debt. A tenant whose
queue empties leaves the round and loses its credit: nothing is banked while idle. Rounds in which
nobody could be served are skipped in one go, so a deep debt never leaves capacity idle. Decode-side
reservations (`reserving`) follow the same round and credit.

With every batch slot taken, a queued tenant under its share of `max_num_seqs` starts in place of the
least urgent sequence of the tenant furthest over its own (recomputed: `claimant`, `displace`). A light
tenant (asking RECENT_RATIO times fewer tokens lately than another) may take a slot from it while that
one runs as many sequences, and that one never takes the light one's slots (`_may_take`). A tenant that
left part of its share unused with nothing queued earns a burst allowance (slot-seconds, capped at
`fair_burst_s` of the whole batch; `_accrue`): it may run over its share at the expense of a tenant
without one, which does not take those slots back until the allowance is spent, so a sparse tenant's
few overlapping requests all start at once even when a flood has just begun (its demand is not yet far
below the flood's). Out of KV blocks, the victim comes from the tenant holding the most KV blocks per
unit of weight (the one furthest over its share of the cache), least urgent first (`victim`).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator

from common.engine.policy.base import SchedulerView
from common.engine.policy.priority import Priority
from common.engine.scheduler_config import SchedulerConfig
from common.engine.sequence import Sequence
from common.kv.block_manager import live_blocks

log = logging.getLogger("splitserve.scheduler")
RECENT_HALF_LIFE_S = 5.0  # how fast tokens asked for stop counting as recent (_may_take)
RECENT_RATIO = 4.0  # asking this many times less lately, a tenant may take a slot (_may_take)
# a tenant with nothing running or queued for this long is forgotten (its demand and burst allowance;
# _forget_idle): it comes back as a new tenant, and the policy's state and the work of each step stay
# bounded by the tenants seen lately, not every tenant ever seen
FORGET_TENANT_S = 600.0


class FairShare(Priority):
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        super().__init__(config, clock)
        # the round of tenants with queued work ([0] has the turn) and each one's credit in tokens
        self._rr: deque[str] = deque()
        self._fresh: set[str] = set()  # tenants that joined on arrival and have not had their turn yet
        self._deficit: dict[str, float] = {}
        # tokens asked for per tenant lately (decayed; see _may_take) and when each was last updated
        self._recent: dict[str, float] = {}
        self._recent_at: dict[str, float] = {}
        # slot-seconds each tenant may still run over its share of the batch, and when they were last
        # brought up to date (see _accrue)
        self._allowance: dict[str, float] = {}
        self._allowance_at: float | None = None
        self._active_at: dict[str, float] = {}  # when each known tenant last held a slot or queued
        self._forgot_at = 0.0  # when _forget_idle last looked

    # --- the hooks (common/engine/policy/base.py) -------------------------------------------------
    def arrived(self, seq: Sequence) -> None:
        self._join(seq.tenant, arriving=True)
        if seq.num_preemptions == 0:
            asked = seq.num_prompt_tokens + seq.params.max_tokens
            self._recent[seq.tenant] = self._recent_demand(seq.tenant) + asked
            self._allowance.setdefault(seq.tenant, 0.0)  # a tenant not seen before has none
            self._active_at[seq.tenant] = self.clock()

    def requeued(self, seq: Sequence) -> None:
        self._join(seq.tenant)

    def begin_step(self, view: SchedulerView) -> int | None:
        self._accrue(view)
        return self.config.fair_bulk_prefill_tokens

    def newcomers(self) -> set[str]:
        return set(self._fresh)

    def admission_order(
        self, queue: deque[Sequence], view: SchedulerView, by_priority: bool
    ) -> Iterator[Sequence]:
        """queue's sequences in deficit-round-robin order over their tenants (by_priority or not).
        Within a tenant: recompute-preempted sequences first (back to the front of the line), then by
        effective priority (aged), then arrival."""
        now = self.clock()
        groups: dict[str, deque[Sequence]] = {}

        def key(s: Sequence) -> tuple[bool, tuple[float, float, int]]:
            return (s.num_preemptions == 0, self.urgency(s, now))

        for s in sorted(queue, key=key):
            groups.setdefault(s.tenant, deque()).append(s)
        other = view.waiting if queue is view.reserving else view.reserving
        elsewhere = {s.tenant for s in other}
        while (head := self._next(groups, elsewhere)) is not None:
            yield head
            groups[head.tenant].popleft()  # taken (the caller was charged for it before asking again)

    def charge(self, tenant: str, tokens: int) -> None:
        """Spent from the tenant's credit while it is in the round."""
        if tenant in self._deficit:
            self._deficit[tenant] -= tokens

    def claimant(self, queue: deque[Sequence], taken: list[Sequence], view: SchedulerView) -> Sequence | None:
        """The most urgent queued sequence of the tenant running the fewest sequences per unit of weight
        among those that may take a slot from another (`_may_take`); None if there is none. Outside the
        round's order: the round decides who goes first while there is room, this only who keeps a slot
        when there is not. Without it, a tenant that sends little waits for a flooding tenant's
        generations to end before its first token."""
        gone = {id(s) for s in taken}  # admitted this step, still in the queue until the pass ends
        queued = [s for s in queue if id(s) not in gone]
        slots, w = view.tenant_slots(), self.config.weight
        starved = [t for t in {s.tenant for s in queued} if any(self._may_take(t, v, slots) for v in slots)]
        if not starved:
            return None
        tenant = min(starved, key=lambda t: (slots[t] / w(t), t))
        now = self.clock()
        return min(
            (s for s in queued if s.tenant == tenant),
            key=lambda s: (s.num_preemptions == 0, self.urgency(s, now)),
        )

    def displace(self, seq: Sequence, admitted: list[Sequence], view: SchedulerView) -> Sequence | None:
        """The least urgent running sequence of the tenant furthest over its share, among those seq's
        tenant may take a slot from (`_may_take`)."""
        slots, w = view.tenant_slots(), self.config.weight
        over = [v for v in slots if self._may_take(seq.tenant, v, slots)]
        fresh = {id(s) for s in admitted}  # admitted this very step: preempting them gains nothing
        victims = [s for s in view.running if s.tenant in over and id(s) not in fresh]
        if not victims:
            return None
        # ties go to the first name in order: a set's order differs between processes (str hashing)
        worst = max(sorted({s.tenant for s in victims}), key=lambda t: slots[t] / w(t))
        now = self.clock()
        return max((s for s in victims if s.tenant == worst), key=lambda s: self.urgency(s, now))

    def victim(self, view: SchedulerView) -> Sequence:
        """The least urgent running sequence of the tenant furthest over its share of the KV cache (most
        blocks held per unit of weight; ties: the most served per unit of weight)."""
        now = self.clock()
        held: Counter[str] = Counter()
        for s in view.running:
            # a windowed sequence's holes hold nothing; a grouped one holds a page per layer group
            held[s.tenant] += sum(len(live_blocks(t)) for t in (s.block_table, *s.group_tables))
        w, served = self.config.weight, view.tenant_served
        worst = max(held, key=lambda t: (held[t] / w(t), served[t] / w(t)))
        return max((s for s in view.running if s.tenant == worst), key=lambda s: self.urgency(s, now))

    # --- the round --------------------------------------------------------------------------------
    def _join(self, tenant: str, arriving: bool = False) -> None:
        """A tenant with newly queued work joins the round. One whose request just arrived (it had
        nothing queued: a sparse tenant) goes to the head with one quantum of credit, so its request is
        next, as new flows are in FQ-CoDel: a light tenant's first token does not wait for a heavy one's
        credit to run out. It gets that once per idle period; while it stays backlogged it takes its
        turns like any. Otherwise (a preempted sequence's tenant) it joins the end with no credit."""
        if tenant in self._deficit:
            return
        if arriving:  # behind the other new tenants still waiting for their first turn
            self._deficit[tenant] = self.config.quantum * self.config.weight(tenant)
            self._rr.insert(sum(1 for _ in itertools.takewhile(self._fresh.__contains__, self._rr)), tenant)
            self._fresh.add(tenant)
        else:
            self._deficit[tenant] = 0.0
            self._rr.append(tenant)

    def _next(self, groups: dict[str, deque[Sequence]], elsewhere: set[str]) -> Sequence | None:
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

    # --- a full batch: demand, shares, burst allowance --------------------------------------------
    def _recent_demand(self, tenant: str) -> float:
        """Tokens `tenant` asked for lately (prompt + max_tokens of each request it sent), each one's
        weight halving every RECENT_HALF_LIFE_S: how heavy a tenant is, whatever it was served."""
        now = self.clock()
        last = self._recent_at.get(tenant, now)
        decayed = self._recent.get(tenant, 0.0) * 0.5 ** ((now - last) / RECENT_HALF_LIFE_S)
        self._recent[tenant], self._recent_at[tenant] = decayed, now
        return decayed

    def _accrue(self, view: SchedulerView) -> None:
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
        slots = view.tenant_slots()
        queued = {s.tenant for s in view.waiting} | {s.tenant for s in view.reserving}
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
        """Drop the state of tenants idle for FORGET_TENANT_S (see there)."""
        self._forgot_at = now
        idle = [t for t in self._allowance if now - self._active_at.get(t, now) >= FORGET_TENANT_S]
        for tenant in idle:
            for state in (self._allowance, self._recent, self._recent_at, self._active_at):
                state.pop(tenant, None)

    def _share(self, tenant: str, among: Collection[str], among_weight: float | None = None) -> float:
        """tenant's share of max_num_seqs, by weight, among the tenants `among` and itself;
        `among_weight`: their weights summed, when the caller has it for many tenants."""
        w = self.config.weight
        total = sum(w(t) for t in among) if among_weight is None else among_weight
        return self.config.max_num_seqs * w(tenant) / (total + (0.0 if tenant in among else w(tenant)))

    def _may_take(self, t: str, v: str, slots: Counter[str]) -> bool:
        """Every batch slot taken: may a queued request of tenant t start in place of one of v's?
        Between tenants of like demand (tokens asked for lately, per unit of weight, within
        RECENT_RATIO of each other): when t has burst allowance left (`_accrue`) and v has none, whatever
        their shares; when v has some and t none, never; otherwise when t runs fewer sequences than
        its share of max_num_seqs (one more would not take it over) while v runs more than its own.
        A light tenant (asking RECENT_RATIO times less than v) may take from v while v runs at least as
        many sequences as it, and v may never take from it: a light tenant whose few requests overlap
        is not held to its share of a small batch by a flooding one."""
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
