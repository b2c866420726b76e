"""Prefix-aware placement (router/placement.py) and the route it leads to (Orchestrator.route), with a
small in-memory index standing in for the KV index (its own tests run against Redis:
tests/integration/test_kv_events.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
import redis.asyncio as aioredis

from common.cluster.kv_events import KVIndex, TierMatch
from common.cluster.registry import WorkerInfo
from common.prefix_hash import prefix_chain
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator, Route
from router.placement import DEFAULT_TIER_WORTH, Candidate, Scores, choose_route, rank, tier_worth
from router.workers import Worker, WorkerPool

BS = 16


class SetIndex:
    """worker id -> the block hashes it holds."""

    def __init__(self, held: dict[str, set[int]]) -> None:
        self.held = held

    def matched(self, worker_id: str, chain: list[int], disk: bool = True) -> TierMatch:
        n = 0
        for h in chain:
            if h not in self.held.get(worker_id, set()):
                break
            n += 1
        return TierMatch(device=n)


def worker(wid: str, running: int = 0, waiting: int = 0, queued_tokens: int = 0, free: int = 100) -> Worker:
    load = {"running": running, "waiting": waiting, "queued_tokens": queued_tokens, "free_blocks": free}
    return Worker(wid, f"http://{wid}", load, "inc", {"block_size": BS})


PROMPT = list(range(1000, 1000 + 40 * BS + 5))  # 40 full blocks and a partial one
CHAIN = prefix_chain(PROMPT, BS)


def test_the_worker_holding_the_prefix_wins_against_a_little_load() -> None:
    index = SetIndex({"d1": set(CHAIN[:30])})
    ranked = rank([worker("d0"), worker("d1", running=3)], PROMPT, index, Counter(), 1.0, 1.0)
    assert [c.worker.id for c in ranked] == ["d1", "d0"]
    assert ranked[0].hit_blocks == 30 and ranked[0].hit_tokens == 30 * BS
    # 41 blocks to compute (40 full + the partial one) less 30 held, plus 3 running sequences
    assert ranked[0].cost == pytest.approx(11 + 3) and ranked[1].cost == pytest.approx(41)


def test_enough_load_outweighs_the_prefix() -> None:
    index = SetIndex({"d1": set(CHAIN[:30])})
    busy = worker("d1", running=10, queued_tokens=40 * BS)  # 40 blocks of prompts waiting
    ranked = rank([worker("d0"), busy], PROMPT, index, Counter(), 1.0, 1.0)
    assert [c.worker.id for c in ranked] == ["d0", "d1"]
    # a higher prefix weight brings it back
    ranked = rank([worker("d0"), busy], PROMPT, index, Counter(), 3.0, 1.0)
    assert ranked[0].worker.id == "d1"


def test_only_leading_blocks_count_and_the_router_in_flight_count_is_load() -> None:
    index = SetIndex({"d0": set(CHAIN[1:])})  # everything but the first block: no prefix at all
    ranked = rank([worker("d0"), worker("d1")], PROMPT, index, Counter({"http://d1": 2}), 1.0, 1.0)
    assert ranked[0].worker.id == "d0" and ranked[0].hit_blocks == 0
    assert ranked[1].cost == pytest.approx(41 + 2)  # two of ours there since its last heartbeat


def test_prompt_work_of_ours_in_flight_counts_until_the_heartbeat_shows_it() -> None:
    """A prefill service just handed a long prompt still heartbeats an empty queue for up to a second
    (and never counts the prompt it is computing): the router's own unanswered prompt tokens on it
    count as its queue, the heartbeat's when that is higher."""
    p0, p1 = worker("p0", running=1), worker("p1", running=1)
    ours = Counter({"http://p0": 1})
    tokens = Counter({"http://p0": 30 * BS})  # a 30-block prompt of ours p0 has not answered yet
    ranked = rank([p0, p1], PROMPT, None, ours, 1.0, 1.0, in_flight_tokens=tokens)
    assert [c.worker.id for c in ranked] == ["p1", "p0"]
    assert ranked[1].cost == pytest.approx(41 + 30 + 1) and ranked[0].cost == pytest.approx(41 + 1)
    # the heartbeat's queue wins when it is the higher
    busy = worker("p1", running=1, queued_tokens=35 * BS)
    ranked = rank([p0, busy], PROMPT, None, ours, 1.0, 1.0, in_flight_tokens=tokens)
    assert [c.worker.id for c in ranked] == ["p0", "p1"] and ranked[1].cost == pytest.approx(41 + 35 + 1)


def test_the_pool_counts_prompt_tokens_held_until_released() -> None:
    pool = WorkerPool(_State([]), [], [])  # type: ignore[arg-type]
    w = worker("p0")
    pool.hold(w, 500)
    pool.hold(w, 300)
    pool.hold(w)  # a decode stream: no prompt work
    assert pool.in_flight[w.url] == 3 and pool.in_flight_tokens[w.url] == 800
    pool.release(w, 500)
    pool.release(w)
    assert pool.in_flight[w.url] == 1 and pool.in_flight_tokens[w.url] == 300
    pool.release(w, 300)
    assert w.url not in pool.in_flight and w.url not in pool.in_flight_tokens
    # a local route's prompt on a decode service: its work is done at token 1, the stream stays
    pool.hold(w, 200)
    pool.done_tokens(w, 200)
    assert pool.in_flight[w.url] == 1 and w.url not in pool.in_flight_tokens
    pool.release(w)
    assert w.url not in pool.in_flight


def test_without_an_index_it_is_least_loaded() -> None:
    ranked = rank([worker("d0", running=2), worker("d1", running=1)], PROMPT, None, Counter(), 1.0, 1.0)
    assert [c.worker.id for c in ranked] == ["d1", "d0"] and all(c.hit_blocks == 0 for c in ranked)


def _orch(threshold: int = 32) -> Orchestrator:
    config = RouterConfig(local_prefill_threshold=threshold)
    return Orchestrator(config, None, httpx.AsyncClient(), RouterMetrics(), "router-test")


@pytest.mark.parametrize(
    ("held", "want"),
    [
        (0, Route("split", "long_prompt")),
        (20, Route("split", "long_prompt", 20)),
        # 40 of 41 blocks held: 5 tokens left to compute, under the threshold
        (40, Route("local", "cached_prefix", 40)),
    ],
)
def test_conditional_disaggregation_weighs_the_uncached_tail(held: int, want: Route) -> None:
    index = SetIndex({"d0": set(CHAIN[:held])})
    (d,) = rank([worker("d0")], PROMPT, index, Counter(), 1.0, 1.0)
    (p,) = rank([worker("p0")], PROMPT, index, Counter(), 1.0, 1.0)
    assert _orch().route(len(PROMPT), [p.worker], decode_hit=d, prefill_hit=p) == want


def test_the_route_header_names_the_hits() -> None:
    assert Route("split", "long_prompt").header == "split"
    assert (
        Route("split", "long_prompt", 3, 7).header
        == "split; prefix_hit=3 blocks; prefill_prefix_hit=7 blocks"
    )
    assert Route("local", "cached_prefix", 40).header == "local; reason=cached_prefix; prefix_hit=40 blocks"
    assert Route("local", "cached_prefix", 40).record == "local:cached_prefix"


class TierIndex:
    """worker id -> {hash: tier}; matched as the KV index does (pool run, then tier run)."""

    def __init__(self, held: dict[str, dict[int, str]]) -> None:
        self.held = held

    def matched(self, worker_id: str, chain: list[int], disk: bool = True) -> TierMatch:
        tiers = [self.held.get(worker_id, {}).get(h) for h in chain]
        n = {"device": 0, "ram": 0, "disk": 0}
        for t in tiers:
            if t is None or (t == "device" and n["ram"] + n["disk"]) or (t == "disk" and not disk):
                break
            n[t] += 1
        return TierMatch(**n)


def tiered(wid: str, prefill_tps: float = 0.0, **read_ms: float) -> Worker:
    w = worker(wid)
    w.load.update(prefill_tps=prefill_tps, kv_tier_read_ms=read_ms)
    return w


def test_a_tier_hit_is_worth_what_it_saves_against_recomputing() -> None:
    # 1600 prompt tokens/s: a 16-token block takes 10 ms to recompute
    ram = TierIndex({"d1": dict.fromkeys(CHAIN[:30], "ram")})
    cheap, dear = tiered("d1", 1600, ram=1.0), tiered("d1", 1600, ram=25.0)
    ranked = rank([worker("d0"), cheap], PROMPT, ram, Counter(), 1.0, 1.0)
    assert [c.worker.id for c in ranked] == ["d1", "d0"]
    assert ranked[0].hit_blocks == 30 and ranked[0].tier_blocks == 30  # what the engine would reuse...
    assert ranked[0].cost == pytest.approx(11 + 30 * 0.1)  # ...at 1 ms read for 10 ms of compute
    assert ranked[0].worth_tokens == round(30 * 0.9 * BS)
    # a tier read slower than recomputing is worth nothing: the cost of no hit, the hit still predicted
    (slow,) = rank([dear], PROMPT, ram, Counter(), 1.0, 1.0)
    assert slow.cost == pytest.approx(41) and slow.hit_blocks == 30 and slow.worth_tokens == 0
    # not measured yet (a fresh service): the documented defaults
    (fresh,) = rank([tiered("d1")], PROMPT, ram, Counter(), 1.0, 1.0)
    assert fresh.cost == pytest.approx(11 + 30 * (1 - DEFAULT_TIER_WORTH["ram"]))


def test_a_tier_block_is_weighed_against_the_prefill_speed_of_long_prompts() -> None:
    """Recomputing a block costs what computing more of a long prompt does: `long_prefill_tps` when the
    worker published one (its `prefill_tps` over every step is mostly short steps' fixed cost)."""
    load = {"prefill_tps": 160.0, "kv_tier_read_ms": {"ram": 5.0}}  # 100 ms a block by the plain figure
    assert tier_worth(load, "ram", BS) == pytest.approx(0.95)
    load["long_prefill_tps"] = 1600.0  # 10 ms a block on long prompts
    assert tier_worth(load, "ram", BS) == pytest.approx(0.5)


def test_a_pool_hit_beats_the_same_hit_on_disk_and_the_route_counts_tiers() -> None:
    held = {"d0": dict.fromkeys(CHAIN[:20], "device"), "d1": dict.fromkeys(CHAIN[:20], "disk")}
    held["d0"].update(dict.fromkeys(CHAIN[20:30], "ram"))
    ranked = rank(
        [tiered("d1", 1600, disk=5.0), tiered("d0", 1600, ram=1.0)], PROMPT, TierIndex(held), Counter(), 1, 1
    )
    assert [(c.worker.id, c.hit_blocks, c.tier_blocks) for c in ranked] == [("d0", 30, 10), ("d1", 20, 20)]
    route = choose_route(24, len(PROMPT), [worker("p0")], decode_hit=ranked[0])
    assert route == Route("split", "long_prompt", 30, 0, 10)
    assert route.header == "split; prefix_hit=30 blocks; tier_hit=10 blocks"


def test_a_worker_reading_no_disk_now_is_predicted_no_disk_hit() -> None:
    """A worker whose load says `kv_tier_disk_reads: false` (its disk costs more than recomputing, so
    its engine computes disk hits instead) is predicted no hit for its disk-only blocks, on the real KV
    index's memory side; one that reads its disk is predicted all of them."""
    index = KVIndex(aioredis.Redis(), "t:")  # never connects: only the memory side is used here
    index.set_workers([("d1", "inc", BS)])
    index.workers["d1"].hashes = dict.fromkeys(CHAIN[:20], 4)  # the disk tier's bit only
    reads, skips = tiered("d1", 1600, disk=1.0), tiered("d1", 1600, disk=1.0)
    reads.load["kv_tier_disk_reads"], skips.load["kv_tier_disk_reads"] = True, False
    (r,) = rank([reads], PROMPT, index, Counter(), 1.0, 1.0)
    (s,) = rank([skips], PROMPT, index, Counter(), 1.0, 1.0)
    assert (r.hit_blocks, r.tier_blocks) == (20, 20) and (s.hit_blocks, s.tier_blocks) == (0, 0)
    assert s.cost == pytest.approx(41) and r.cost < s.cost


def test_the_last_prompt_token_block_is_never_predicted() -> None:
    whole = PROMPT[: 40 * BS]  # whole blocks: the engine computes the last one again (one token to sample)
    index = TierIndex({"d0": dict.fromkeys(prefix_chain(whole, BS), "device")})
    (c,) = rank([worker("d0")], whole, index, Counter(), 1.0, 1.0)
    assert c.hit_blocks == 39


class _Registry:
    """The registry's answer: the same workers, sorted by id, every read (what Redis would return)."""

    def __init__(self, infos: list[WorkerInfo]) -> None:
        self.infos = infos

    async def alive(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.infos if w.role == role]


class _State:
    def __init__(self, infos: list[WorkerInfo]) -> None:
        self.registry = _Registry(infos)


def test_equally_loaded_registry_workers_are_taken_in_turn_not_the_first_every_time() -> None:
    """Between two heartbeats every idle worker of a fleet looks the same: ties go round-robin (the
    bench fleet saw 5 of 12 decode services used, one with 44 % of the requests, before this)."""
    load = {"running": 0, "waiting": 0, "queued_tokens": 0, "free_blocks": 100}
    infos = [
        WorkerInfo(f"d{i}", "decode", f"http://d{i}", "", {"block_size": BS}, dict(load), 0.0)
        for i in range(4)
    ]
    infos.append(WorkerInfo("d9", "decode", "http://d9", "", {"block_size": BS}, {**load, "running": 3}, 0.0))
    pool = WorkerPool(_State(infos), [], [])  # type: ignore[arg-type]

    def candidates() -> list[Worker]:
        return asyncio.run(pool.candidates("decode"))

    firsts = [candidates()[0].id for _ in range(8)]
    assert sorted(set(firsts)) == ["d0", "d1", "d2", "d3"]  # each idle one in turn; never the busy d9
    assert all(firsts.count(w) == 2 for w in set(firsts))
    lists = [[w.id for w in candidates()] for _ in range(2)]
    assert all(ids[-1] == "d9" for ids in lists)  # load still orders first
    # ours in flight still count before the turn: a worker holding one of our requests goes after
    pool.hold(candidates()[0])
    held = next(iter(pool.in_flight))
    assert all(candidates()[0].url != held for _ in range(4))


def test_a_placement_does_not_wait_on_the_registry_while_it_has_a_recent_list() -> None:
    """One registry read at a time; while it runs, a recent list serves at once (the read lands for the
    next placement); with no recent list, callers wait for that same read."""

    class SlowRegistry(_Registry):
        def __init__(self, infos: list[WorkerInfo]) -> None:
            super().__init__(infos)
            self.reads = self.done = 0  # reads started, reads answered
            self.gate = asyncio.Event()
            self.moved = asyncio.Event()  # set when either count moves

        async def alive(self, role: str) -> list[WorkerInfo]:
            self.reads += 1
            self.moved.set()
            await self.gate.wait()
            self.done += 1
            self.moved.set()  # the waiter runs after this read's task has landed its list
            return await super().alive(role)

    def info(wid: str) -> WorkerInfo:
        return WorkerInfo(wid, "decode", f"http://{wid}", "", {"block_size": BS}, {}, 0.0)

    async def scenario() -> None:
        state = _State([info("d0")])
        registry = state.registry = SlowRegistry(state.registry.infos)

        async def until(cond: Callable[[], bool]) -> None:
            """Wait until cond holds (a read started, or answered and landed): each count's move wakes it."""
            while not cond():
                registry.moved.clear()
                await asyncio.wait_for(registry.moved.wait(), 5)

        pool = WorkerPool(state, [], [])  # type: ignore[arg-type]
        first = asyncio.gather(*(pool.candidates("decode") for _ in range(3)))
        await until(lambda: registry.reads == 1)
        registry.gate.set()
        assert [[w.id for w in ws] for ws in await first] == [["d0"]] * 3 and registry.reads == 1
        registry.gate.clear()
        registry.infos.append(info("d1"))
        pool.CACHE_S = 0.0  # the list is "old" from now on, but recent enough to serve ahead
        served = await asyncio.wait_for(pool.candidates("decode"), 1.0)  # the read is blocked: no wait
        assert [w.id for w in served] == ["d0"] and registry.reads == 2
        await pool.candidates("decode")
        assert registry.reads == 2  # still one read under way
        registry.gate.set()
        await until(lambda: registry.done == 2)
        assert sorted(w.id for w in await pool.candidates("decode")) == ["d0", "d1"]
        pool.REFRESH_AHEAD_S = 0.0  # no recent list: the caller waits for the read
        registry.gate.clear()
        reads = registry.reads
        waiting = asyncio.ensure_future(pool.candidates("decode"))
        await until(lambda: registry.reads > reads)
        assert not waiting.done()
        registry.gate.set()
        assert len(await waiting) == 2

    asyncio.run(scenario())


def test_a_worker_that_could_not_be_reached_is_left_out_until_it_heartbeats_again() -> None:
    """A dead worker's registry entry outlives it: after a call to it fails to connect it is no
    candidate until its heartbeat moves on (a blip) — unless that would leave no candidate at all."""

    def info(wid: str, seen: float) -> WorkerInfo:
        return WorkerInfo(wid, "prefill", f"http://{wid}", "", {"block_size": BS}, {}, seen)

    state = _State([info("p0", 100.0), info("p1", 100.0)])
    pool = WorkerPool(state, [], [])  # type: ignore[arg-type]
    pool.CACHE_S = pool.REFRESH_AHEAD_S = 0.0  # every call reads the registry

    def ids() -> list[str]:
        return sorted(w.id for w in asyncio.run(pool.candidates("prefill")))

    p0 = next(w for w in asyncio.run(pool.candidates("prefill")) if w.id == "p0")
    pool.suspect(p0)
    assert ids() == ["p1"] and ids() == ["p1"]  # its entry is still there, its heartbeat has not moved
    state.registry.infos[0] = info("p0", 101.0)  # a last beat before it died: not "back"
    assert ids() == ["p1"]
    pool.suspect(next(w for w in asyncio.run(pool.candidates("prefill")) if w.id == "p1"))
    assert ids() == ["p0", "p1"]  # both suspected: routing goes on with both
    state.registry.infos[0] = info("p0", 104.0)  # p0 heartbeats on, well past its failure: reachable
    assert ids() == ["p0"]  # p1 still silent since its failure
    state.registry.infos[1] = info("p1", 104.0)
    assert ids() == ["p0", "p1"]


def test_scores_keep_each_rankings_figures_the_latest_first() -> None:
    """A request's placement figures (Placer.scored) per (role, worker id): a later ranking's win, a
    worker it no longer ranks (a lost decode service) keeps its earlier figures, roles never mix."""
    a, b, c = (Worker(f"w{i}", f"http://127.0.0.1:{9000 + i}") for i in range(3))
    scores = Scores()
    assert scores.get(("decode", "w0")) is None
    first = [Candidate(a, 2, 16, 1.5, 1, 0.25), Candidate(b, 0, 16, 3.0)]
    scores.update("decode", first)
    scores.update("prefill", [Candidate(a, 5, 32, 0.5)])
    scores.update("decode", [Candidate(b, 1, 16, 2.0), Candidate(c, 0, 0, 9.0)])
    scores.update("prefill", [])
    assert scores.get(("decode", "w0")) == first[0]  # not ranked again: the first ranking's
    assert scores.get(("decode", "w1")) == Candidate(b, 1, 16, 2.0)  # the latest
    assert scores.get(("decode", "w2")) == Candidate(c, 0, 0, 9.0)
    assert scores.get(("prefill", "w0")) == Candidate(a, 5, 32, 0.5)
    assert scores.get(("prefill", "w1")) is None
