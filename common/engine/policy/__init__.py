"""Queue policies: the order in which the scheduler serves queued work, and whom it preempts.

base.py is the interface (its hooks, when the scheduler calls them, what each side guarantees);
fcfs.py, priority.py and fair.py are the policies. `make_policy` picks one from the config, once.
"""

from __future__ import annotations

from collections.abc import Callable

from common.engine.policy.base import QueuePolicy, SchedulerView
from common.engine.policy.fair import FairShare
from common.engine.policy.fcfs import Fcfs
from common.engine.policy.priority import Priority
from common.engine.scheduler_config import SchedulerConfig

__all__ = ["FairShare", "Fcfs", "Priority", "QueuePolicy", "SchedulerView", "make_policy"]


def make_policy(config: SchedulerConfig, clock: Callable[[], float]) -> QueuePolicy:
    """The policy config.policy names. "static" (the baseline's own scheduler) admits in arrival order."""
    match config.policy:
        case "priority":
            return Priority(config, clock)
        case "fair":
            return FairShare(config, clock)
        case "fcfs" | "static":
            return Fcfs(config, clock)
