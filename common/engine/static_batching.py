"""The static-batching baseline the benchmarks compare continuous batching against.

A batch of up to `max_num_seqs` is admitted only when the previous one has fully finished, each
member's whole lifetime (prompt + max_tokens) reserved up front. A member that finishes keeps its slot
as padding that is still computed (its last token again, nothing sampled), as in static-batching
servers such as Hugging Face `generate`; the batch's blocks go back when its last member finishes.
"""

from __future__ import annotations

from typing import Any

from common.engine.scheduler import Scheduler, SchedulerOutput
from common.engine.sequence import Sequence, SequenceStatus


class StaticBatchScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.padding: list[Sequence] = []  # finished members of the running batch, still computed

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running and not self.padding:
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                lifetime = seq.num_tokens + seq.params.max_tokens
                if not self.bm.can_allocate(seq, num_tokens=lifetime):
                    break
                self.waiting.popleft()
                self.bm.allocate(seq, num_tokens=lifetime)
                seq.num_computed_tokens = seq.num_cached_tokens
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
        budget = self.config.max_num_batched_tokens
        for seq in self.running:
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0:
                break
            out.scheduled.append((seq, n))
            budget -= n
        out.padding = list(self.padding)
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        """A member leaving the running batch keeps its slot (and blocks) as padding until the whole
        batch is done; anything else ends as in the core scheduler."""
        if seq.status is not SequenceStatus.RUNNING:
            super().finish(seq, reason)
            return
        seq.finish_reason = reason
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.padding.append(seq)
        if not self.running:
            for member in self.padding:
                self.bm.free(member)
            self.padding.clear()
