"""First come, first served: arrival order, head-of-line admission (a large prompt is not starved by the
smaller ones behind it); no tenants, no slot taking; out of KV blocks the latest arrival goes."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from common.engine.policy.base import QueuePolicy, SchedulerView, Urgency
from common.engine.sequence import Sequence


class Fcfs(QueuePolicy):
    def urgency(self, seq: Sequence, now: float) -> Urgency:
        return (0.0, seq.arrival_time or 0.0, seq.arrival_order)

    def arrived(self, seq: Sequence) -> None:
        pass

    def requeued(self, seq: Sequence) -> None:
        pass

    def begin_step(self, view: SchedulerView) -> int | None:
        return None

    def newcomers(self) -> set[str]:
        return set()

    def admission_order(
        self, queue: deque[Sequence], view: SchedulerView, by_priority: bool
    ) -> Iterator[Sequence]:
        yield from queue

    def charge(self, tenant: str, tokens: int) -> None:
        pass

    def claimant(self, queue: deque[Sequence], taken: list[Sequence], view: SchedulerView) -> Sequence | None:
        return None

    def displace(self, seq: Sequence, admitted: list[Sequence], view: SchedulerView) -> Sequence | None:
        return None

    def victim(self, view: SchedulerView) -> Sequence:
        now = self.clock()
        return max(view.running, key=lambda s: self.urgency(s, now))
