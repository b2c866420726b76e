"""The decode / prefill services a request may go to, and their order (router/placement.py).

Workers come from the Redis registry (heartbeat load: running, waiting, queued_tokens, free_blocks;
capacity: block_size, model, tokenizer), or from fixed URL lists. Each registered service serves one of
the router's models (`serve`, router/served_model.py): the one whose name, else model id, it registered;
with one model, every service whose tokenizer is the model's. A request's candidates are its model's.
The registry's load is up to a heartbeat old, so the router's own count of requests it has in flight on
each worker counts too (and is the only signal for fixed lists). With a KV index (Redis), every registry
read tells it which workers to follow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from common.cluster.state import ClusterState
from common.prefix_hash import ROOT
from router.placement import Candidate, PrefixIndex, least_loaded_key, rank

if TYPE_CHECKING:
    from router.served_model import ServedModel, ServedModels

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Worker:
    id: str
    url: str
    load: dict[str, Any] = field(default_factory=dict)
    incarnation: str = ""
    capacity: dict[str, Any] = field(default_factory=dict)  # block_size, total_blocks, max_num_seqs
    model: str = ""  # the served model's name (WorkerPool.serve); "" before any
    last_seen: float = 0.0  # its last heartbeat, as the registry says (0: a fixed list's)


class WorkerPool:
    """Candidates per role, best first. Static lists, when given, replace the registry for that role."""

    # The registry's figures are refreshed by heartbeats once a second, so re-reading them for every
    # request buys nothing but Redis round trips on the request path.
    CACHE_S = 0.25
    REFRESH_AHEAD_S = 0.5  # a list up to this old serves while the next is read (_fresh)
    STALE_S = 10.0  # how long a last known list outlives a registry that went unreadable or empty

    def __init__(
        self,
        state: ClusterState | None,
        decode_urls: list[str],
        prefill_urls: list[str],
        index: Any = None,  # common.cluster.kv_events.KVIndex: told the workers at every registry read
        tokenizer: str | None = None,  # the router's Tokenizer.fingerprint: others are left out
    ) -> None:
        self.state = state
        self.index = index
        self.tokenizer = tokenizer
        # worker id -> the tokenizer fingerprint it registered, for those left out for it (logged once each)
        self.other_tokenizer: dict[str, str] = {}
        self.models: tuple[ServedModel, ...] = ()  # what the router serves (`serve`); () : not told
        # worker id -> the model it registered, for those left out because the router serves no such model
        self.other_model: dict[str, str] = {}
        self.static = {"decode": list(decode_urls), "prefill": list(prefill_urls)}
        self.in_flight: Counter[str] = Counter()  # worker url -> requests this router has on it
        # worker url -> prompt tokens of this router's calls it has not answered (prefill calls)
        self.in_flight_tokens: Counter[str] = Counter()
        self._cache: dict[str, tuple[float, list[Worker]]] = {}  # role -> (read at, workers)
        self._known: dict[str, list[Worker]] = {}  # role -> the last non-empty list read
        # role -> when its registry read first came back empty or failed since that list (None: it did not)
        self._lost_since: dict[str, float | None] = {}
        self.stale_reads = 0  # candidates served from the last known list (Redis away or emptied)
        self._incarnations: dict[str, str] = {}  # worker id -> the process start last seen
        self._following: dict[str, list[tuple[str, str, int]]] = {}  # role -> what the index follows
        self._turn = 0  # candidates() calls: where ties start (round-robin)
        self._reading: dict[str, asyncio.Future[list[Worker]]] = {}  # role -> its registry read under way
        # worker id -> (its heartbeat as last read, when) for those a call could not reach (`suspect`)
        self._suspect: dict[str, tuple[float, float]] = {}

    def serve(self, models: ServedModels) -> None:
        """The router's models: each registered service is sorted to one of them (or left out)."""
        self.models = models.models
        self.tokenizer = models.default.info.tokenizer.fingerprint
        self._cache.clear()

    async def candidates(self, role: str, model: str | None = None) -> list[Worker]:
        """Workers of `role` (of the served model named `model`; None: of every model), best first.
        When the registry (Redis) cannot be read, or comes back empty
        (restarted: workers re-register within a heartbeat), the last list read serves for up to
        STALE_S from the first such read — however long ago that list was read: a router that routed
        nothing for a while has no older news of its workers than a busy one. A down or restarted Redis
        must not stop routing. With no list yet, the error propagates."""
        if self.static[role]:  # a fixed list keeps its order among equals: the first listed first
            workers = [Worker(url, url) for url in self.static[role]]
        elif self.state is not None:
            workers = await self._fresh(role)
            # Ties in the registry's list (the same load as of the last heartbeat and none of ours in
            # flight: every idle worker of a fleet between two heartbeats) go round-robin: each call
            # starts one further on, so they do not all pile onto the first id (the sorts are stable).
            if workers:
                self._turn += 1
                k = self._turn % len(workers)
                workers = self._unsuspected(workers[k:] + workers[:k])
        else:
            workers = []
        if model is not None and len(self.models) > 1:  # with one model, every worker serves it
            workers = [w for w in workers if w.model == model]
        return sorted(workers, key=self._key)

    async def _fresh(self, role: str) -> list[Worker]:
        """The registry's `role` list, read by one read at a time (callers meanwhile share it), in the
        background once the list is half of CACHE_S old, so that under traffic a new list is in before
        the old one is CACHE_S old and a placement does not wait on Redis (an await there lets every
        other task of the router run first: that was the placement time's p99, bench fleet). A
        non-empty list up to REFRESH_AHEAD_S old serves while a read is under way; an older or empty one
        (the router's first request, or after a quiet spell) waits for the read."""
        at, workers = self._cache.get(role, (0.0, []))
        age = time.monotonic() - at
        task = self._reading.get(role)
        if age > self.CACHE_S / 2 and (task is None or task.done()):
            task = self._reading[role] = asyncio.ensure_future(self._read(role))
            # retrieved, so that a failed read nobody awaited is not reported as never retrieved (with
            # no list yet _read raises; the next read that is awaited raises it to its caller)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        if task is None or (workers and age <= self.REFRESH_AHEAD_S):
            return workers  # fresh enough (no read was due), or recent and a read is under way
        return await asyncio.shield(task)

    SUSPECT_FOR_S = 600.0  # a suspicion nobody clears (the worker never heartbeats again) is dropped
    # cleared once the worker's heartbeat is this far past the one read before the failure: a dead
    # worker's last beats (up to a heartbeat after the list the router read, itself up to 0.5 s old)
    # must not count as "back"
    HEARTBEATS_BACK_S = 3.0

    def suspect(self, w: Worker) -> None:
        """A call to `w` could not connect, or broke off: leave it out of the candidates until its
        heartbeat moves on (HEARTBEATS_BACK_S past the one read before). A dead worker's registry entry
        outlives it by the entry's lifetime, and every request placed there meanwhile would pay a
        failed call; a worker that had a blip is back within a few heartbeats. Registry workers only
        (a fixed list has no heartbeat)."""
        if w.last_seen:
            self._suspect[w.id] = (w.last_seen, time.monotonic())

    def _unsuspected(self, workers: list[Worker]) -> list[Worker]:
        """`workers` without the suspected ones whose heartbeat has not moved on (all of them if that
        would leave none: a suspicion never stops routing)."""
        if not self._suspect:
            return workers
        now, out = time.monotonic(), []
        for w in workers:
            seen, since = self._suspect.get(w.id, (None, 0.0))
            if seen is not None and (
                w.last_seen > seen + self.HEARTBEATS_BACK_S or now - since > self.SUSPECT_FOR_S
            ):
                del self._suspect[w.id]  # it heartbeat since: reachable again (or too old to hold)
                seen = None
            if seen is None:
                out.append(w)
        return out or workers

    def known(self, role: str) -> int:
        """How many `role` workers the router routes on now, as of its last registry read (every routed
        request and every /health reads it, at most once per CACHE_S): the last known list while it
        serves stale; a static list's length. 0 before the first read. Never touches Redis: read at
        scrape time."""
        if self.static.get(role):
            return len(self.static[role])
        return len(self._cache.get(role, (0.0, []))[1])

    async def _read(self, role: str) -> list[Worker]:
        assert self.state is not None
        now = time.monotonic()
        known = self._known.get(role, [])
        try:
            alive = await self.state.registry.alive(role)
            workers = []
            for info in alive:
                served = self._model_of(info.id, role, info.capacity)
                if served is not False:
                    name = served.name if served is not None else ""
                    url = info.url.rstrip("/")
                    workers.append(
                        Worker(info.id, url, info.load, info.incarnation, info.capacity, name, info.last_seen)
                    )
        except Exception as e:
            if role not in self._known:
                raise
            log.warning("worker registry unreadable (%r): routing on the last known %s list", e, role)
            workers = []
        if workers:
            for w, was in ((w, self._incarnations.get(w.id)) for w in workers):
                if was and was != w.incarnation:
                    log.warning("%s %s restarted (incarnation %s -> %s)", role, w.id, was, w.incarnation)
                self._incarnations[w.id] = w.incarnation
            self._known[role] = workers
            self._lost_since[role] = None
            if self.index is not None:
                self._follow(role, workers)
        elif known:
            lost = self._lost_since.get(role)
            if lost is None:
                self._lost_since[role] = lost = now
            if now - lost < self.STALE_S:
                self.stale_reads += 1
                workers = known
        self._cache[role] = (now, workers)
        return workers

    def _model_of(
        self, worker_id: str, role: str, capacity: dict[str, Any]
    ) -> ServedModel | None | Literal[False]:
        """The served model a registered service belongs to: the one whose name it registered (its
        capacity's `model`), else whose model id; with one model, that one whatever name it registered
        (a service started without the router's --served-model-name). False: left out, for a model this
        router does not serve or a tokenizer not the model's (`_same_tokenizer`). None: the router was
        not told its models (`serve`), the service taken on its tokenizer alone."""
        if not self.models:
            return None if self._same_tokenizer(worker_id, role, capacity, self.tokenizer) else False
        registered = capacity.get("model")
        served = next((m for m in self.models if m.name == registered), None) or next(
            (m for m in self.models if registered in m.aliases), None
        )
        if served is None and len(self.models) == 1:
            served = self.models[0]
        if served is None:
            if self.other_model.get(worker_id) != registered:
                log.error(
                    "%s %s serves model %r, which this router does not serve (%s): not routing to it",
                    role, worker_id, registered, ", ".join(m.name for m in self.models),
                )  # fmt: skip
                self.other_model[worker_id] = str(registered)
            return False
        fingerprint = served.info.tokenizer.fingerprint
        return served if self._same_tokenizer(worker_id, role, capacity, fingerprint) else False

    def _same_tokenizer(self, worker_id: str, role: str, capacity: dict[str, Any], ours: str | None) -> bool:
        """Whether a registered service's token ids mean what this router's do (its signed capacity's
        `tokenizer`, common/text/tokenizer.py `fingerprint`): prompts tokenized here and tokens decoded
        here would be another model's text there, with no error anywhere. A service of a version that
        registers none is taken (a rolling upgrade)."""
        theirs = capacity.get("tokenizer")
        if ours is None or theirs is None or theirs == ours:
            return True
        if self.other_tokenizer.get(worker_id) != theirs:
            log.error(
                "%s %s serves another tokenizer (%s, %s here: model %r): not routing to it",
                role, worker_id, theirs, ours, capacity.get("model"),
            )  # fmt: skip
            self.other_tokenizer[worker_id] = theirs
        return False

    def untrusted(self) -> int:
        """Registry entries left out because their signature is missing or wrong (forged: written
        straight into Redis), since start (common/cluster/registry.py)."""
        registry = getattr(self.state, "registry", None)
        return sum(getattr(registry, "untrusted", {}).values())

    def _follow(self, role: str, workers: list[Worker]) -> None:
        """Tell the KV index which workers exist now (both roles: it follows their union)."""
        assert self.index is not None
        self._following[role] = [(w.id, w.incarnation, int(w.capacity.get("block_size", 0))) for w in workers]
        self.index.set_workers([w for ws in self._following.values() for w in ws])

    def _key(self, w: Worker) -> tuple[int, int, int]:
        return least_loaded_key(w.load, self.in_flight[w.url])

    def rank(
        self,
        workers: list[Worker],
        prompt_ids: list[int],
        prefix_weight: float,
        load_weight: float,
        root: int = ROOT,
    ) -> list[Candidate]:
        """`workers` cheapest first for this prompt: prefix hits (when the pool has a KV index, counted
        under the chain root of the request's cache salt) against load (router/placement.py)."""
        index: PrefixIndex | None = self.index
        tokens = self.in_flight_tokens
        return rank(workers, prompt_ids, index, self.in_flight, prefix_weight, load_weight, root, tokens)

    def hold(self, worker: Worker, tokens: int = 0) -> None:
        """Count a request of ours against `worker` (until release), and `tokens` of prompt work it
        has to do for it before its first token (a prefill call's prompt, or a local route's on a decode
        service: until `done_tokens` or release)."""
        self.in_flight[worker.url] += 1
        if tokens:
            self.in_flight_tokens[worker.url] += tokens

    def release(self, worker: Worker, tokens: int = 0) -> None:
        self.in_flight[worker.url] -= 1
        if self.in_flight[worker.url] <= 0:
            del self.in_flight[worker.url]
        self.done_tokens(worker, tokens)

    def done_tokens(self, worker: Worker, tokens: int) -> None:
        """`tokens` of prompt work held on `worker` are done (its first token came), the request stays."""
        if tokens:
            self.in_flight_tokens[worker.url] -= tokens
            if self.in_flight_tokens[worker.url] <= 0:
                del self.in_flight_tokens[worker.url]
