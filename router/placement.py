"""Phase 3: where a request runs. Which decode (and prefill) services it may go to, best first, and
its route: split (a prefill service computes the prompt and writes its KV into the decode service's
blocks) or local (the decode service prefills it itself), and why.

Worker choice is prefix-aware (the default with Redis) or least loaded. Every service publishes the
prefix-cache blocks it commits and evicts (KV events); the router's `KVIndex` turns them into an
approximate map of which worker holds which block hashes. For a prompt, `prefix_chain` gives the hashes
of its full blocks; a worker's hit is how many leading ones it holds. Each candidate then gets a cost in
blocks of work, lowest first:

    cost = prefix_weight * uncached_blocks + load_weight * (queued_blocks + sequences)

- uncached_blocks: the prompt's blocks the worker would have to compute (or receive): all of them minus
  its hit, where a hit block is worth what it saves (`tier_worth`): one held in the device pool a whole
  block, one in an offload tier (RAM, disk) 1 - read cost / recompute cost (nothing when recomputing
  that block is as cheap as reading it);
- queued_blocks: prompt tokens already waiting in its queue, in blocks: its heartbeat's
  `queued_tokens`, or when higher the prompt tokens this router has handed it and that it has not
  answered yet (`in_flight_tokens`: a prefill call's prompt, a local route's until its first token).
  The heartbeat is up to a second old and counts only the queue, not the prompt being computed: a
  service just handed a 1,500-token prompt looked as free as an idle one until its next heartbeat,
  so requests arriving in that second piled onto it;
- sequences: requests sharing its steps — the heartbeat's running + waiting, or this router's own count
  of requests it has on the worker when that is higher (the heartbeat is up to a second old).

A worker's hit (`TierMatch`) is counted the way its engine reuses a prompt: the run of leading blocks
its pool holds, then the run its tiers return (KV events name each hash's tier; a worker whose load
says `kv_tier_disk_reads: false` reads no disk hit now, its disk being dearer than recomputing, so
there a block on the disk only ends the run). The costs are
measured by the services and published in their load: `long_prefill_tps` (recompute: block_size /
long_prefill_tps seconds a block; the prefill speed on steps of long prompts, or `prefill_tps` until
the worker has computed one) and `kv_tier_read_ms` ({tier: ms a block read back, verified and put
into the pool, on every rank with tensor parallelism}); while
either is missing (a fresh service, a tier that has not been read yet) a tier block is worth
DEFAULT_TIER_WORTH of a device block, on the low side of what the tiers measure here (a RAM read is ~1%
of recomputing a block of SmolLM2 on CPU, a disk read a few %).

Ties go to the least loaded (the `least_loaded` order). The index is approximate: a block may have been
evicted since its event, and the decode service's reservation says what it really reused. With
`routing="least_loaded"`, or a worker the index does not know, hits are 0 and only load counts.

The route (conditional disaggregation, `choose_route`) weighs the prompt tokens the decode service would
compute itself: the whole prompt, less the prefix the index says it already holds. Below
`local_prefill_threshold`, or with no prefill service alive, it is local; the response header
`x-splitserve-route` says which and why.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from common.cluster.kv_events import DISK, RAM, TierMatch
from common.prefix_hash import ROOT, cache_root, prefix_chain
from common.runtime.telemetry import span_scope, tracer
from router.config import RouterConfig
from router.errors import unavailable
from router.output import Output

if TYPE_CHECKING:  # router.workers orders its lists with the functions here
    from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


DEFAULT_TIER_WORTH = {RAM: 0.8, DISK: 0.5}  # a tier block's worth while its costs are not measured


class PrefixIndex(Protocol):
    """What placement needs of the KV index (common.cluster.kv_events.KVIndex is one)."""

    def matched(self, worker_id: str, chain: list[int], disk: bool = True) -> TierMatch: ...


class Candidate(NamedTuple):
    """A worker with the figures its place in the order came from. (A tuple: made for every worker on
    every placement, and a frozen dataclass's __init__ costs ~1 us a field.)"""

    worker: Any  # router.workers.Worker
    hit_blocks: int  # leading prompt blocks the index says the worker would reuse (any tier)
    block_size: int  # the worker's (0: not known)
    cost: float
    tier_blocks: int = 0  # of hit_blocks, those read back from an offload tier (RAM, disk)
    tier_discount: float = 0.0  # hit blocks' worth lost to reading them from a tier, in blocks

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens the worker would not compute (what its engine reports as cached)."""
        return self.hit_blocks * self.block_size

    @property
    def worth_tokens(self) -> int:
        """hit_tokens less what reading the tier blocks costs, in tokens of prefill."""
        return round((self.hit_blocks - self.tier_discount) * self.block_size)


def tier_worth(load: dict[str, Any], tier: str, block_size: int) -> float:
    """What a block read from `tier` saves, as a fraction of recomputing it: 1 - read / recompute,
    from the worker's measured costs (module doc); 0 when recomputing is as cheap."""
    read_ms = (load.get("kv_tier_read_ms") or {}).get(tier)
    # recomputing a block costs what computing more of a long prompt does (steps of short prompts are
    # mostly fixed cost); a worker that has not computed a long prompt yet: its plain prefill speed
    tps = float(load.get("long_prefill_tps", 0) or 0) or float(load.get("prefill_tps", 0) or 0)
    if read_ms is None or tps <= 0:
        return DEFAULT_TIER_WORTH[tier]
    recompute_ms = block_size / tps * 1000
    return max(0.0, 1.0 - float(read_ms) / recompute_ms)


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
    root: int = ROOT,
    in_flight_tokens: Counter[str] | None = None,
) -> list[Candidate]:
    """`workers` (router.workers.Worker) as Candidates, cheapest first. With no index every hit is 0.
    `root`: the chain root of the request's cache salt (hits count only blocks of its own namespace).
    `in_flight_tokens`: per worker url, prompt tokens of this router's calls it has not answered."""
    chains: dict[int, list[int]] = {}  # block size -> the prompt's chain (workers usually share one)
    out, keys = [], []
    n_prompt = len(prompt_ids)
    # Every request ranks every worker of a role (48 decode services in bench fleet): plain locals, no
    # object per worker but its Candidate, and the sort on precomputed keys (~1.5x faster than the
    # same arithmetic through TierMatch totals, generators and a key function calling back in).
    for w in workers:
        load = w.load
        bs = int(w.capacity.get("block_size", 0) or 0)
        hit, tier, discount = 0, 0, 0.0
        if index is not None and bs > 0:
            chain = chains.get(bs)
            if chain is None:  # an engine leaves the last prompt token to compute: its block is never a hit
                chain = chains[bs] = prefix_chain(prompt_ids, bs, (n_prompt - 1) // bs, root)
            if chain:
                # a worker whose disk costs more than recomputing reads none of it (kv_tier_disk_reads)
                match = index.matched(w.id, chain, load.get("kv_tier_disk_reads", True) is not False)
                hit = match.device + match.ram + match.disk
                if match.ram or match.disk:
                    tier = match.ram + match.disk
                    for t, n in ((RAM, match.ram), (DISK, match.disk)):
                        if n:
                            discount += n * (1 - tier_worth(load, t, bs))
        unit = bs or 16  # a worker that published no block size: count in 16-token blocks
        uncached = -(-(n_prompt - hit * bs) // unit) + discount
        queued = int(load.get("queued_tokens", 0))
        if in_flight_tokens is not None:
            queued = max(queued, in_flight_tokens.get(w.url, 0))
        busy = int(load.get("running", 0)) + int(load.get("waiting", 0))
        mine = in_flight.get(w.url, 0)
        cost = prefix_weight * uncached + load_weight * (queued / unit + max(busy, mine))
        out.append(Candidate(w, hit, bs, cost, tier, discount))
        keys.append((cost, least_loaded_key(load, mine)))  # ties in cost: the plain order
    order = sorted(range(len(out)), key=keys.__getitem__)  # stable: the input order breaks full ties
    return [out[i] for i in order]


# ---- the route -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    path: str  # "split" | "local"
    # "long_prompt" | "short_prompt" | "cached_prefix" | "no_prefill_worker" | "prefill_failed" |
    # "shared_prefix" | "slo"
    reason: str
    prefix_hit: int = (
        0  # leading prompt blocks the chosen decode service would reuse (any tier), as the KV index says
    )
    prefill_hit: int = 0  # the same on the chosen prefill service (split path)
    tier_hit: int = 0  # of prefix_hit, the blocks the decode service would read back from an offload tier

    @property
    def header(self) -> str:
        h = "split" if self.path == "split" else f"local; reason={self.reason}"
        if self.prefix_hit:
            h += f"; prefix_hit={self.prefix_hit} blocks"
        if self.tier_hit:
            h += f"; tier_hit={self.tier_hit} blocks"
        if self.prefill_hit:
            h += f"; prefill_prefix_hit={self.prefill_hit} blocks"
        return h

    @property
    def record(self) -> str:
        return "split" if self.path == "split" else f"local:{self.reason}"


def choose_route(
    threshold: int,
    prompt_tokens: int,
    prefills: Sequence[Any],
    shared_prefix: bool = False,
    decode_hit: Candidate | None = None,
    prefill_hit: Candidate | None = None,
) -> Route:
    """Split or local, and why, for `threshold` (local_prefill_threshold): conditional disaggregation
    weighs the prompt tokens the decode service would compute itself, the whole prompt less the prefix
    the index says it already holds (a tier block counted at its worth: `Candidate.worth_tokens`)."""
    if shared_prefix:  # the decode service holds the prompt already (another choice of the request)
        return Route("local", "shared_prefix")
    hit = decode_hit.hit_blocks if decode_hit is not None else 0
    tier = decode_hit.tier_blocks if decode_hit is not None else 0
    if prompt_tokens < threshold:
        return Route("local", "short_prompt", hit, tier_hit=tier)
    if decode_hit is not None and prompt_tokens - decode_hit.worth_tokens < threshold:
        return Route("local", "cached_prefix", hit, tier_hit=tier)
    if not prefills:
        return Route("local", "no_prefill_worker", hit, tier_hit=tier)
    p_hit = prefill_hit.hit_blocks if prefill_hit is not None else 0
    return Route("split", "long_prompt", hit, p_hit, tier)


# ---- one request's placements --------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where a request goes: decode services best first, prefill services best first (none when the
    route cannot be split), and the route for placing it on the first of each."""

    decodes: tuple[Worker, ...]
    prefills: tuple[Worker, ...]
    route: Route


async def place(placer: Placer) -> Placement:
    """Phase 3, the request's first placement (the `router.route` span): its candidates, best first,
    and the route for the best of them. 503 when no decode service is available."""
    with span_scope(_tracer, "router.route") as span:
        decodes, prefills = await placer.candidates()
        decodes = placer.with_affinity(decodes)
        placer.route = route = placer.route_for(decodes, prefills)
        if span.is_recording():
            span.set_attributes({
                "splitserve.route": route.path,
                "splitserve.route.reason": route.reason,
                "splitserve.decode_candidates": len(decodes),
                "splitserve.prefill_candidates": len(prefills),
                "splitserve.prefix_hit_blocks": route.prefix_hit,
                "splitserve.prefill_prefix_hit_blocks": route.prefill_hit,
            })  # fmt: skip
    return Placement(tuple(decodes), tuple(prefills), route)


class Scores:
    """Each ranked worker's placement figures for the rest of a request, by (role, worker id), the
    latest ranking first. Kept as a few flat lists per ranking, not the Candidates: those are one object
    per worker of the fleet per request (64 in bench fleet), alive as long as the request, and each such
    object is one more the garbage collector's young passes walk and promote (they were about half the
    young objects in the router at 80 req/s)."""

    __slots__ = ("_rankings",)

    def __init__(self) -> None:
        # (role, worker id -> row, workers, hit blocks, block sizes, costs, tier blocks, tier discounts)
        self._rankings: list[tuple[str, dict[str, int], list[Any], list[int], list[int], list[float],
                                   list[int], list[float]]] = []  # fmt: skip

    def update(self, role: str, ranked: Sequence[Candidate]) -> None:
        cols = tuple(map(list, zip(*ranked, strict=True))) if ranked else ([],) * 6
        rows = {c.worker.id: i for i, c in enumerate(ranked)}
        self._rankings.insert(0, (role, rows, *cols))  # type: ignore[arg-type]

    def get(self, key: tuple[str, str]) -> Candidate | None:
        role, worker_id = key
        for r, rows, *cols in self._rankings:
            i = rows.get(worker_id) if r == role else None
            if i is not None:
                return Candidate(*(col[i] for col in cols))
        return None


class Placer:
    """What every placement of one request uses and remembers: the first (`place`) and any later one
    (router/trip.py: after a lost decode service, or when the prompt's decode service is full). A
    placement covers the prompt and any output already handed out (`output`)."""

    def __init__(
        self, pool: WorkerPool, config: RouterConfig, output: Output, cache_salt: str = "", model: str = ""
    ) -> None:
        self.pool, self.config, self.output = pool, config, output
        self.model = model  # the served model's name: its services only (router/workers.py)
        self.root = cache_root(cache_salt)  # prefix hits count only the request's own namespace
        self.route: Route | None = None  # the first placement's (what the response header says)
        self.lost: set[str] = set()  # decode services this request lost: never placed there again
        # A decode service holding the prompt: another choice of the same request ran its prefill there.
        # Placed there, locally, the prompt's full blocks come from its prefix cache (shared by
        # reference); only the last partial block is computed again. If it is full, placed as any.
        self.affinity: str | None = None
        self.slo_local = False  # SLO admission chose the local path: only it was predicted in time
        self.scored = Scores()  # (role, worker id) -> its placement figures

    async def candidates(self) -> tuple[list[Worker], list[Worker]]:
        """Decode and prefill candidates, best first, without the decode services this request lost."""
        ids = self.output.tokens
        try:
            decodes = [w for w in await self.pool.candidates("decode", self.model) if w.id not in self.lost]
            wants_prefill = len(ids) >= self.config.local_prefill_threshold and decodes
            prefills = await self.pool.candidates("prefill", self.model) if wants_prefill else []
        except Exception as e:  # the registry (Redis) is down: nothing can be routed
            log.exception("worker registry lookup failed")  # the cause: the log, never the client
            raise unavailable("worker registry unavailable", self.config.retry_after_s) from e
        if not decodes:
            serving = f" for model `{self.model}`" if self.model else ""
            raise unavailable(f"no decode service is available{serving}", self.config.retry_after_s)
        if self.config.routing == "prefix_aware":
            decodes, prefills = self._rank("decode", decodes, ids), self._rank("prefill", prefills, ids)
        return decodes, prefills

    def _rank(self, role: str, workers: list[Worker], ids: list[int]) -> list[Worker]:
        """`workers` cheapest first for this prompt (`rank`); remembers each one's figures."""
        cfg = self.config
        ranked = self.pool.rank(workers, ids, cfg.prefix_weight, cfg.load_weight, self.root)
        self.scored.update(role, ranked)
        return [c.worker for c in ranked]

    def route_for(self, decodes: Sequence[Worker], prefills: Sequence[Worker]) -> Route:
        """The route for placing on decodes[0] (through prefills[0] on the split path)."""
        d = self.scored.get(("decode", decodes[0].id)) if decodes else None
        p = self.scored.get(("prefill", prefills[0].id)) if prefills else None
        out = self.output
        if self.slo_local and not out.ids:
            return Route(
                "local", "slo", d.hit_blocks if d is not None else 0, tier_hit=d.tier_blocks if d else 0
            )
        shared = bool(decodes) and decodes[0].id == self.affinity and not out.ids
        threshold = self.config.local_prefill_threshold
        return choose_route(threshold, len(out.tokens), prefills, shared, d, p)

    def with_affinity(self, decodes: list[Worker]) -> list[Worker]:
        """The decode service holding the prompt first, if it is a candidate."""
        if self.affinity is None:
            return decodes
        return sorted(decodes, key=lambda w: w.id != self.affinity)  # stable: the rest keep their order

    def uncached(self, role: str, w: Worker) -> int:
        """Prompt tokens `w` would compute: all of them less the prefix the index says it holds (a
        tier block at its worth: reading it back costs part of a block's prefill)."""
        c = self.scored.get((role, w.id))
        return len(self.output.tokens) - (c.worth_tokens if c is not None else 0)
