"""`up --autoscale` turns a decision that grows one role and shrinks the other into role switches of the
shrinking role's newest services (splitserve/launch.py role_moves)."""

from __future__ import annotations

from typing import Any

from splitserve.launch import Child, role_moves


def child(name: str) -> Child:
    role = name.split("-")[0]
    proc: Any = None
    return Child(name, role, ["py", "-m", "splitserve", role], None, proc)


def test_the_newest_of_the_shrinking_role_moves() -> None:
    kids = [child("prefill-0"), child("decode-0"), child("decode-1"), child("decode-2")]
    moves = role_moves(kids, {"prefill": 3, "decode": 1})
    assert [(c.name, role) for c, role in moves] == [("decode-2", "prefill"), ("decode-1", "prefill")]
    moves = role_moves(kids, {"prefill": 2, "decode": 2})
    assert [(c.name, role) for c, role in moves] == [("decode-2", "prefill")]


def test_only_as_many_as_both_sides_allow_and_none_without_a_trade() -> None:
    kids = [child("prefill-0"), child("prefill-1"), child("decode-0")]
    assert [(c.name, r) for c, r in role_moves(kids, {"prefill": 1, "decode": 3})] == [
        ("prefill-1", "decode")
    ]
    assert role_moves(kids, {"prefill": 3, "decode": 2}) == []  # both grow: new services
    assert role_moves(kids, {"prefill": 1, "decode": 1}) == []  # both shrink: services stop
    assert role_moves(kids, {"prefill": 2, "decode": 1}) == []  # nothing changes
