"""Which worker of a role gets a request: prefix-aware (the default with Redis) or least loaded.

Every service publishes the prefix-cache blocks it commits and evicts (KV events); the router's
`KVIndex` turns them into an approximate map of which worker holds which block hashes. For a prompt,
`prefix_chain` gives the hashes of its full blocks; a worker's hit is how many leading ones it holds.
Each candidate then gets a cost in blocks of work, lowest first:

    cost = prefix_weight * uncached_blocks + load_weight * (queued_blocks + sequences)

- uncached_blocks: the prompt's blocks the worker would have to compute (or receive): all of them minus
  its hit;
- queued_blocks: prompt tokens already waiting in its queue, in blocks (its heartbeat's
  `queued_tokens`);
- sequences: requests sharing its steps — the heartbeat's running + waiting, or this router's own count
  of requests it has on the worker when that is higher (the heartbeat is up to a second old).

Ties go to the least loaded (the `least_loaded` order). The index is approximate: a block may have been
evicted since its event, and the decode service's reservation says what it really reused. With
`routing="least_loaded"`, or a worker the index does not know, hits are 0 and only load counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from common.prefix_hash import prefix_chain


class PrefixIndex(Protocol):
    """What placement needs of the KV index (common.cluster.kv_events.KVIndex is one)."""

    def matched_blocks(self, worker_id: str, chain: list[int]) -> int: ...


@dataclass(frozen=True)
class Candidate:
    """A worker with the figures its place in the order came from."""

    worker: Any  # router.workers.Worker
    hit_blocks: int  # leading prompt blocks the index says the worker holds
    block_size: int  # the worker's (0: not known)
    cost: float

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size


def least_loaded_key(load: dict[str, Any], in_flight: int) -> tuple[int, int, int]:
    """The plain order: fewest queued requests, then most free blocks, then fewest of ours in flight."""
    queued = int(load.get("running", 0)) + int(load.get("waiting", 0))
    return (queued, -int(load.get("free_blocks", 0)), in_flight)


def rank(
    workers: Sequence[Any],
    prompt_ids: Sequence[int],
    index: PrefixIndex | None,
    in_flight: Counter[str],
    prefix_weight: float,
    load_weight: float,
) -> list[Candidate]:
    """`workers` (router.workers.Worker) as Candidates, cheapest first. With no index every hit is 0."""
    chains: dict[int, list[int]] = {}  # block size -> the prompt's chain (workers usually share one)
    out = []
    for w in workers:
        bs = int(w.capacity.get("block_size", 0) or 0)
        hit = 0
        if index is not None and bs > 0:
            chain = chains.get(bs)
            if chain is None:
                chain = chains[bs] = prefix_chain(prompt_ids, bs)
            hit = index.matched_blocks(w.id, chain) if chain else 0
        unit = bs or 16  # a worker that published no block size: count in 16-token blocks
        uncached = -(-(len(prompt_ids) - hit * bs) // unit)
        queued_blocks = int(w.load.get("queued_tokens", 0)) / unit
        seqs = max(int(w.load.get("running", 0)) + int(w.load.get("waiting", 0)), in_flight[w.url])
        cost = prefix_weight * uncached + load_weight * (queued_blocks + seqs)
        out.append(Candidate(w, hit, bs, cost))
    out.sort(key=lambda c: (c.cost, least_loaded_key(c.worker.load, in_flight[c.worker.url])))
    return out
