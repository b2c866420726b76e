"""The queue policies on their own, against a fake scheduler view: no scheduler, no block manager."""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest

from common.engine.policy import FairShare, Fcfs, Priority, QueuePolicy, make_policy
from common.engine.scheduler_config import SchedulerConfig
from common.engine.sequence import Sequence, SequenceStatus
from common.sampling_params import SamplingParams

_order = itertools.count(1)


def seq(
    tenant: str = "", n_prompt: int = 8, priority: int = 0, arrival: float = 0.0, blocks: int = 0
) -> Sequence:
    s = Sequence(
        list(range(n_prompt)),
        SamplingParams(max_tokens=4),
        priority=priority,
        arrival_time=arrival,
        tenant=tenant,
    )
    s.arrival_order = next(_order)  # what Scheduler.add sets
    s.block_table = list(range(blocks))
    return s


@dataclass
class View:
    """A SchedulerView without a scheduler: the policy reads it, and must leave it as it was."""

    running: list[Sequence] = field(default_factory=list)
    waiting: deque[Sequence] = field(default_factory=deque)
    reserving: deque[Sequence] = field(default_factory=deque)
    tenant_served: Counter[str] = field(default_factory=Counter)

    def tenant_slots(self) -> Counter[str]:
        return Counter(s.tenant for s in self.running)

    def snapshot(self) -> tuple[list[str], list[str], list[str], dict[str, int]]:
        ids = lambda q: [s.seq_id for s in q]  # noqa: E731
        return ids(self.running), ids(self.waiting), ids(self.reserving), dict(self.tenant_served)


def admit_all(p: QueuePolicy, view: View, by_priority: bool = True) -> list[Sequence]:
    """Take every sequence offered, billing each its prompt before asking for the next (the contract)."""
    taken = []
    for s in p.admission_order(view.waiting, view, by_priority=by_priority):
        taken.append(s)
        p.charge(s.tenant, s.num_tokens)
    return taken


@pytest.mark.parametrize(
    ("name", "kind"), [("fcfs", Fcfs), ("static", Fcfs), ("priority", Priority), ("fair", FairShare)]
)
def test_the_policy_is_chosen_once_from_the_config_and_implements_every_hook(name: str, kind: type) -> None:
    p = make_policy(SchedulerConfig(policy=name), lambda: 0.0)  # type: ignore[arg-type]
    assert type(p) is kind and isinstance(p, QueuePolicy)  # instantiated: no hook left abstract


def test_fcfs_offers_arrival_order_and_preempts_the_latest_arrival() -> None:
    p = make_policy(SchedulerConfig(policy="fcfs"), lambda: 10.0)
    a, b, c = seq(priority=5, arrival=1.0), seq(priority=0, arrival=2.0), seq(priority=0, arrival=2.0)
    view = View(running=[a, b, c], waiting=deque([c, b, a]))
    assert admit_all(p, view) == [c, b, a]
    assert p.victim(view) is c, "equal arrival times: the later add() goes first"
    assert p.begin_step(view) is None and p.newcomers() == set()
    assert p.claimant(view.waiting, [], view) is None and p.displace(a, [], view) is None


def test_priority_ages_so_a_low_priority_request_rises_to_the_front() -> None:
    now = [0.0]
    p = make_policy(SchedulerConfig(policy="priority", aging_s=1.0), lambda: now[0])
    old, new = seq(priority=3, arrival=0.0), seq(priority=0, arrival=0.0)
    view = View(waiting=deque([old, new]))
    assert admit_all(p, view) == [new, old]
    new.arrival_time = now[0] = 4.0  # old has waited 4 s: worth 4 levels
    assert admit_all(p, view) == [old, new]
    assert admit_all(p, view, by_priority=False) == [old, new], "reservations: arrival order"


def test_fair_share_alternates_tenants_by_credit_and_leaves_the_queues_alone() -> None:
    p = make_policy(SchedulerConfig(policy="fair", fair_quantum_tokens=8), lambda: 0.0)
    view = View(waiting=deque([*(seq("a") for _ in range(4)), *(seq("b") for _ in range(2))]))
    for s in view.waiting:
        p.arrived(s)
    before = view.snapshot()
    assert "".join(s.tenant for s in admit_all(p, view)) == "ababaa"
    assert view.snapshot() == before, "a policy reads the view, never changes it"


def test_fair_share_newcomers_is_a_copy_and_charging_an_absent_tenant_does_nothing() -> None:
    p = make_policy(SchedulerConfig(policy="fair"), lambda: 0.0)
    p.arrived(seq("a"))
    names = p.newcomers()
    assert names == {"a"}
    names.clear()
    assert p.newcomers() == {"a"}
    p.charge("nobody", 100)  # billed outside the round (e.g. a decode step after its queue emptied)
    assert p.newcomers() == {"a"}


def test_fair_share_preempts_from_the_tenant_holding_the_most_blocks_per_weight() -> None:
    p = make_policy(SchedulerConfig(policy="fair", tenant_weights={"a": 4.0}), lambda: 0.0)
    a1, a2 = seq("a", blocks=3, arrival=0.0), seq("a", blocks=3, arrival=1.0)
    b1, b2 = seq("b", blocks=2, arrival=0.0), seq("b", blocks=1, arrival=1.0)
    for s in (a1, a2, b1, b2):
        s.status = SequenceStatus.RUNNING
    view = View(running=[a1, a2, b1, b2])
    # a holds 6 blocks at weight 4 (1.5 a unit), b 3 at weight 1: b's least urgent goes
    assert p.victim(view) is b2
