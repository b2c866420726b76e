"""What the grammar tests share."""

from __future__ import annotations

import torch


def allocate_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """llguidance's bitmask layout: int32 words, bit i of word w for id 32*w + i."""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)
