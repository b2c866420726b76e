"""Policy "fair": deficit round robin over tenants, without torch (a fake runner as in test_scheduler)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import EngineConfig
from common.engine.policy.fair import FORGET_TENANT_S, FairShare
from common.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from common.engine.sequence import Sequence, SequenceStatus
from common.kv.block_manager import BlockManager
from common.sampling_params import SamplingParams


def fake_run(out: SchedulerOutput, token: int = 7) -> list[int | None]:
    """A token for each sequence whose step reaches its last token (no EOS: max_tokens ends them)."""
    return [token if s.num_computed_tokens + n == s.num_tokens else None for s, n in out.scheduled]


def make(num_blocks: int = 256, block_size: int = 4, clock=None, **cfg) -> Scheduler:  # type: ignore[no-untyped-def]
    cfg.setdefault("policy", "fair")
    return Scheduler(
        SchedulerConfig(**cfg), BlockManager(num_blocks, block_size), (), clock=clock or (lambda: 0.0)
    )


_starts = iter(range(1000, 10**9, 997))  # distinct prompts: no prefix-cache hits between sequences


def seq(tenant: str, n_prompt: int = 8, max_tokens: int = 1, **kw) -> Sequence:  # type: ignore[no-untyped-def]
    start = next(_starts)
    return Sequence(
        list(range(start, start + n_prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        tenant=tenant,
        **kw,
    )


def fair(s: Scheduler) -> FairShare:
    """The scheduler's fair-share policy, whose bookkeeping some tests read."""
    assert isinstance(s.policy, FairShare)
    return s.policy


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.postprocess(out, fake_run(out))
    s.bm.check_integrity()
    return out


def tenants_of(seqs: list[Sequence]) -> str:
    return "".join(x.tenant for x in seqs)


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def test_equal_weights_alternate_tenants_although_one_queued_ten_times_more() -> None:
    s = make(max_num_seqs=64, fair_quantum_tokens=8)  # one 8-token prompt per turn
    for _ in range(20):
        s.add(seq("a"))
    s.add(seq("b"))
    s.add(seq("b"))
    out = s.schedule()
    assert tenants_of(out.admitted) == "abab" + "a" * 18, "b waits for one a, not for twenty"


def test_alternation_holds_step_after_step() -> None:
    s = make(max_num_seqs=2, fair_quantum_tokens=8)
    for _ in range(30):
        s.add(seq("a"))
    for _ in range(3):
        s.add(seq("b"))
    admitted = [tenants_of(step(s).admitted) for _ in range(5)]
    assert admitted[:3] == ["ab", "ab", "ab"] and admitted[3:] == ["aa", "aa"]


def test_a_big_quantum_serves_a_round_of_tokens_per_tenant() -> None:
    # the default quantum is the step budget: a turn is worth that many tokens, not one request
    s = make(max_num_seqs=64, max_num_batched_tokens=32)
    for _ in range(8):
        s.add(seq("a"))
    for _ in range(8):
        s.add(seq("b"))
    order = ""
    while s.has_work():
        order += tenants_of(step(s).admitted)
    assert order == "aaaabbbbaaaabbbb"


def test_weights_three_to_one_share_the_tokens_three_to_one() -> None:
    s = make(max_num_seqs=4, max_num_batched_tokens=64, fair_quantum_tokens=8, tenant_weights={"a": 3})
    admitted = {"a": 0, "b": 0}
    for _ in range(200):
        for t in "ab":  # both stay backlogged
            while sum(x.tenant == t for x in s.waiting) < 4:
                s.add(seq(t, max_tokens=4))
        for x in step(s).admitted:
            admitted[x.tenant] += x.num_prompt_tokens
    assert admitted["a"] / admitted["b"] == pytest.approx(3, rel=0.1)
    served = s.tenant_served
    assert served["a"] / served["b"] == pytest.approx(3, rel=0.1), "decode tokens are billed too"


def test_jain_index_of_served_tokens_under_equal_weights() -> None:
    """A floods with long requests first, then B queues short ones: both backlogged all along."""

    def served_shares(policy: str) -> list[float]:
        s = make(policy=policy, max_num_seqs=4, max_num_batched_tokens=64)
        for _ in range(100):
            s.add(seq("a", n_prompt=32, max_tokens=8))
        for _ in range(300):
            s.add(seq("b", n_prompt=8, max_tokens=2))
        for _ in range(150):
            step(s)
        assert {x.tenant for x in s.waiting} == {"a", "b"}, "both still backlogged"
        return [float(s.tenant_served["a"]), float(s.tenant_served["b"])]

    assert jain(served_shares("fair")) >= 0.95
    assert jain(served_shares("fcfs")) < 0.6, "the flood takes everything without the fair policy"


def test_priority_orders_inside_a_tenant_not_across_tenants() -> None:
    s = make(max_num_seqs=64, fair_quantum_tokens=8)
    a_late, a_urgent, a_mid = seq("a", priority=5), seq("a", priority=0), seq("a", priority=2)
    b = seq("b", priority=9)
    for x in (a_late, a_urgent, a_mid, b):
        s.add(x)
    out = s.schedule()
    assert out.admitted == [a_urgent, b, a_mid, a_late], "b's low priority does not lose its turn"


def test_aging_lets_a_low_priority_request_through_a_stream_of_urgent_ones() -> None:
    now = [0.0]
    s = make(max_num_seqs=1, aging_s=1.0, clock=lambda: now[0])
    low = seq("a", priority=5, arrival_time=0.0)
    s.add(low)
    order = []
    for t in range(12):
        now[0] = float(t)
        s.add(seq("a", priority=0, arrival_time=float(t)))
        order += step(s).admitted
    assert low in order and order.index(low) >= 3


def test_an_idle_tenant_banks_no_credit() -> None:
    s = make(max_num_seqs=2, fair_quantum_tokens=8)
    for _ in range(60):
        s.add(seq("a"))
    for _ in range(10):  # b is idle while a alone is served
        assert tenants_of(step(s).admitted) == "aa"
    assert "b" not in fair(s)._deficit
    for _ in range(10):
        s.add(seq("b"))
    # b arrives after an idle period: one quantum up front (one 8-token prompt: its first request goes
    # next, as a new flow in FQ-CoDel), then its share, not a burst for the ten steps it was idle
    assert [tenants_of(step(s).admitted) for _ in range(6)] == ["bb", "ab", "ab", "ab", "ab", "ab"]


def test_a_tenant_whose_queue_empties_loses_its_credit() -> None:
    s = make(max_num_seqs=64, fair_quantum_tokens=40)
    s.add(seq("a"))  # one 8-token prompt against 40 tokens of credit
    for _ in range(4):
        s.add(seq("b"))
    out = s.schedule()
    assert tenants_of(out.admitted) == "abbbb"
    assert "a" not in fair(s)._deficit and "a" not in fair(s)._rr, "the 32 tokens a did not use are gone"
    s.add(seq("a"))
    # back with one quantum, the one any tenant gets when its request arrives to an empty queue, ahead
    # of b (whose turn it was): not the 32 tokens it left unused
    assert fair(s)._deficit["a"] == 40 and fair(s)._rr[0] == "a"


def test_a_deep_debt_never_leaves_capacity_idle(caplog: pytest.LogCaptureFixture) -> None:
    # a's decode tokens are billed while its next request waits: 200 tokens of debt at 1 token a round
    s = make(max_num_seqs=1, fair_quantum_tokens=1)
    first, second = seq("a", max_tokens=200), seq("a")
    s.add(first)
    s.add(second)
    while not first.is_finished:
        assert step(s).admitted != [second]
    assert fair(s)._deficit["a"] < -150
    assert step(s).admitted == [second], "admitted at the first step a slot is free"
    assert not caplog.records, "the skipped rounds found it credit, not the fallback"


def test_decode_tokens_are_billed_once_and_prefill_chunks_not_again() -> None:
    s = make(policy="fcfs", max_num_batched_tokens=5)  # the 12-token prompt runs in three chunks
    a, b = seq("a", n_prompt=12, max_tokens=4), seq("b", n_prompt=3, max_tokens=1)
    s.add(a)
    s.add(b)
    while s.has_work():
        step(s)
    assert s.tenant_served == {"a": 12 + 3, "b": 3}, "the prompt, then one per decode step (not the last)"


def test_the_victim_comes_from_the_tenant_furthest_over_its_share() -> None:
    def first_victim(policy: str, **cfg: object) -> Sequence:
        s = make(
            num_blocks=8, block_size=2, policy=policy, max_num_seqs=4, preemption_mode="recompute", **cfg
        )
        seqs = [seq("a", n_prompt=4, max_tokens=4) for _ in range(3)] + [seq("b", n_prompt=4, max_tokens=4)]
        for x in seqs:
            s.add(x)
        step(s)  # four prompts of two blocks each fill the cache; every decode needs a third block
        out = step(s)
        assert len(out.preempted) >= 1
        return out.preempted[0]

    victim = first_victim("fair")
    assert victim.tenant == "a", "a holds six blocks, b two"
    assert first_victim("fcfs").tenant == "b", "fcfs preempts the latest arrival"
    assert first_victim("fair", tenant_weights={"a": 4}).tenant == "b", "a's share is four times b's"


def test_a_preempted_sequence_goes_back_to_the_front_of_its_tenants_queue() -> None:
    s = make(num_blocks=8, block_size=2, max_num_seqs=4, preemption_mode="recompute")
    seqs = [seq("a", n_prompt=4, max_tokens=4) for _ in range(4)]
    for x in seqs:
        s.add(x)
    step(s)
    out = step(s)
    victim = out.preempted[0]
    assert victim.status is SequenceStatus.WAITING
    urgent = seq("a", priority=-10)
    s.add(urgent)
    order: list[Sequence] = []
    while s.has_work():
        order += step(s).admitted
    assert order.index(victim) < order.index(urgent)
    assert s.tenant_served["a"] == 4 * (4 + 3) + 8, "a recompute is not billed again"


def test_reservations_follow_the_fair_order() -> None:
    s = make(max_num_seqs=64, fair_quantum_tokens=8)
    for _ in range(10):
        s.add(seq("a", max_tokens=2, remote_kv="receive"))
    for _ in range(2):
        s.add(seq("b", max_tokens=2, remote_kv="receive"))
    out = s.schedule()
    assert tenants_of(out.admitted) == "abab" + "a" * 8
    assert all(x.status is SequenceStatus.PARKED for x in out.admitted) and not out.scheduled
    assert s.tenant_served == {"a": 80, "b": 16}, "a reservation bills its prompt"
    x = out.admitted[0]
    assert s.kv_arrived(x, first_token=5) is None
    step(s)  # token 0 came with the KV: the decode step computing it is billed, the prompt not again
    assert x.is_finished and s.tenant_served["a"] == 81


def test_local_and_remote_queues_share_one_round() -> None:
    # a's reservations are looked at first every step, yet b's local prompts get every other turn
    s = make(max_num_seqs=8, fair_quantum_tokens=8)
    for _ in range(10):
        s.add(seq("a", remote_kv="receive"))
        s.add(seq("b"))
    assert [tenants_of(step(s).admitted) for _ in range(3)] == ["ab", "ab", "ab"]


def test_queued_tokens_counts_waiting_and_reserving_prompts() -> None:
    s = make(policy="fcfs", max_num_seqs=1)
    assert s.queued_tokens() == 0
    s.add(seq("a", n_prompt=5))
    s.add(seq("a", n_prompt=7))
    s.add(seq("b", n_prompt=3, remote_kv="receive"))
    assert s.queued_tokens() == 15
    s.schedule()  # the reservation takes the one slot
    assert s.queued_tokens() == 12


def test_weights_and_quantum_are_checked() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(tenant_weights={"a": 0.0})
    with pytest.raises(ValueError):
        SchedulerConfig(fair_quantum_tokens=0)
    cfg = SchedulerConfig(max_num_batched_tokens=96, tenant_weights={"a": 2})
    assert (cfg.quantum, cfg.weight("a"), cfg.weight("")) == (96, 2.0, 1.0)


def test_engine_config_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from splitserve.launch import parse_tenant_weights

    monkeypatch.setenv("SPLITSERVE_TENANT_WEIGHTS", '{"a": 3, "": 0.5}')
    monkeypatch.setenv("SPLITSERVE_POLICY", "fair")
    cfg = EngineConfig()
    assert (cfg.policy, cfg.tenant_weights, cfg.fair_quantum_tokens) == ("fair", {"a": 3.0, "": 0.5}, None)
    assert cfg.fair_burst_s == 2.0
    assert parse_tenant_weights("a=3, b=1,=2") == {"a": 3.0, "b": 1.0, "": 2.0}
    for bad in ("", "a", "a=0", "a=x", "a=1,a=2", "a=nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tenant_weights(bad)


# --- starvation freedom -----------------------------------------------------------------------------
arrival = st.tuples(
    st.integers(0, 12),  # step
    st.sampled_from("abc"),  # tenant
    st.integers(0, 4),  # priority
    st.integers(1, 24),  # prompt tokens
    st.integers(1, 4),  # output tokens: a sequence finishes k steps after its prompt
)
MAX_PRIORITY = 4


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=40),
    weights=st.fixed_dictionaries({"a": st.sampled_from([1.0, 3.0]), "b": st.sampled_from([1.0, 0.5])}),
    quantum=st.sampled_from([1, 8, 64]),
)
def test_no_sequence_starves(arrivals, weights, quantum) -> None:  # type: ignore[no-untyped-def]
    now = [0.0]
    s = make(
        max_num_seqs=2,
        max_num_batched_tokens=16,
        tenant_weights=weights,
        fair_quantum_tokens=quantum,
        aging_s=1.0,
        clock=lambda: now[0],
    )
    by_step: dict[int, list[Sequence]] = {}
    for t, tenant, prio, n_prompt, n_out in arrivals:
        by_step.setdefault(t, []).append(seq(tenant, n_prompt, n_out, priority=prio, arrival_time=float(t)))
    everyone = [x for xs in by_step.values() for x in xs]
    # work-conserving: every step computes a token of someone, so all is done within this many steps
    limit = max(by_step) + sum(x.num_tokens + x.params.max_tokens for x in everyone) + 1
    first_admitted: dict[int, int] = {}  # id -> place in the order of first admissions
    t = 0
    while (t <= max(by_step) or s.has_work()) and t < limit:
        now[0] = float(t)
        for x in by_step.get(t, []):
            s.add(x)
        for x in step(s).admitted:
            first_admitted.setdefault(id(x), len(first_admitted))
        t += 1
    assert all(x.is_finished for x in everyone), f"starved: {[x for x in everyone if not x.is_finished]}"
    assert s.tenant_served.total() == sum(x.num_prompt_tokens + x.params.max_tokens - 1 for x in everyone)
    # within a tenant, aging bounds overtaking: nobody arriving more than MAX_PRIORITY steps after a
    # sequence gets in before it
    for x in everyone:
        for y in everyone:
            if y.tenant == x.tenant and first_admitted[id(y)] < first_admitted[id(x)]:
                assert y.arrival_time <= x.arrival_time + MAX_PRIORITY  # type: ignore[operator]


def test_a_tenant_under_its_share_of_a_full_batch_starts_at_once() -> None:
    # a floods: its long generations hold every batch slot; b's request must not wait for one to end
    s = make(max_num_seqs=4, fair_quantum_tokens=8)
    for _ in range(12):
        s.add(seq("a", max_tokens=50))
    for _ in range(3):
        step(s)
    assert [x.tenant for x in s.running] == ["a"] * 4
    b1, b2, b3 = seq("b", max_tokens=50), seq("b", max_tokens=50), seq("b", max_tokens=50)
    for b in (b1, b2, b3):
        s.add(b)
    out = step(s)
    # b gets its share (2 of 4 slots) at once: two of a's sequences go back to a's queue, recomputed later
    assert out.admitted == [b1, b2] and len(out.preempted) == 2
    assert {x.tenant for x in out.preempted} == {"a"} and all(
        x.status is SequenceStatus.WAITING for x in out.preempted
    )
    assert s.stats["preempt_fair_share"] == 2
    # at its share, b's third request waits for a slot like anyone: no more preemption
    for _ in range(3):
        out = step(s)
        assert not out.preempted and b3 not in out.admitted
    assert sorted(x.tenant for x in s.running) == ["a", "a", "b", "b"]


def test_fcfs_never_preempts_for_a_tenant() -> None:
    s = make(policy="fcfs", max_num_seqs=2)
    for _ in range(4):
        s.add(seq("a", max_tokens=20))
    step(s)
    s.add(seq("b", max_tokens=20))
    assert not step(s).preempted and s.stats["preempt_fair_share"] == 0


def test_a_new_tenants_prompt_has_the_step_to_itself_and_the_others_prefill_waits_one_step() -> None:
    s = make(max_num_seqs=8, max_num_batched_tokens=64, fair_bulk_prefill_tokens=64)
    a_decoding, a_long = seq("a", max_tokens=20), seq("a", n_prompt=200, max_tokens=2)
    s.add(a_decoding)
    step(s)
    s.add(a_long)
    step(s)  # a_long's first chunk
    assert 0 < a_long.num_computed_tokens < 200
    b = seq("b", n_prompt=40)
    s.add(b)
    out = s.schedule()
    # a's decode runs, b's whole prompt goes in, a's next chunk waits (and so do a's other admissions)
    assert [(x, n) for x, n in out.scheduled] == [(a_decoding, 1), (b, 40)]
    s.postprocess(out, fake_run(out))
    out = step(s)  # b is an ordinary tenant now: a's prefill continues
    assert a_long in [x for x, _ in out.scheduled]


def test_bulk_prefill_tokens_bound_the_other_tenants_prefill_per_step_but_not_a_new_tenants_prompt() -> None:
    s = make(max_num_seqs=8, max_num_batched_tokens=256, fair_bulk_prefill_tokens=16)
    for _ in range(4):
        s.add(seq("a", n_prompt=40, max_tokens=30))
    assert step(s).scheduled[0][1] == 40  # a just arrived: its first request goes whole
    for _ in range(12):
        out = step(s)
        prefill = sum(n for x, n in out.scheduled if n > 1)
        assert prefill <= 16, out.scheduled  # every other a admission and chunk together
    assert all(x.num_computed_tokens >= 40 for x in s.running)  # and a's prompts still got through
    b1, b2 = seq("b", n_prompt=40), seq("b", n_prompt=40)
    s.add(b1)
    s.add(b2)  # b has queued work now: its second request is not a newcomer's
    out = step(s)
    assert (b1, 40) in out.scheduled and b2 not in out.admitted  # b1 whole; no other prefill this step
    assert sum(n for x, n in out.scheduled if n > 1) == 40
    out = step(s)
    assert [(x, n) for x, n in out.scheduled if n > 1] == [(b2, 16)]  # b2 in bounded chunks


def test_a_new_tenant_that_cannot_start_does_not_hold_up_the_others_prefill() -> None:
    s = make(num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    a = seq("a", n_prompt=48, max_tokens=2)  # 12 of the 14 blocks
    s.add(a)
    step(s)
    s.add(seq("b", n_prompt=16))  # needs 4 blocks: there are 2 until a finishes
    for _ in range(8):
        step(s)
    assert a.status is SequenceStatus.FINISHED


def test_a_light_tenant_is_not_held_to_its_share_of_a_small_batch_by_a_flooding_one() -> None:
    # a asks for far more than b lately (20 requests to 3): b's overlapping requests may hold more
    # than half of a 4-slot batch, and a does not take those slots back
    s = make(max_num_seqs=4, fair_quantum_tokens=8)
    for _ in range(20):
        s.add(seq("a", max_tokens=50))
    for _ in range(3):
        step(s)
    bs = [seq("b", max_tokens=50) for _ in range(3)]
    for b in bs:
        s.add(b)
    for _ in range(4):
        step(s)
    assert all(b.status is SequenceStatus.RUNNING for b in bs)
    # b may take while a runs as many as b: a keeps one
    assert sorted(x.tenant for x in s.running) == ["a", "b", "b", "b"]


def test_tenants_of_like_demand_share_a_full_batch_by_weight() -> None:
    # a asks only twice b's tokens: neither is light; b gets its half of the slots and no more
    s = make(max_num_seqs=4, fair_quantum_tokens=8)
    for _ in range(6):
        s.add(seq("a", max_tokens=50))
    for _ in range(3):
        step(s)
    for _ in range(3):
        s.add(seq("b", max_tokens=50))
    for _ in range(4):
        step(s)
    assert sorted(x.tenant for x in s.running) == ["a", "a", "b", "b"]


def burst_scene(burst_s: float) -> tuple[Scheduler, list[float], list[Sequence]]:
    """b sent one short request, then nothing for 5 s; then a (whose demand is like b's: neither is
    light) takes every slot of a 4-slot batch, and b sends three requests at once. Steps take 0.1 s."""
    now = [0.0]
    s = make(max_num_seqs=4, fair_quantum_tokens=8, fair_burst_s=burst_s, clock=lambda: now[0])

    def tick() -> SchedulerOutput:
        out = step(s)
        now[0] += 0.1
        return out

    s.add(seq("b", max_tokens=2))
    for _ in range(4):
        tick()
    now[0] = 5.0
    for _ in range(4):
        s.add(seq("a", max_tokens=60))
    tick()
    assert sorted(x.tenant for x in s.running) == ["a"] * 4
    bs = [seq("b", max_tokens=60) for _ in range(3)]
    for b in bs:
        s.add(b)
    tick()
    return s, now, bs


def test_a_tenant_that_left_its_share_unused_may_run_over_it_while_its_allowance_lasts() -> None:
    s, now, bs = burst_scene(burst_s=0.5)  # 0.5 s of the whole batch: 2 slot-seconds
    # b ran nothing for 5 s: its allowance was full (2), a (new, busy) has none. b's three requests all
    # start (the step they waited for, 0.1 s at b's share of 2 slots, drained 0.2), a keeps one slot,
    # and does not take the others back while b's allowance lasts
    assert fair(s)._allowance["b"] == pytest.approx(1.8) and fair(s)._allowance["a"] == 0.0
    assert all(b.status is SequenceStatus.RUNNING for b in bs)
    assert sorted(x.tenant for x in s.running) == ["a", "b", "b", "b"]
    taken = s.stats["preempt_fair_share"]
    assert taken == 3  # three of a's four sequences went back to its queue
    for _ in range(15):  # 1.5 s at one slot over b's share: 1.5 of its 1.8 slot-seconds
        out = step(s)
        now[0] += 0.1
        assert not out.preempted
        assert fair(s)._allowance["a"] == 0.0  # a waits with queued work: it earns nothing
    assert sorted(x.tenant for x in s.running) == ["a", "b", "b", "b"]
    for _ in range(10):  # spent: a takes its share back, and the batch is shared by the share rule
        step(s)
        now[0] += 0.1
    assert fair(s)._allowance["b"] == 0.0
    assert s.stats["preempt_fair_share"] == taken + 1
    assert sorted(x.tenant for x in s.running) == ["a", "a", "b", "b"]


def test_a_tenant_holding_every_slot_spends_its_allowance_while_another_waits() -> None:
    # b's four requests take all four slots; a, with none left, still waits with queued work, so b is
    # over its share (2 of 4 among the tenants running or waiting) and spends, and a gets its half back
    s, now, bs = burst_scene(burst_s=0.5)
    b4 = seq("b", max_tokens=60)
    s.add(b4)
    step(s)
    now[0] += 0.1
    assert [x.tenant for x in s.running] == ["b"] * 4 and any(x.tenant == "a" for x in s.waiting)
    for _ in range(15):  # 2 slot-seconds at two slots over b's share: 1 s
        step(s)
        now[0] += 0.1
    assert fair(s)._allowance["b"] == 0.0
    assert sorted(x.tenant for x in s.running) == ["a", "a", "b", "b"]


def test_a_backlogged_tenants_allowance_drains_it_is_for_a_burst_now_not_later() -> None:
    # a and b both earn a full allowance while idle, then both stay backlogged at their share of the
    # batch: neither may take from the other while both have some (the share rule holds), and both
    # drain at their share's rate, so neither keeps one to take the other's slots later
    now = [0.0]
    s = make(max_num_seqs=4, fair_quantum_tokens=8, fair_burst_s=1.0, clock=lambda: now[0])
    for t in "ab":
        s.add(seq(t, max_tokens=1))
    step(s)
    now[0] = 10.0
    step(s)
    assert fair(s)._allowance == {"a": 4.0, "b": 4.0}
    for t in "ab":
        for _ in range(6):
            s.add(seq(t, max_tokens=60))
    for _ in range(25):  # 2.5 s backlogged at a share of 2: 5 slot-seconds drained, more than the 4
        step(s)
        now[0] += 0.1
        assert sorted(x.tenant for x in s.running) == ["a", "a", "b", "b"]
    assert fair(s)._allowance == {"a": 0.0, "b": 0.0}


def test_without_a_burst_allowance_a_tenant_of_like_demand_gets_its_share() -> None:
    s, _, bs = burst_scene(burst_s=0.0)
    assert sorted(x.tenant for x in s.running) == ["a", "a", "b", "b"]
    assert [b.status for b in bs].count(SequenceStatus.WAITING) == 1


def test_the_burst_allowance_is_capped_and_checked() -> None:
    now = [0.0]
    s = make(max_num_seqs=4, fair_burst_s=1.5, clock=lambda: now[0])
    s.add(seq("b", max_tokens=1))
    step(s)
    now[0] = 100.0  # idle long: the cap, fair_burst_s of the whole batch
    step(s)
    assert fair(s)._allowance["b"] == pytest.approx(6.0)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            SchedulerConfig(fair_burst_s=bad)


def test_a_tenant_idle_for_long_is_forgotten_and_comes_back_as_new() -> None:
    """The fair-share state (demand, allowance) of a tenant with nothing running or queued for
    FORGET_TENANT_S is dropped, so it stays bounded by the tenants seen lately; until then an idle
    tenant keeps its full allowance. A forgotten tenant comes back with none, as a new one."""
    now = [0.0]
    s = make(max_num_seqs=4, fair_burst_s=1.0, clock=lambda: now[0])
    s.add(seq("a", max_tokens=1))
    s.add(seq("b", max_tokens=1))
    step(s)
    for t in range(1, 12):  # b keeps sending now and then; a sends nothing more
        now[0] = t * FORGET_TENANT_S / 10
        s.add(seq("b", max_tokens=1))
        step(s)
        if now[0] < FORGET_TENANT_S:
            assert fair(s)._allowance["a"] == pytest.approx(4.0)  # idle, at its cap, remembered
    assert "a" not in fair(s)._allowance and "a" not in fair(s)._recent and "a" not in fair(s)._active_at
    assert "b" in fair(s)._allowance
    s.add(seq("a", max_tokens=1))
    assert fair(s)._allowance["a"] == 0.0  # back as a new tenant


def test_demand_fades_with_its_half_life_however_often_it_is_read() -> None:
    now = [0.0]
    s = make(max_num_seqs=4, clock=lambda: now[0])
    s.add(seq("a", n_prompt=8, max_tokens=92))  # 100 tokens asked for
    for t in (1.0, 2.5, 5.0):  # read (as the slot rules do) at several times
        now[0] = t
        fair(s)._recent_demand("a")
    assert fair(s)._recent_demand("a") == pytest.approx(50.0)  # one half-life (5 s) later: half
    now[0] = 10.0
    assert fair(s)._recent_demand("a") == pytest.approx(25.0)
