"""The smallest sequence the block manager takes (its `BlockOwner` protocol), for tests without an engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Owner:
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_hashed_blocks: int = 0
