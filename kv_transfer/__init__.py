"""KV transfer: prefill pushes a prompt's KV cache, layer by layer, into a decode service's reserved blocks.

One interface (base.KVSender / base.KVReceiver), one backend per deployment, chosen by name.
Backends are imported on demand so that a deployment only needs the libraries of the one it uses.
"""

from __future__ import annotations

from typing import Any

from common.kv.kv_cache import PagedKVCache
from common.protocol import KVCompat

from .base import (
    AcceptFn,
    DoneFn,
    KVReceiver,
    KVSender,
    PreflightError,
    ReceiverStats,
    SenderStats,
    TransferError,
)
from .compat import compat_for

BACKENDS = ("tcp",)

__all__ = [
    "BACKENDS",
    "KVReceiver",
    "KVSender",
    "PreflightError",
    "ReceiverStats",
    "SenderStats",
    "TransferError",
    "compat_for",
    "make_receiver",
    "make_sender",
]


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {backend!r}; available: {', '.join(BACKENDS)}")


def make_sender(backend: str, kv: PagedKVCache, compat: KVCompat, **options: Any) -> KVSender:
    """The prefill side of `backend`; `options` go to its constructor (tcp: sender_id, connect_timeout)."""
    _check(backend)
    from .tcp import TcpSender

    return TcpSender(kv, compat, **options)


def make_receiver(
    backend: str, kv: PagedKVCache, compat: KVCompat, accept: AcceptFn, on_done: DoneFn, **options: Any
) -> KVReceiver:
    """The decode side of `backend`; `options` go to its constructor (tcp: host, port, advertise_host)."""
    _check(backend)
    from .tcp import TcpReceiver

    return TcpReceiver(kv, compat, accept, on_done, **options)
