"""Prefix-cache block hashes: one function shared by the engines (block manager) and the router (KV
index). No torch, no I/O, so the router may import it.

A full block's hash is chained on its parent block's hash, so equal hashes mean equal token prefixes.
blake2b makes the value the same in every process: a router matches a prompt's chain against the
hashes a service published as KV events.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = -1  # the parent of a prompt's first block in the shared namespace (cache salt "")

# Where a hashed block's KV is held, as the engines record it and the router reads it (KV events):
# the device pool's prefix cache, or an offload tier (common/kv/tiers.py)
DEVICE, RAM, DISK = "device", "ram", "disk"
KVEvent = tuple[bool, int, str]  # (stored, hash, tier): True when the tier took the hash, False: let go
KVHeld = tuple[int, str]  # (hash, tier): a hash a tier holds now, for a snapshot


def cache_root(salt: str) -> int:
    """The parent of a prompt's first block under a cache salt: prompts with different salts share no
    block hash, so they share no cached KV and learn nothing of each other's prompts (the router salts
    each request with its tenant by default: RouterConfig.prefix_cache_scope). "" is the shared ROOT."""
    if not salt:
        return ROOT
    h = hashlib.blake2b(salt.encode(), digest_size=8, person=b"splitserve-salt")
    return int.from_bytes(h.digest(), "little", signed=True)


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one full block's tokens chained on the parent block's hash (ROOT for the first)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=True))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def prefix_chain(
    token_ids: Sequence[int], block_size: int, max_blocks: int | None = None, root: int = ROOT
) -> list[int]:
    """The hashes of token_ids' full blocks, in order (at most max_blocks of them), chained from `root`
    (`cache_root` of the request's salt)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    chain, parent = [], root
    for i in range(n):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        chain.append(parent)
    return chain
