"""The smallest sequence the block manager takes (its `BlockOwner` protocol), for tests without an engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Owner:
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    group_tables: list[list[int]] = field(
        default_factory=list
    )  # layer groups 1.. (common/kv/layer_groups.py)
    num_cached_tokens: int = 0
    num_hashed_blocks: int = 0


def owner_op(bm: Any, owners: dict[int, Owner], op: str, who: int, toks: list[int]) -> bool:
    """The steps every block-manager property test takes alike on an existing owner: `append` a token
    (when a slot can be had; the table then covers every token), `commit` its blocks, `free` it.
    False for any other step (the test's own) or a missing owner."""
    o = owners.get(who)
    if o is None or op not in ("append", "commit", "free"):
        return False
    if op == "append":
        o.token_ids.append(toks[0])
        if bm.can_append(o):
            bm.append_slots(o)
            assert len(o.block_table) * bm.block_size >= len(o.token_ids)
        else:
            o.token_ids.pop()
    elif op == "commit":
        bm.commit(o, len(o.token_ids))
    else:
        bm.free(o)
        del owners[who]
    return True
