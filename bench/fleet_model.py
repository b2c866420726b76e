"""A fleet of simulated prefill and decode workers in virtual time, for `splitserve bench planner`.

Why not the real engine: it can be driven at the engine level (SimEngine with the runner's sleeps skipped;
`add_request(..., remote_kv="receive")` then `kv_arrived` for a decode worker), but one step of the real
scheduler, block manager and runner costs about 1.4 ms of wall time for a 9 ms virtual decode step of 16
sequences (measured on the 2-core development machine), and an hour of ten workers is millions of steps:
hours to replay, for each of the runs the fixed-split search makes. This is a compact per-worker
continuous-batching model instead, whose every step is timed by the profile's roofline
(common/engine/sim_profile.py `step_seconds`, the same arithmetic as `--engine sim`):

- Prefill worker: a FIFO queue of prompts (the router places a prompt on the ready prefill worker with
  the fewest queued tokens); each step packs up to `prefill_tokens_per_step` prompt tokens, chunking the
  prompt at the head (rows (n new, c cached) as the scheduler's chunked prefill makes them). A prompt's
  last chunk yields its first token: TTFT = end of that step - arrival.
- Decode worker: on the first token the request goes to the ready decode worker with the most free KV
  blocks, queues for admission there (FCFS), reserves blocks for its whole length (prompt + output: no
  preemption is modelled, which the engine would do instead of waiting) and at most `decode_max_seqs`
  sequences; its KV then arrives after the link model's time (prompt KV bytes / bandwidth + latency) and
  it joins the running batch at the next step boundary. A step decodes one token for every running
  sequence; its time is the roofline of those rows (`DecodeCost`: from their count and total context,
  equal to `step_seconds` over the rows). The steps between two changes of the batch are one event (a
  "run", until the first sequence finishes; an arrival ends it early at the next boundary), their times
  added up in closed form, so an hour of a fleet costs events per request, not per step.
  TPOT = (last token - first token) / (output tokens - 1), the wait for admission included.
- Workers: ready after `startup_s` from when they are asked for; one scaled away drains (takes no new
  work, finishes what it holds) and is gone when empty. A worker costs from when it is asked for until it
  is gone, starting and draining included (`worker_seconds`).

Batch limits are an H100 deployment's, not the engine's CPU defaults (512 tokens, 16 sequences a step):
`prefill_tokens_per_step` 8192, `decode_max_seqs` 256; the KV block count is the profile's
(`SimProfile.kv_blocks`, 28019 blocks of 16 tokens for llama3-8b-h100).

The planner's signals (bench/planner.py) come from the same figures the live services publish: each prefill
worker's speed (a `StepSpeed` of its own, fed each step as the engine feeds it: the average tokens per
second and the fit of step time against tokens, whose full step is the worker's capacity) and queued
prompt tokens, the prompt tokens of the requests whose
first token came (the router's counter), each decode worker's admitted sequences (its `running`) and
those waiting for admission.

Everything is deterministic: the event queue breaks ties by insertion order and the workload is drawn
from a seed (bench/planner.py).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from common.engine.sim_profile import SimProfile, step_seconds
from common.engine.speed import StepSpeed


@dataclass(frozen=True)
class FleetConfig:
    profile: SimProfile
    block_size: int = 16
    prefill_tokens_per_step: int = 8192
    decode_max_seqs: int = 256
    link_bytes_per_s: float = 50e9  # 400 Gb/s
    link_latency_s: float = 0.001
    startup_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("block_size", "prefill_tokens_per_step", "decode_max_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.link_bytes_per_s > 0 or self.link_latency_s < 0 or self.startup_s < 0:
            raise ValueError("link_bytes_per_s must be positive, link_latency_s and startup_s not negative")

    @property
    def kv_blocks(self) -> int:
        return self.profile.kv_blocks(self.block_size)

    def transfer_s(self, prompt_tokens: int) -> float:
        return (
            prompt_tokens * self.profile.model.kv_bytes_per_token / self.link_bytes_per_s
            + self.link_latency_s
        )


class DecodeCost:
    """`step_seconds` of decode rows (1 new token each) from their count and total context alone (a decode
    row's attention term n*c + n(n+1)/2 is c + 1), and the time of `j` consecutive steps of a batch that
    does not change: step k has `context + k * batch` cached tokens, so each roofline term is linear in k
    and their max switches at most once (`run_seconds`, closed form, equal to adding the steps up)."""

    def __init__(self, profile: SimProfile) -> None:
        m, tp, gpu, eff = profile.model, profile.tensor_parallel_size, profile.gpu, profile.efficiency
        self.flops_s = 1 / (tp * gpu.peak_flops * eff.flops)
        self.bytes_s = 1 / (tp * gpu.memory_bandwidth * eff.bandwidth)
        self.per_token_flops = 2 * m.num_params
        self.attn = 4 * m.num_layers * m.num_heads * m.head_dim
        self.weights, self.kv = m.weight_bytes, m.kv_bytes_per_token
        self.overhead = eff.step_overhead_s

    def lines(self, batch: int, context: int) -> tuple[float, float, float, float]:
        """(a1, b1, a2, b2): step k's compute time a1 + b1 k and memory time a2 + b2 k."""
        x = context + batch
        a1 = (self.per_token_flops * batch + self.attn * x) * self.flops_s
        a2 = (self.weights + self.kv * x) * self.bytes_s
        return a1, self.attn * batch * self.flops_s, a2, self.kv * batch * self.bytes_s

    def step(self, batch: int, context: int) -> float:
        if batch == 0:
            return 0.0
        a1, _, a2, _ = self.lines(batch, context)
        return max(a1, a2) + self.overhead

    def run_seconds(self, lines: tuple[float, float, float, float], j: int) -> float:
        """Seconds of the first `j` steps whose terms are `lines`."""
        if j <= 0:
            return 0.0
        a1, b1, a2, b2 = lines
        (a, b), (c, d) = ((a1, b1), (a2, b2)) if a1 >= a2 else ((a2, b2), (a1, b1))
        split = j  # steps 0 .. split-1 on the line that starts on top, the rest on the other
        if d > b:
            split = min(j, math.floor((a - c) / (d - b)) + 1)
        return _series(a, b, 0, split) + _series(c, d, split, j) + j * self.overhead


def _series(a: float, b: float, k0: int, k1: int) -> float:
    """Sum of a + b k for k in [k0, k1)."""
    n = k1 - k0
    return 0.0 if n <= 0 else n * a + b * n * (k0 + k1 - 1) / 2


class Request:
    __slots__ = ("arrival", "prompt", "output", "prefilled", "first_at", "done_at", "blocks", "join_step")

    def __init__(self, arrival: float, prompt: int, output: int) -> None:
        if prompt < 1 or output < 2:
            raise ValueError(
                f"a request needs a prompt of 1+ tokens and 2+ output tokens, got {prompt}, {output}"
            )
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.prefilled = 0
        self.first_at: float | None = None
        self.done_at: float | None = None
        self.blocks = 0
        self.join_step = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_at is None or self.done_at is None:
            return None
        return (self.done_at - self.first_at) / (self.output - 1)


@dataclass(eq=False, slots=True)
class Worker:
    role: str
    asked_at: float
    ready_at: float
    draining: bool = False
    gone_at: float | None = None
    busy: bool = False  # a step is in flight
    step_t0: float = 0.0  # when the step in flight started (prefill)
    speed: StepSpeed = field(default_factory=StepSpeed)  # its prefill steps, as the engine measures them
    # prefill
    queue: deque[Request] = field(default_factory=deque)
    queued_tokens: int = 0
    # decode
    free_blocks: int = 0
    admit: deque[Request] = field(default_factory=deque)
    admit_blocks: int = 0  # the blocks the admission queue will reserve
    held: int = 0  # sequences admitted (reserved), transferring or running
    joining: list[Request] = field(default_factory=list)
    running: int = 0
    context: int = 0  # cached tokens of the running sequences at their next step
    step_no: int = 0  # decode steps done
    version: int = 0  # of the run in flight (an arrival that ends it early makes its event stale)
    run_t0: float = 0.0
    run_steps: int = 0
    run_lines: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    finishing: list[tuple[int, int, Request]] = field(default_factory=list)  # heap: last step, tie, request

    def ready(self, now: float) -> bool:
        return self.ready_at <= now and not self.draining and self.gone_at is None

    def empty(self) -> bool:
        if self.role == "prefill":
            return not self.queue and not self.busy
        return self.held == 0 and not self.admit and not self.busy


ARRIVE, PSTEP, DSTEP, XFER, READY, TICK = range(6)


class Fleet:
    """The event loop (module doc). `tick(now, fleet)` is called every `tick_s` (the planner's interval)."""

    def __init__(self, config: FleetConfig, prefill: int, decode: int, at: float = 0.0) -> None:
        if prefill < 1 or decode < 1:
            raise ValueError(f"a fleet needs at least one worker of each role, got {prefill} and {decode}")
        self.cfg = config
        self.profile = config.profile
        self.total_blocks = config.kv_blocks
        self.cost = DecodeCost(config.profile)
        self.decode_steps = 0
        self.now = at
        self.start = at
        self.workers: list[Worker] = []
        self._ready: dict[str, list[Worker]] = {}
        self._events: list[tuple[float, int, int, object]] = []
        self._tie = itertools.count()
        self.requests: list[Request] = []
        # since the last take_signals(): first tokens' TTFTs and finished requests' TPOTs
        self._ttfts: list[float] = []
        self._tpots: list[float] = []
        # of the requests whose first token came: the router's splitserve_router_prompt_tokens, which it
        # counts at the first token
        self.prompt_tokens = 0
        self.count_changes: list[tuple[float, int, int]] = []  # (when, ready prefill, ready decode)
        for _ in range(prefill):
            self._add("prefill", ready_now=True)
        for _ in range(decode):
            self._add("decode", ready_now=True)
        self._note_counts()

    # ---- workers -------------------------------------------------------------------------------------

    def _add(self, role: str, ready_now: bool = False) -> Worker:
        ready_at = self.now if ready_now else self.now + self.cfg.startup_s
        w = Worker(role, self.now, ready_at, free_blocks=self.total_blocks if role == "decode" else 0)
        self.workers.append(w)
        self._ready.clear()
        if not ready_now:
            self._push(ready_at, READY, w)
        return w

    def live(self, role: str) -> list[Worker]:
        """Workers of the role asked for and not scaled away (starting or ready)."""
        return [w for w in self.workers if w.role == role and not w.draining and w.gone_at is None]

    def ready(self, role: str) -> list[Worker]:
        """Ready workers of the role that take new work (cached: only _add, scale and READY change it)."""
        cached = self._ready.get(role)
        if cached is None:
            cached = self._ready[role] = [w for w in self.workers if w.role == role and w.ready(self.now)]
        return cached

    def scale(self, role: str, n: int) -> None:
        """Ask for `n` workers of the role: start new ones, or take away the newest still starting, then
        drain the ready ones holding the least work."""
        if n < 0:
            raise ValueError(f"worker count must not be negative, got {n}")
        live = self.live(role)
        for _ in range(n - len(live)):
            self._add(role)
        extra = len(live) - n
        if extra <= 0:
            return
        starting = sorted((w for w in live if w.ready_at > self.now), key=lambda w: -w.asked_at)
        load = (lambda w: w.queued_tokens) if role == "prefill" else (lambda w: w.held + len(w.admit))
        ready = sorted((w for w in live if w.ready_at <= self.now), key=load)
        self._ready.clear()
        for w in (starting + ready)[:extra]:
            w.draining = True
            if w.ready_at > self.now or w.empty():
                w.gone_at = self.now
        self._note_counts()

    def _note_counts(self) -> None:
        counts = (len(self.ready("prefill")), len(self.ready("decode")))
        if not self.count_changes or self.count_changes[-1][1:] != counts:
            self.count_changes.append((self.now, *counts))

    def worker_seconds(self, since: float, until: float) -> float:
        """Worker time in [since, until]: from being asked for until gone, starting and draining included."""
        total = 0.0
        for w in self.workers:
            end = until if w.gone_at is None else min(w.gone_at, until)
            total += max(0.0, end - max(w.asked_at, since))
        return total

    # ---- the loop -----------------------------------------------------------------------------------

    def _push(self, at: float, kind: int, obj: object) -> None:
        heapq.heappush(self._events, (at, next(self._tie), kind, obj))

    def run(
        self,
        arrivals: list[tuple[float, int, int]],
        until: float,
        tick: Callable[[float, Fleet], None] | None = None,
        tick_s: float = 15.0,
        first_tick: float | None = None,
    ) -> None:
        """Replay (arrival time, prompt tokens, output tokens) until `until`, calling `tick` every
        `tick_s` from `first_tick` (default: the fleet's start + tick_s)."""
        if tick is not None:
            self._push(first_tick if first_tick is not None else self.start + tick_s, TICK, None)
        source = iter(arrivals)
        nxt = next(source, None)
        if nxt is not None:
            self._push(nxt[0], ARRIVE, nxt)
        events = self._events
        while events and events[0][0] <= until:
            at, _, kind, obj = heapq.heappop(events)
            self.now = at
            if kind == DSTEP:
                self._decode_run_end(obj)  # type: ignore[arg-type]
            elif kind == PSTEP:
                self._prefill_step_end(obj)  # type: ignore[arg-type]
            elif kind == ARRIVE:
                t, prompt, output = cast(tuple[float, int, int], obj)
                self._arrive(Request(t, prompt, output))
                nxt = next(source, None)
                if nxt is not None:
                    if nxt[0] < t:
                        raise ValueError("arrivals must be in time order")
                    self._push(nxt[0], ARRIVE, nxt)
            elif kind == XFER:
                self._kv_arrived(obj)  # type: ignore[arg-type]
            elif kind == READY:
                w = cast(Worker, obj)
                self._ready.clear()
                if w.gone_at is None:
                    self._note_counts()
                    self._on_ready(w)
            elif kind == TICK:
                assert tick is not None
                tick(at, self)
                self._push(at + tick_s, TICK, None)
        self.now = until

    def take_signals(self) -> tuple[list[float], list[float]]:
        """TTFTs of the first tokens and TPOTs of the requests finished since the previous call."""
        out = (self._ttfts, self._tpots)
        self._ttfts, self._tpots = [], []
        return out

    # ---- prefill ------------------------------------------------------------------------------------

    def _arrive(self, r: Request) -> None:
        self.requests.append(r)
        ready = self.ready("prefill")
        if not ready:  # every prefill worker is starting: wait on the one ready first
            live = self.live("prefill")
            ready = [min(live, key=lambda w: w.ready_at)] if live else []
        if not ready:
            raise RuntimeError("no prefill worker asked for: the floor must keep one")
        w = min(ready, key=lambda w: w.queued_tokens)
        w.queue.append(r)
        w.queued_tokens += r.prompt
        if not w.busy and w.ready_at <= self.now:
            self._prefill_step(w)

    def _prefill_step(self, w: Worker) -> None:
        budget, rows = self.cfg.prefill_tokens_per_step, []
        for r in w.queue:
            n = min(r.prompt - r.prefilled, budget)
            rows.append((n, r.prefilled))
            budget -= n
            if budget == 0:
                break
        w.busy, w.step_t0 = True, self.now
        self._push(self.now + step_seconds(self.profile, rows), PSTEP, (w, rows))

    def _prefill_step_end(self, obj: tuple[Worker, list[tuple[int, int]]]) -> None:
        w, rows = obj
        w.busy = False
        w.speed.observe(self.now - w.step_t0, sum(n for n, _ in rows), 0)  # as the engine's step does
        for n, _ in rows:
            r = w.queue[0]
            r.prefilled += n
            w.queued_tokens -= n
            if r.prefilled < r.prompt:
                break  # the chunked head: more next step
            w.queue.popleft()
            r.first_at = self.now
            self.prompt_tokens += r.prompt
            self._ttfts.append(self.now - r.arrival)
            self._to_decode(r)
        if w.queue and w.ready_at <= self.now:
            self._prefill_step(w)
        elif w.draining and w.gone_at is None and w.empty():
            w.gone_at = self.now

    def _on_ready(self, w: Worker) -> None:
        if w.role == "decode":
            self._admit(w)
        elif w.queue and not w.busy:
            self._prefill_step(w)

    # ---- decode -------------------------------------------------------------------------------------

    def _to_decode(self, r: Request) -> None:
        ready = self.ready("decode")
        if not ready:
            live = self.live("decode")
            ready = [min(live, key=lambda w: w.ready_at)] if live else []
        if not ready:
            raise RuntimeError("no decode worker asked for: the floor must keep one")
        w = max(ready, key=lambda w: w.free_blocks - w.admit_blocks)
        r.blocks = -(-(r.prompt + r.output) // self.cfg.block_size)
        if r.blocks > self.total_blocks:
            raise ValueError(
                f"a request of {r.prompt + r.output} tokens needs more KV blocks than a worker has"
            )
        w.admit.append(r)
        w.admit_blocks += r.blocks
        self._admit(w)

    def _admit(self, w: Worker) -> None:
        if w.ready_at > self.now:
            return
        while w.admit and w.admit[0].blocks <= w.free_blocks and w.held < self.cfg.decode_max_seqs:
            r = w.admit.popleft()
            w.admit_blocks -= r.blocks
            w.free_blocks -= r.blocks
            w.held += 1
            self._push(self.now + self.cfg.transfer_s(r.prompt), XFER, (w, r))

    def _kv_arrived(self, obj: tuple[Worker, Request]) -> None:
        """The KV is in: the sequence joins the batch at the next step boundary."""
        w, r = obj
        w.joining.append(r)
        if not w.busy:
            self._decode_run(w)
            return
        # the run in flight: its first boundary at or after now (at least one step in) ends it early
        lo, hi = 1, w.run_steps
        while lo < hi:
            mid = (lo + hi) // 2
            if w.run_t0 + self.cost.run_seconds(w.run_lines, mid) >= self.now:
                hi = mid
            else:
                lo = mid + 1
        if lo < w.run_steps:
            w.run_steps = lo
            w.version += 1
            self._push(w.run_t0 + self.cost.run_seconds(w.run_lines, lo), DSTEP, (w, w.version))

    def _decode_run(self, w: Worker) -> None:
        """Join what arrived, then run steps until the first sequence finishes: one event for the run,
        each step's time still its own roofline (DecodeCost.run_seconds); an arrival ends it early."""
        for r in w.joining:
            r.join_step = w.step_no
            w.running += 1
            w.context += r.prompt  # token 0 (from the prefill) is the first row's new token
            heapq.heappush(w.finishing, (w.step_no + r.output - 2, next(self._tie), r))
        w.joining.clear()
        if w.running == 0:
            return
        w.busy = True
        w.run_t0, w.run_steps = self.now, w.finishing[0][0] - w.step_no + 1
        w.run_lines = self.cost.lines(w.running, w.context)
        w.version += 1
        self._push(self.now + self.cost.run_seconds(w.run_lines, w.run_steps), DSTEP, (w, w.version))

    def _decode_run_end(self, obj: tuple[Worker, int]) -> None:
        w, version = obj
        if version != w.version:
            return  # a run that an arrival ended early
        w.busy = False
        w.step_no += w.run_steps
        w.context += w.running * w.run_steps
        self.decode_steps += w.run_steps
        done = w.finishing
        while done and done[0][0] < w.step_no:
            r = heapq.heappop(done)[2]
            r.done_at = self.now
            assert r.first_at is not None
            self._tpots.append((self.now - r.first_at) / (r.output - 1))
            w.running -= 1
            w.held -= 1
            w.context -= r.prompt + w.step_no - r.join_step
            w.free_blocks += r.blocks
        self._admit(w)
        if w.running or w.joining:
            self._decode_run(w)
        elif w.draining and w.gone_at is None and w.empty():
            w.gone_at = self.now

    # ---- signals ------------------------------------------------------------------------------------

    def waiting(self, role: str) -> int:
        """Requests queued on the role's ready workers: prompts not started (prefill), sequences waiting
        for admission (decode)."""
        if role == "prefill":
            return sum(len(w.queue) for w in self.workers if w.role == role and w.gone_at is None)
        return sum(len(w.admit) for w in self.workers if w.role == role and w.gone_at is None)

    def queued_tokens(self) -> int:
        """Prompt tokens not yet computed on the prefill workers (the services' `queued_tokens`)."""
        return sum(w.queued_tokens for w in self.workers if w.role == "prefill" and w.gone_at is None)

    def prefill_capacity(self) -> float | None:
        """The ready prefill workers' mean tokens per second at a full step, by each one's fit of its steps
        (`full_step_tps`, as planner/signals.py reads it from the services' loads); None before any step."""
        budget = self.cfg.prefill_tokens_per_step
        speeds = [v for w in self.ready("prefill") if (v := w.speed.full_step_tps(budget)) > 0]
        return sum(speeds) / len(speeds) if speeds else None

    def running(self) -> int:
        """Sequences admitted on the ready decode workers: reserved, transferring or running, counted
        against `decode_max_seqs` as the engine's `running` is."""
        return sum(w.held for w in self.ready("decode"))

    def kv_used(self) -> float:
        ready = self.ready("decode")
        total = self.total_blocks * len(ready)
        return 0.0 if total == 0 else sum(self.total_blocks - w.free_blocks for w in ready) / total
