"""Priority with aging: lower `Sequence.priority` first, and each `aging_s` of waiting is worth one
level, so every request eventually rises to the front. Reservations stay in arrival order; otherwise
as fcfs (out of KV blocks, the lowest effective priority goes)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from common.engine.policy.base import SchedulerView, Urgency
from common.engine.policy.fcfs import Fcfs
from common.engine.sequence import Sequence


class Priority(Fcfs):
    def urgency(self, seq: Sequence, now: float) -> Urgency:
        arrival = seq.arrival_time or 0.0
        return (seq.priority - (now - arrival) / self.config.aging_s, arrival, seq.arrival_order)

    def admission_order(
        self, queue: deque[Sequence], view: SchedulerView, by_priority: bool
    ) -> Iterator[Sequence]:
        if not by_priority:
            yield from queue
            return
        now = self.clock()
        yield from sorted(queue, key=lambda s: self.urgency(s, now))
