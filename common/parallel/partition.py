"""Which part of the model each tensor-parallel rank holds: pure functions, no torch.

Attention is split by KV-head groups: rank r owns a contiguous range of KV heads together with the
query heads that read them, so attention needs no communication. When the KV heads do not divide
evenly the ranges differ by one head (SmolLM2-135M: 3 KV heads over 2 ranks is [2, 1]); with more ranks
than KV heads each rank gets one KV head, replicated on the ranks that share it, and those ranks split
its query heads. The MLP's intermediate dimension and the vocabulary are split evenly.

Later work (per-rank KV transfer, prefill and decode at different TP sizes) reuses `kv_head_ranges`:
it says which KV heads of a block live on which rank.
"""

from __future__ import annotations

from dataclasses import dataclass


def even_ranges(n: int, parts: int) -> list[range]:
    """n items as `parts` contiguous ranges whose sizes differ by at most one, the larger first."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for r in range(parts):
        size = base + (1 if r < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def kv_head_ranges(num_kv_heads: int, tp: int) -> list[range]:
    """The KV heads of each of `tp` ranks. tp <= num_kv_heads: contiguous, as even as possible (larger
    first); tp > num_kv_heads: one head each, the ranks spread as evenly as possible over the heads
    (contiguous ranks share a head)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be at least 1, got {num_kv_heads}")
    if tp <= num_kv_heads:
        return even_ranges(num_kv_heads, tp)
    return [range(h, h + 1) for h, ranks in enumerate(even_ranges(tp, num_kv_heads)) for _ in ranks]


def q_head_ranges(num_heads: int, num_kv_heads: int, tp: int) -> list[range]:
    """The query heads of each rank: those of its KV heads (num_heads / num_kv_heads per KV head), split
    as evenly as possible among the ranks that share a replicated KV head. ValueError when a rank would
    get no query head (tp > num_heads)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if tp > num_heads:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {num_heads} attention heads")
    group = num_heads // num_kv_heads
    kv = kv_head_ranges(num_kv_heads, tp)
    if tp <= num_kv_heads:
        return [range(r.start * group, r.stop * group) for r in kv]
    out = []
    for h, ranks in enumerate(even_ranges(tp, num_kv_heads)):
        out += [range(h * group + p.start, h * group + p.stop) for p in even_ranges(group, len(ranks))]
    return out


def even_split(n: int, tp: int, what: str) -> list[range]:
    """n split into tp equal contiguous ranges; ValueError naming `what` when tp does not divide n."""
    if n % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide {what}={n}")
    return even_ranges(n, tp)


@dataclass(frozen=True)
class ShardLayout:
    """What one rank holds: its query and KV heads, its slice of the MLP and of the vocabulary."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range


def shard_layouts(
    num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, tp: int
) -> list[ShardLayout]:
    """Every rank's layout; ValueError if the model cannot be split over tp ranks."""
    q = q_head_ranges(num_heads, num_kv_heads, tp)
    kv = kv_head_ranges(num_kv_heads, tp)
    inter = even_split(intermediate_size, tp, "intermediate_size")
    vocab = even_split(vocab_size, tp, "vocab_size")
    return [ShardLayout(r, tp, q[r], kv[r], inter[r], vocab[r]) for r in range(tp)]
