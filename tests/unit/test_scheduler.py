"""Scheduler behaviour without torch: a fake runner that returns a fixed token per sampling row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from common.engine.sequence import Sequence, SequenceStatus
from common.engine.static_batching import StaticBatchScheduler
from common.kv.block_manager import HOLE, BlockManager
from common.sampling_params import SamplingParams

EOS = 2


def fake_run(out: SchedulerOutput, token: int = 7) -> list[int | None]:
    """What the model runner returns: a token for each sequence whose step reaches its last token."""
    return [token if seq.num_computed_tokens + n == seq.num_tokens else None for seq, n in out.scheduled]


def make(num_blocks=64, block_size=4, clock=None, holds_blocks=None, **cfg) -> Scheduler:
    bm = BlockManager(num_blocks, block_size)
    kind = StaticBatchScheduler if cfg.get("policy") == "static" else Scheduler
    hooks = {"holds_blocks": holds_blocks} if holds_blocks else {}
    return kind(SchedulerConfig(**cfg), bm, (EOS,), clock=clock or (lambda: 0.0), **hooks)


def seq(n_prompt: int, max_tokens: int = 4, start: int = 10, **kw) -> Sequence:
    return Sequence(
        list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw
    )


def drain(s: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_work():
            break
        out = s.schedule()
        outs.append(out)
        s.postprocess(out, fake_run(out))
        s.bm.check_integrity()
    assert not s.has_work(), "scheduler did not drain"
    return outs


def test_scheduler_and_block_manager_import_no_torch() -> None:
    """In a fresh interpreter: the scheduling core is plain Python (sys.modules of this process says
    nothing, the test session has torch loaded already)."""
    code = (
        "import sys, common.engine.scheduler, common.kv.block_manager, common.engine.sequence; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[2])


def test_finished_leave_and_waiting_join_every_step() -> None:
    s = make(max_num_seqs=2)
    a, b, c = seq(3, max_tokens=1), seq(3, max_tokens=5), seq(3, max_tokens=2)
    for x in (a, b, c):
        s.add(x)
    out = s.schedule()
    assert [x for x, _ in out.scheduled] == [a, b]  # max_num_seqs admits two
    s.postprocess(out, fake_run(out))
    assert a.is_finished and not a.block_table  # left after its last token, blocks freed
    out = s.schedule()
    assert [x for x, _ in out.scheduled] == [b, c]  # c joined at the very next step
    drain(s)
    assert s.bm.num_free_blocks == 64


def test_admission_waits_for_blocks() -> None:
    s = make(num_blocks=4, block_size=4, max_num_seqs=8)
    big, small = seq(12, max_tokens=2), seq(5, max_tokens=2)  # 3 blocks, then 2 blocks
    s.add(big)
    s.add(small)
    out = s.schedule()
    assert [x for x, _ in out.scheduled] == [big]
    assert small.status is SequenceStatus.WAITING
    drain(s)
    assert big.is_finished and small.is_finished


def test_chunked_prefill_budget_puts_decodes_first() -> None:
    s = make(max_num_batched_tokens=8, max_num_seqs=4)
    d = seq(2, max_tokens=10)
    s.add(d)
    s.postprocess(out := s.schedule(), fake_run(out))  # d is now decoding
    long = seq(20, max_tokens=1, start=100)
    s.add(long)
    out = s.schedule()
    assert out.scheduled[0] == (d, 1), "decode tokens come first"
    assert out.scheduled[1] == (long, 7), "the prefill chunk fills the rest of the budget"
    assert out.num_batched_tokens == 8
    s.postprocess(out, fake_run(out))
    assert long.num_computed_tokens == 7 and long.num_output_tokens == 0  # mid-prompt: nothing sampled
    chunks = []
    while not long.is_finished:
        out = s.schedule()
        assert out.num_batched_tokens <= 8
        chunks += [n for x, n in out.scheduled if x is long]
        s.postprocess(out, fake_run(out))
    assert chunks == [7, 6]  # 20 = 7 + 7 + 6 with one decode token beside each chunk


def _fill_until_preempt(mode: str, num_swap_blocks: int) -> tuple[Scheduler, Sequence]:
    s = make(
        num_blocks=6, block_size=2, max_num_seqs=4, preemption_mode=mode, num_swap_blocks=num_swap_blocks
    )
    first, second = seq(4, max_tokens=6, start=10), seq(4, max_tokens=6, start=50)
    s.add(first)
    s.add(second)
    for _ in range(10):
        out = s.schedule()
        s.postprocess(out, fake_run(out))
        s.bm.check_integrity()
        if out.preempted:
            assert out.preempted == [second], "the latest arrival is preempted first"
            return s, second
    raise AssertionError("no preemption happened")


def test_preemption_by_recompute() -> None:
    s, victim = _fill_until_preempt("recompute", 0)
    assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
    assert not victim.block_table and s.waiting[0] is victim
    outs = drain(s)
    assert victim.is_finished and victim.num_output_tokens == 6
    assert s.stats["preempt_recompute"] >= 1 and not any(o.swap_out for o in outs)


def test_preemption_by_swap() -> None:
    s, victim = _fill_until_preempt("swap", 16)
    assert victim.status is SequenceStatus.SWAPPED and s.swap_blocks_used > 0
    computed = victim.num_computed_tokens
    outs = drain(s)
    swap_in = [o for o in outs if victim in o.swap_in]
    assert swap_in, "the swapped sequence came back by swap-in"
    assert victim.is_finished and s.swap_blocks_used == 0 and computed > 0
    assert s.stats["preempt_swap"] >= 1


def test_auto_preemption_follows_cost_estimate() -> None:
    # copying is cheap relative to recomputing: swap; and the reverse: recompute
    s = make(preemption_mode="auto", num_swap_blocks=100, swap_s_per_block=1e-6, recompute_s_per_token=1e-3)
    v = seq(8)
    v.num_computed_tokens, v.block_table = 8, [0, 1]
    assert s._preemption_kind(v) == "swap"
    s = make(preemption_mode="auto", num_swap_blocks=100, swap_s_per_block=1.0, recompute_s_per_token=1e-3)
    assert s._preemption_kind(v) == "recompute"
    s = make(preemption_mode="auto", num_swap_blocks=1, swap_s_per_block=1e-6)
    assert s._preemption_kind(v) == "recompute", "no host space: recompute"


def test_priority_with_aging_does_not_starve() -> None:
    now = [0.0]
    s = make(policy="priority", max_num_seqs=1, aging_s=1.0, clock=lambda: now[0])
    low = seq(2, max_tokens=1, priority=5, arrival_time=0.0)
    s.add(low)
    order = []
    for t in range(12):
        now[0] = float(t)
        s.add(seq(2, max_tokens=1, start=100 + t, priority=0, arrival_time=float(t)))
        out = s.schedule()
        order += [x for x, _ in out.scheduled]
        s.postprocess(out, fake_run(out))
    assert low in order, "the low-priority request ran despite a stream of urgent ones"
    assert order.index(low) >= 3, "urgent requests ran first while the low one was young"


def test_priority_orders_admission() -> None:
    s = make(policy="priority", max_num_seqs=1)
    a, b = (
        seq(2, max_tokens=1, priority=3, arrival_time=0.0),
        seq(2, max_tokens=1, priority=1, arrival_time=0.0),
    )
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [x for x, _ in out.scheduled] == [b]


def test_static_policy_runs_batch_to_its_longest_member() -> None:
    s = make(policy="static", max_num_seqs=2)
    short, long, nxt = seq(2, max_tokens=1), seq(2, max_tokens=5), seq(2, max_tokens=1)
    for x in (short, long, nxt):
        s.add(x)
    outs = drain(s)
    # nxt could not join until long finished, although short's slot was idle since step 1
    joined = next(i for i, o in enumerate(outs) if any(x is nxt for x, _ in o.scheduled))
    assert joined == 5
    assert all(len(o.scheduled) + len(o.padding) == 2 for o in outs[:5]), "finished member kept its slot"
    assert [len(o.padding) for o in outs[:5]] == [0, 1, 1, 1, 1]
    assert short.num_output_tokens == 1 and long.num_output_tokens == 5


def test_eos_and_stop_tokens_finish() -> None:
    s = make()
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=10))
    b = Sequence([1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=(7,)))
    s.add(a)
    s.add(b)
    out = s.schedule()
    s.postprocess(out, [EOS, 7])
    assert a.finish_reason == "stop" and b.finish_reason == "stop"


def test_abort_frees_blocks_from_every_queue() -> None:
    s = make(num_blocks=6, block_size=2, max_num_seqs=1)
    a, b = seq(4), seq(4)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert not s.has_work() and s.bm.num_free_blocks == 6
    s.bm.check_integrity()


def test_remote_receive_is_reserved_then_parked_until_its_kv_arrives() -> None:
    s = make(num_blocks=8, block_size=4, max_num_seqs=2)
    a = seq(6, max_tokens=3, remote_kv="receive")
    s.add(a)
    assert s.num_waiting == 1 and s.has_work()
    out = s.schedule()
    assert out.admitted == [a] and not out.scheduled, "a reservation computes nothing"
    assert a.status is SequenceStatus.PARKED and len(a.block_table) == 2 and s.num_active == 1
    assert s.num_parked == 1, "/health tells a reservation (parked) from a running sequence"
    assert not s.has_work(), "a parked reservation waits for its KV, not for a step"
    assert s.kv_arrived(a, first_token=99) is None
    assert a.status is SequenceStatus.RUNNING and a.output_token_ids == [99] and a.num_computed_tokens == 6
    assert s.num_active == 1 and s.num_parked == 0
    outs = drain(s)
    assert a.finish_reason == "length" and a.num_output_tokens == 3 and len(outs) == 2
    assert s.bm.num_free_blocks == 8


def test_token_zero_may_end_a_remote_request_at_once() -> None:
    s = make()
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=10), remote_kv="receive")
    s.add(a)
    s.schedule()
    assert s.kv_arrived(a, EOS) == "stop"
    assert a.is_finished and not a.block_table and s.bm.num_free_blocks == 64


def test_a_finished_sender_keeps_its_blocks_while_the_transfer_holds_them() -> None:
    held = {"yes": True}
    s = make(num_blocks=8, block_size=4, holds_blocks=lambda seq: held["yes"])
    a = seq(6, max_tokens=1, remote_kv="send")
    s.add(a)
    drain(s)
    assert a.is_finished and a.finish_reason == "length"
    assert s.parked == {a.seq_id: a} and s.bm.num_free_blocks == 6, "blocks stay while KV is read"
    assert s.num_active == 0, "a finished sender does not count against max_num_seqs"
    s.finish(a, "sent")
    assert s.parked and s.bm.num_free_blocks == 6, "still held: finishing again changes nothing"
    held["yes"] = False
    s.finish(a, "sent")
    assert not s.parked and s.bm.num_free_blocks == 8 and a.finish_reason == "length"
    s.bm.check_integrity()


def test_finishing_a_reservation_frees_it_unless_a_write_may_land() -> None:
    landing = {"yes": True}
    s = make(num_blocks=8, block_size=4, holds_blocks=lambda seq: landing["yes"])
    a = seq(6, remote_kv="receive")
    s.add(a)
    s.schedule()
    s.finish(a, "abort")
    assert a.is_finished and a.seq_id in s.parked and s.bm.num_free_blocks == 6
    landing["yes"] = False
    s.finish(a, "abort")
    assert not s.parked and s.bm.num_free_blocks == 8


def test_queue_wait_is_the_age_of_the_longest_waiting_sequence() -> None:
    now = [10.0]
    s = make(max_num_seqs=1, clock=lambda: now[0])
    assert s.queue_wait_s() == 0.0  # an empty queue
    first, second = seq(2, max_tokens=8), seq(2, max_tokens=8, start=50)
    s.add(first)
    now[0] = 12.0
    s.add(second)
    now[0] = 13.5
    assert s.queue_wait_s() == pytest.approx(3.5)  # first has waited since 10.0
    out = s.schedule()  # first runs (one slot): second is the oldest still waiting
    assert [x for x, _ in out.scheduled] == [first]
    assert s.queue_wait_s() == pytest.approx(1.5)
    remote = seq(2, max_tokens=8, start=90)
    remote.remote_kv = "receive"
    now[0] = 14.0
    s.add(remote)  # a reservation waiting for blocks is queued too
    s.finish(second, "abort")
    now[0] = 15.0
    assert s.queue_wait_s() == pytest.approx(1.0)


# --- sliding windows: a model whose every layer slides (block manager with a window) -----------------


def windowed(num_blocks: int = 64, block_size: int = 4, window: int = 8, **cfg) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, window=window)
    return Scheduler(SchedulerConfig(**cfg), bm, (EOS,), clock=lambda: 0.0)


def test_a_windowed_sequence_holds_a_bounded_number_of_blocks() -> None:
    s = windowed(window=8)
    a = seq(20, max_tokens=40)
    s.add(a)
    most = 0
    for _ in range(200):
        if not s.has_work():
            break
        out = s.schedule()
        at_step = s.bm.num_held(a)  # what the step computes with
        s.postprocess(out, fake_run(out))
        s.bm.check_integrity()
        if a.is_finished:
            break
        holes = a.block_table.count(HOLE)
        assert a.block_table[:holes] == [HOLE] * holes
        assert holes == s.bm.first_live(a.num_computed_tokens)  # released as soon as it slid out
        if a.num_output_tokens == 1:
            assert at_step == 5, "the prompt's 5 blocks while it is computed"
        else:
            most = max(most, at_step)
        assert s.bm.num_held(a) <= 3  # between steps: the window's 8 keys span at most 3 blocks
    assert a.is_finished and a.num_output_tokens == 40
    # while decoding: the blocks of the query's window (positions p - 7 .. p, the new token's
    # included): ceil(8 / 4) + 1 when it straddles a block boundary, never more
    assert most == 3 and s.bm.num_held(a) == 0
    assert s.bm.num_free_blocks == 64 and s.bm.num_used == 0


def test_a_window_only_reservation_takes_only_the_windows_blocks() -> None:
    s = windowed(num_blocks=4, window=8, max_num_seqs=2)
    a = seq(40, max_tokens=6, remote_kv="receive")  # 10 blocks of prompt: 4 do not fit
    s.add(a)
    out = s.schedule()
    assert out.admitted == [a] and a.status is SequenceStatus.PARKED
    # decoding at position 40 reads keys 33..40: blocks 8 and 9 (and 10 once token 40 is there)
    assert a.block_table == [HOLE] * 8 + a.block_table[8:] and s.bm.num_held(a) == 2
    assert s.kv_arrived(a, first_token=99) is None
    drain(s)
    assert a.finish_reason == "length" and a.num_output_tokens == 6
    assert s.bm.num_free_blocks == 4 and s.bm.num_used == 0


def test_swap_moves_only_held_blocks_and_swap_in_keeps_the_holes() -> None:
    # two sequences that each hold up to 5 blocks while decoding (window 16) in a pool of 9: swaps, of
    # sequences past their window (holes)
    s = windowed(num_blocks=9, window=16, preemption_mode="swap", num_swap_blocks=64)
    seqs = [seq(20, max_tokens=40, start=10 + 30 * i) for i in range(2)]
    for a in seqs:
        s.add(a)
    swapped: list[int] = []
    with_holes = 0
    for _ in range(1000):
        if not s.has_work():
            break
        out = s.schedule()
        for victim, blocks in out.swap_out:
            assert HOLE not in blocks and victim.num_swapped_blocks == len(blocks)
            swapped.append(len(blocks))
        for back in out.swap_in:
            holes = s.bm.first_live(back.num_computed_tokens)
            assert back.block_table[:holes] == [HOLE] * holes and HOLE not in back.block_table[holes:]
            with_holes += holes > 0
        s.postprocess(out, fake_run(out))
        s.bm.check_integrity()
        for a in s.running:
            assert s.bm.num_held(a) <= 5
    assert not s.has_work() and swapped and with_holes >= 1, (swapped, with_holes)
    assert max(swapped) <= 5 and all(a.num_output_tokens == 40 for a in seqs)
    assert s.bm.num_free_blocks == 9 and s.swap_blocks_used == 0


class PrefetchingTier:
    """The part of an offload tier the scheduler asks: whether a prefetch still brings these keys."""

    def __init__(self) -> None:
        self.busy = True
        self.asked: list[list[int]] = []

    def prefetching(self, keys: list[int]) -> bool:
        self.asked.append(list(keys))
        return self.busy

    def holds(self, keys: list[int]) -> list[bool]:  # (the admission's look at the tiers: nothing there)
        return [False] * len(keys)

    def load(self, *_: object) -> int:
        return 0

    def evicted(self, *_: object, **__: object) -> None:
        pass


def test_an_admission_waits_for_its_prefetch_while_others_run() -> None:
    """A waiting sequence whose blocks a prefetch still brings from the disk is not admitted while
    another runs (the running one steps on; no disk read on the engine's thread), and is once the
    prefetch is done; with nothing else running, or past its deadline, it is admitted at once."""
    now = [0.0]
    s = make(clock=lambda: now[0])
    tier = PrefetchingTier()
    s.bm.tier = tier  # type: ignore[assignment]
    a, b = seq(6, max_tokens=20), seq(6, start=50)
    s.add(a)
    s.postprocess(out := s.schedule(), fake_run(out))
    b.prefetch_keys, b.prefetch_deadline = [11, 12], 5.0
    s.add(b)
    for _ in range(3):
        out = s.schedule()
        assert [q for q, _ in out.scheduled] == [a], "b waits for its prefetch while a runs"
        s.postprocess(out, fake_run(out))
    assert s.stats["prefetch_deferred"] == 3 and tier.asked[-1] == [11, 12]
    tier.busy = False
    out = s.schedule()
    assert out.admitted == [b] and b.prefetch_keys is None
    s.postprocess(out, fake_run(out))
    drain(s)
    # nothing else running: admitted at once, prefetch or not
    c = seq(6, start=90)
    c.prefetch_keys, c.prefetch_deadline, tier.busy = [13], 5.0, True
    s.add(c)
    assert s.schedule().admitted == [c]
    drain(s)
    # past its deadline: admitted while others run (a stuck disk holds nothing back for good)
    d, e = seq(6, max_tokens=20, start=130), seq(6, start=170)
    s.add(d)
    s.postprocess(out := s.schedule(), fake_run(out))
    e.prefetch_keys, e.prefetch_deadline = [14], 5.0
    s.add(e)
    s.postprocess(out := s.schedule(), fake_run(out))
    assert not out.admitted
    now[0] = 5.5
    assert s.schedule().admitted == [e]


def test_a_reservation_waits_for_its_prefetch_while_others_decode() -> None:
    """On a decode service a reservation's blocks may come back from the tiers too (it then receives
    only the suffix): one whose prefetch still reads the disk is not reserved while another decodes."""
    s = make()
    tier = PrefetchingTier()
    s.bm.tier = tier  # type: ignore[assignment]
    a = seq(6, max_tokens=20)
    s.add(a)
    s.postprocess(out := s.schedule(), fake_run(out))
    b = seq(6, start=50, remote_kv="receive")
    b.prefetch_keys, b.prefetch_deadline = [21], 5.0
    s.add(b)
    for _ in range(2):
        out = s.schedule()
        assert not out.admitted and b.status is SequenceStatus.WAITING
        s.postprocess(out, fake_run(out))
    tier.busy = False
    out = s.schedule()
    assert out.admitted == [b] and b.status is SequenceStatus.PARKED
    assert s.stats["prefetch_deferred"] == 2
