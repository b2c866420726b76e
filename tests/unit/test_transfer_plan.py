"""Which KV heads go from which prefill rank to which decode rank (common/parallel/plan.py), and how
a decode rank counts the kv_dones of several prefill ranks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.parallel.partition import kv_head_ranges
from common.parallel.plan import (
    HeadSlice,
    Tally,
    plan,
    senders_to,
    shard_dones,
    shard_writes,
    split_endpoints,
)
from common.protocol import KVCompat, KVDone


def test_smollm_splits() -> None:
    # 3 KV heads: TP 2 holds [0, 1] and [2]
    assert [(r.src_rank, r.dst_rank, r.heads, r.full) for r in plan(3, 1, 2)] == [
        (0, 0, HeadSlice(0, 0, 2), False),
        (0, 1, HeadSlice(2, 0, 1), False),
    ]
    assert [(r.src_rank, r.dst_rank, r.heads, r.full) for r in plan(3, 2, 1)] == [
        (0, 0, HeadSlice(0, 0, 2), False),
        (1, 0, HeadSlice(0, 2, 1), False),
    ]
    assert [(r.src_rank, r.dst_rank, r.full) for r in plan(3, 2, 2)] == [(0, 0, True), (1, 1, True)]
    assert [r.full for r in plan(3, 1, 1)] == [True]


@given(
    heads=st.integers(1, 8),
    src_tp=st.integers(1, 8),
    dst_tp=st.integers(1, 8),
)
def test_every_decode_head_arrives_once_from_a_rank_holding_it(heads: int, src_tp: int, dst_tp: int) -> None:
    src, dst = kv_head_ranges(heads, src_tp), kv_head_ranges(heads, dst_tp)
    got: dict[int, list[int]] = {d: [] for d in range(dst_tp)}  # decode rank -> global heads received
    for r in plan(heads, src_tp, dst_tp):
        s = r.heads
        assert s.count > 0
        sent = list(src[r.src_rank])[s.src_start : s.src_start + s.count]
        landed = list(dst[r.dst_rank])[s.dst_start : s.dst_start + s.count]
        assert sent == landed and len(sent) == s.count  # the same heads on both sides
        got[r.dst_rank] += landed
    for d in range(dst_tp):
        assert sorted(got[d]) == list(dst[d])  # all of its heads, each once
        assert senders_to(heads, src_tp, dst_tp, d) == sum(
            1 for r in plan(heads, src_tp, dst_tp) if r.dst_rank == d
        )


def test_shard_writes_and_dones() -> None:
    eps = ["tcp://h:1/a", "tcp://h:2/a"]
    assert shard_writes(3, 1, 0, eps) == [(eps[0], HeadSlice(0, 0, 2)), (eps[1], HeadSlice(2, 0, 1))]
    assert shard_writes(3, 1, 0, eps[:1]) == [(eps[0], None)]  # same heads: the plain layout
    base = KVDone("r", 3, 42, 17, 0)
    dones = shard_dones(3, 2, 1, eps[0], base, [eps[0]] * 4)  # rank 1 of 2 -> one decode rank
    assert [(d.layer_writes, d.src_rank, d.senders, d.first_token, ep) for d, ep in dones] == [
        (4, 1, 2, 42, eps[0])
    ]


def test_split_endpoints() -> None:
    assert split_endpoints("tcp://a:1/x") == ["tcp://a:1/x"]
    assert split_endpoints("tcp://a:1/x, tcp://a:2/x") == ["tcp://a:1/x", "tcp://a:2/x"]
    with pytest.raises(ValueError, match="bad KV endpoint list"):
        split_endpoints("tcp://a:1/x,,")


def test_tally_waits_for_every_sender() -> None:
    t = Tally()
    t.layers = 3
    assert t.hear_done(2, senders=2) is None  # the other prefill rank's kv_done is due
    t.layers += 2
    assert t.hear_done(3, senders=2) == ""  # 5 of 5
    short = Tally(layers=4)
    assert short.hear_done(5, senders=1) == "KV incomplete: 4 of 5 layer writes arrived"


def test_compat_rank_fields() -> None:
    a = KVCompat("m", "w", "float32", 2, 3, 4, 16)
    b = KVCompat("m", "w", "float32", 2, 3, 4, 16, tp_size=2, tp_rank=1)
    assert a.mismatches(b) == []  # heterogeneous TP: the rank fields may differ
    bad = KVCompat("m", "w", "float32", 2, 3, 4, 16, tp_size=2, tp_rank=2)
    assert a.mismatches(bad) == ["peer tp_rank 2 outside tp_size 2"]
    assert a.mismatches(KVCompat("m", "w", "float32", 2, 4, 4, 16)) == ["num_kv_heads (3 != 4)"]
    # TP 2 of 3 heads is [0, 2) and [2, 3): rank 0 to rank 1 of another TP 2 shares none (a wrong list)
    p0 = KVCompat("m", "w", "float32", 2, 3, 4, 16, tp_size=2, tp_rank=0)
    want = "no KV head in common: rank 0 of 2 holds heads [0, 2), peer rank 1 of 2 [2, 3)"
    assert p0.mismatches(b) == [want]
    assert b.mismatches(a) == []  # one rank holds every head
