"""The two collectives a sharded forward needs, behind one small interface.

`GlooCollective` runs them on a gloo process group of its own (no default group: several engines may
live in one process); the tests plug in an in-process fake world instead.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from common.parallel.partition import ShardLayout


class Collective(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over every rank (every rank gets it; x may be overwritten)."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's x (same shape) concatenated along the last dim, rank order.
        Other ranks: x itself (they have nothing to use it for)."""
        ...


@dataclass(frozen=True)
class TPRank:
    """A model shard's place in its group: what it holds and how it talks to the others."""

    layout: ShardLayout
    comm: Collective


def gloo_group(store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """A gloo group of `size` ranks on `store`, on the loopback interface (blocks until all joined)."""
    gloo = dist.ProcessGroupGloo
    opts = gloo._Options()  # type: ignore[attr-defined]  # the stubs name it Options; the binding _Options
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [gloo.create_device(hostname="127.0.0.1")]
    return gloo(store, rank, size, opts)


class GlooCollective:
    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.seconds = 0.0  # wall time in collectives (waiting for slower ranks included): `bench tp`
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        t0 = time.perf_counter()
        self.group.allreduce([x]).wait()
        self._count(t0)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        t0 = time.perf_counter()
        if self.rank != 0:
            self.group.gather([], [x], opts).wait()
            self._count(t0)
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.gather([parts], [x], opts).wait()
        self._count(t0)
        return torch.cat(parts, dim=-1)

    def _count(self, t0: float) -> None:
        self.seconds += time.perf_counter() - t0
        self.calls += 1


class Unconnected:
    """The collective of a shard that is only being built (its weights sliced, to be sent elsewhere)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this shard is not connected to its group")

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this shard is not connected to its group")
