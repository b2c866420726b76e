"""KV transfer: prefill pushes a prompt's KV cache, layer by layer, into a decode service's reserved blocks.

One interface (base.KVSender / base.KVReceiver), one backend per deployment, chosen by name. The control
plane every backend shares is in `control/` (endpoint, framing, preflight); each backend has its own
package under `backends/`, imported on demand so that a deployment only needs the libraries of the one
it uses.
"""

from __future__ import annotations

import importlib
from typing import Any

from common.kv.kv_cache import PagedKVCache
from common.protocol import KVCompat
from kv_transfer.base import (
    AuthError,
    KVReceiver,
    KVSender,
    PreflightError,
    ReceiverOwner,
    ReceiverStats,
    SenderStats,
    TransferError,
)
from kv_transfer.control.endpoint import Endpoint

BACKENDS = ("tcp", "nixl", "torch_dist")
_NEEDS = {"nixl": "nixl_cu12", "torch_dist": "torch.distributed"}  # backend -> the module it needs

__all__ = [
    "BACKENDS",
    "AuthError",
    "Endpoint",
    "KVReceiver",
    "KVSender",
    "PreflightError",
    "ReceiverOwner",
    "ReceiverStats",
    "SenderStats",
    "TransferError",
    "available_backends",
    "make_receiver",
    "make_sender",
    "resolve_backend",
]


def available_backends() -> list[str]:
    """The backends whose libraries import here (tcp always; nixl needs the nixl-cu12 package; torch_dist a
    torch built with distributed support)."""
    out = []
    for name in BACKENDS:
        try:
            if name in _NEEDS:
                module = importlib.import_module(_NEEDS[name])
                if name == "torch_dist" and not module.is_available():
                    continue
        except (ImportError, OSError):  # OSError: a shared library of the package failed to load
            continue
        out.append(name)
    return out


def resolve_backend(name: str) -> tuple[str, str]:
    """`auto` -> nixl where its library imports, else tcp. Returns (backend, why) so that the
    choice can be logged and shown: never a silent fallback."""
    if name != "auto":
        _check(name)
        if name in _NEEDS and name not in available_backends():  # before the model loads, not after
            extra = " (pip install 'splitserve[nixl]', Linux x86_64 only)" if name == "nixl" else ""
            raise ValueError(f"kv_backend={name} but its library does not import here{extra}; or use tcp")
        return name, "configured"
    if "nixl" in available_backends():
        return "nixl", "auto: nixl imports"
    return "tcp", "auto: nixl does not import here (pip install 'splitserve[nixl]' on Linux x86_64)"


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {backend!r}; available: {', '.join(BACKENDS)}")


def make_sender(backend: str, kv: PagedKVCache, compat: KVCompat, rank: int = 0, **options: Any) -> KVSender:
    """The prefill side of `backend`, sending from `kv`, the KV shard of tensor-parallel `rank` (its
    transfers' metrics and spans say it); `options` go to its constructor (tcp, nixl, torch_dist:
    sender_id, connect_timeout, secret (default: InternalSecret.from_env()); torch_dist: op_timeout_s)."""
    _check(backend)
    sender: KVSender
    if backend == "torch_dist":
        from kv_transfer.backends.torch_dist import TorchDistSender

        sender = TorchDistSender(kv, compat, **options)
    elif backend == "nixl":
        from kv_transfer.backends.nixl import NixlSender

        sender = NixlSender(kv, compat, **options)
    else:
        from kv_transfer.backends.tcp import TcpSender

        sender = TcpSender(kv, compat, **options)
    sender.rank = rank
    return sender


def make_receiver(
    backend: str,
    kv: PagedKVCache,
    compat: KVCompat,
    owner: ReceiverOwner,
    incarnation: str | None = None,
    rank: int = 0,
    **options: Any,
) -> KVReceiver:
    """The decode side of `backend`, writing into `kv` (the KV shard of tensor-parallel `rank`) for
    `owner` (who says which fences are current and hears of every layer and kv_done), advertising
    `incarnation` (default: a new id); `options` go to its constructor (tcp: host, port, advertise_host,
    secret (default: InternalSecret.from_env()), handshake_timeout_s; nixl: those and poll_active_s,
    poll_idle_s, lost_peer_grace_s; torch_dist: tcp's and op_timeout_s)."""
    _check(backend)
    receiver: KVReceiver
    if backend == "torch_dist":
        from kv_transfer.backends.torch_dist import TorchDistReceiver

        receiver = TorchDistReceiver(kv, compat, owner, **options)
    elif backend == "nixl":
        from kv_transfer.backends.nixl import NixlReceiver

        receiver = NixlReceiver(kv, compat, owner, **options)
    else:
        from kv_transfer.backends.tcp import TcpReceiver

        receiver = TcpReceiver(kv, compat, owner, **options)
    if incarnation:
        receiver.incarnation = incarnation  # the service's own: one id for its registration and endpoint
    receiver.rank = rank
    return receiver
