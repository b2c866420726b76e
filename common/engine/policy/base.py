"""The queue-policy interface: in what order the scheduler serves queued work, and whom it preempts.

The scheduler (common/engine/scheduler.py) owns the queues, the running batch, the KV blocks and the
token budget, and it alone changes them. A policy owns the order of work and its own bookkeeping (a
tenant's credit, its recent demand, ...). The scheduler holds one policy, chosen once from
`SchedulerConfig.policy` (`make_policy`), and calls it at these points:

  Scheduler.add(seq)               -> arrived(seq)
  Scheduler.schedule(), in order:     begin_step(view)                 how many prefill tokens this step
                                      newcomers()                      whose first request goes in whole
                                      admission_order(queue, view, .)  reservations, then admissions
                                      claimant / displace              only with every batch slot taken
  out of KV blocks                 -> victim(view)
  a sequence preempted to recompute -> requeued(seq)
  tokens billed to a tenant         -> charge(tenant, tokens)

Guarantees both sides keep:
- A policy never changes the scheduler's queues, batch or sequences: it reads them through the
  `SchedulerView` it is handed and returns its choice; the scheduler acts on it.
- Every hook runs on the scheduler's thread, one at a time; the policy's clock is the scheduler's.
- What a hook returns is one of the sequences it was shown (queued for `admission_order` and
  `claimant`, running for `displace` and `victim`), or None where the hook allows it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Protocol

from common.engine.scheduler_config import SchedulerConfig
from common.engine.sequence import Sequence

Urgency = tuple[float, float, int]  # a sort key: the smallest is the most urgent


class SchedulerView(Protocol):
    """What a policy may read of the scheduler (the Scheduler itself is one); never changed by it."""

    @property
    def running(self) -> list[Sequence]: ...

    @property
    def waiting(self) -> deque[Sequence]: ...

    @property
    def reserving(self) -> deque[Sequence]: ...

    @property
    def tenant_served(self) -> Counter[str]: ...

    def tenant_slots(self) -> Counter[str]:
        """Batch slots per tenant: running sequences and reservations waiting for their KV."""
        ...


class QueuePolicy(ABC):
    """One queue policy. The hooks, in the order a sequence meets them (see the module doc)."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock

    @abstractmethod
    def urgency(self, seq: Sequence, now: float) -> Urgency:
        """seq's sort key at time `now`, most urgent first; ties are broken by arrival (time, then the
        order of Scheduler.add), so two sequences never compare equal."""

    @abstractmethod
    def arrived(self, seq: Sequence) -> None:
        """seq was just queued by Scheduler.add (waiting, or reserving for remote KV)."""

    @abstractmethod
    def requeued(self, seq: Sequence) -> None:
        """seq was preempted to be recomputed: it is back at the front of the waiting queue."""

    @abstractmethod
    def begin_step(self, view: SchedulerView) -> int | None:
        """A step begins (before anything is scheduled). Returns the bound on the step's prefill tokens
        beside the newcomers' (`newcomers`), None for none; the scheduler lowers it to 0 once a newcomer
        starts in the step."""

    @abstractmethod
    def newcomers(self) -> set[str]:
        """Tenants whose first queued request goes into this step whole, right after the running decodes
        and ahead of all other prefill work (one request each). A new set: the caller changes it."""

    @abstractmethod
    def admission_order(
        self, queue: deque[Sequence], view: SchedulerView, by_priority: bool
    ) -> Iterator[Sequence]:
        """The order queue's sequences (view.waiting, or view.reserving: by_priority False) are offered
        in, lazily: nothing is read before the first one is asked for. The caller takes each sequence
        yielded, and bills it (`charge`), before it asks for the next, or it stops; it never skips one."""

    @abstractmethod
    def charge(self, tenant: str, tokens: int) -> None:
        """`tokens` (> 0) were billed to `tenant`: an admission's uncached prompt, or a decode step."""

    @abstractmethod
    def claimant(self, queue: deque[Sequence], taken: list[Sequence], view: SchedulerView) -> Sequence | None:
        """Every batch slot is taken: a sequence of queue (less `taken`, admitted this pass) that may start
        in place of a running one (`displace`), or None: nothing starts until a slot frees."""

    @abstractmethod
    def displace(self, seq: Sequence, admitted: list[Sequence], view: SchedulerView) -> Sequence | None:
        """The running sequence that gives its slot to `claimant`'s seq (the scheduler preempts it to be
        recomputed), never one of `admitted` (started this step); None if there is none."""

    @abstractmethod
    def victim(self, view: SchedulerView) -> Sequence:
        """Out of KV blocks: the running sequence to preempt (view.running is never empty here)."""
