"""Which KV heads each prefill rank sends to each decode rank: pure functions, no torch.

A service with tensor parallelism holds each block's KV heads split over its ranks
(common/parallel/partition.kv_head_ranges: contiguous ranges, as even as possible; with more ranks than
KV heads a head is replicated on consecutive ranks). Prefill and decode may use different sizes. Every
head a decode rank holds must arrive from exactly one prefill rank that holds it (the first one, when
the prefill replicates it); the heads one prefill rank sends one decode rank form one contiguous range
on both sides, so each (prefill rank, decode rank) pair is one `HeadSlice` of every block.

    SmolLM2-135M (3 KV heads), prefill TP 1 -> decode TP 2:  p0 heads 0-1 -> d0,  p0 head 2 -> d1
    prefill TP 2 -> decode TP 1:  p0 heads 0-1 -> d0 (at 0),  p1 head 2 -> d0 (at 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from common.parallel.partition import kv_head_ranges
from common.protocol import KVDone


@dataclass(frozen=True)
class HeadSlice:
    """`count` consecutive KV heads: the sender's local heads src_start.. go to the receiver's local
    heads dst_start.. (local: indices within each side's shard)."""

    src_start: int
    dst_start: int
    count: int


@dataclass(frozen=True)
class Route:
    """One (prefill rank, decode rank) pair of a transfer and the heads it carries."""

    src_rank: int
    dst_rank: int
    heads: HeadSlice
    full: bool  # the slice is both shards whole: no re-slicing, the plain block layout


@dataclass(frozen=True)
class SaveItem:
    """One request's share of a step on every rank (picklable: it travels with the step)."""

    request_id: str
    fence: int
    endpoint: str  # the decode service's endpoints, one per decode rank, comma-separated
    src: list[int]
    dst: list[int]
    traceparent: str | None = None
    skip: tuple[int, ...] = ()  # per layer, leading pairs of src/dst not sent (out of the layer's window)
    # layer groups 1.. (common/kv/layer_groups.py): their pages for the same blocks as src/dst
    group_src: list[list[int]] = field(default_factory=list)
    group_dst: list[list[int]] = field(default_factory=list)


def layer_pairs(
    src: list[int],
    dst: list[int],
    skip: tuple[int, ...],
    layer: int,
    group: int = 0,
    group_src: list[list[int]] | None = None,
    group_dst: list[list[int]] | None = None,
) -> tuple[list[int], list[int]]:
    """The (src, dst) blocks a layer write sends: all of them (a layer of layer group `group` > 0: that
    group's pages, `group_src`/`group_dst`), less the leading ones the layer's sliding window has left
    behind (`skip`, per layer; () for none)."""
    if group:
        assert group_src is not None and group_dst is not None, f"layer {layer} is of group {group}"
        src, dst = group_src[group - 1], group_dst[group - 1]
    n = skip[layer] if skip else 0
    return (src, dst) if n == 0 else (src[n:], dst[n:])


def plan(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[Route]:
    """Every (prefill rank, decode rank) pair that moves KV, in (src, dst) order. ValueError when a side
    cannot be split (see kv_head_ranges)."""
    src = kv_head_ranges(num_kv_heads, src_tp)
    dst = kv_head_ranges(num_kv_heads, dst_tp)
    owner: dict[int, int] = {}  # head -> the first prefill rank holding it
    for r, heads in enumerate(src):
        for h in heads:
            owner.setdefault(h, r)
    routes: list[Route] = []
    for d, dheads in enumerate(dst):
        h = dheads.start
        while h < dheads.stop:  # runs of this decode rank's heads with one source rank
            p, start = owner[h], h
            while h < dheads.stop and owner[h] == p:
                h += 1
            s = HeadSlice(start - src[p].start, start - dheads.start, h - start)
            full = s.count == len(src[p]) == len(dheads)
            routes.append(Route(p, d, s, full))
    routes.sort(key=lambda r: (r.src_rank, r.dst_rank))
    return routes


def routes_from(num_kv_heads: int, src_tp: int, src_rank: int, dst_tp: int) -> list[Route]:
    """The pairs one prefill rank sends (to the decode ranks, in order)."""
    return [r for r in plan(num_kv_heads, src_tp, dst_tp) if r.src_rank == src_rank]


def senders_to(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> int:
    """How many prefill ranks write into decode rank `dst_rank` (each sends its own kv_done)."""
    return sum(1 for r in plan(num_kv_heads, src_tp, dst_tp) if r.dst_rank == dst_rank)


def split_endpoints(endpoint: str) -> list[str]:
    """A decode service's advertised KV endpoint: one per tensor-parallel rank, comma-separated, in
    rank order ("tcp://h:1/x,tcp://h:2/x"); one without tensor parallelism."""
    parts = [p.strip() for p in endpoint.split(",")]
    if not all(parts):
        raise ValueError(f"bad KV endpoint list {endpoint!r}")
    return parts


def shard_writes(
    num_kv_heads: int, src_tp: int, src_rank: int, endpoints: list[str]
) -> list[tuple[str, HeadSlice | None]]:
    """Where one prefill rank's layer writes go: (decode rank's endpoint, heads or None when the two
    shards are the same heads) for each decode rank it feeds; `endpoints` has one per decode rank."""
    return [
        (endpoints[r.dst_rank], None if r.full else r.heads)
        for r in routes_from(num_kv_heads, src_tp, src_rank, len(endpoints))
    ]


@dataclass
class Tally:
    """One decode rank's count of one (request, fence): the layer writes that landed, and the kv_dones
    heard with the layer writes their senders made."""

    layers: int = 0
    dones: int = 0
    writes: int = 0

    def hear_done(self, layer_writes: int, senders: int) -> str | None:
        """Count a kv_done (from one of `senders` prefill ranks). None: more are due; "": every sender's
        writes landed; otherwise why the KV is incomplete. Each sender's kv_done comes after its own
        layers (on its stream), so once all are heard every write that will land has."""
        self.dones += 1
        self.writes += layer_writes
        if self.dones < senders:
            return None
        if self.layers != self.writes:
            return f"KV incomplete: {self.layers} of {self.writes} layer writes arrived"
        return ""


def shard_dones(
    num_kv_heads: int, src_tp: int, src_rank: int, endpoint: str, done: KVDone, written: list[str]
) -> list[tuple[KVDone, str]]:
    """The kv_dones prefill rank `src_rank` sends for a request whose base notification is `done`:
    one per decode rank it feeds, each with the writes made to it (`written`: the endpoint of every
    layer write) and how many prefill ranks feed that decode rank."""
    eps = split_endpoints(endpoint)
    out = []
    for ep, _ in shard_writes(num_kv_heads, src_tp, src_rank, eps):
        senders = senders_to(num_kv_heads, src_tp, len(eps), eps.index(ep))
        n = sum(1 for w in written if w == ep)
        out.append((msgspec.structs.replace(done, layer_writes=n, src_rank=src_rank, senders=senders), ep))
    return out
