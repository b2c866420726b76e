"""The torch_dist backend's preflight messages (KVLayerHeader and KVDone are shared); the exchange is
described in kv_transfer/backends/torch_dist/__init__.py."""

from __future__ import annotations

import msgspec

from common.protocol import KVCompat, Message


class KVTorchDistHello(Message, tag="kv_torch_dist_hello"):
    """First message on a torch_dist control connection: KVHello plus the group backends the sender has."""

    compat: KVCompat
    sender_id: str = ""
    backends: list[str] = msgspec.field(default_factory=lambda: ["gloo"])  # preferred first: "nccl", "gloo"


class KVTorchDistHelloReply(Message, tag="kv_torch_dist_hello_reply"):
    """The preflight's answer; when ok, where to meet for this pair's two-rank process group."""

    ok: bool = True
    error: str = ""
    store_port: int = 0  # the receiver's TCPStore, on the host of the control endpoint
    group: str = ""  # this pair's key prefix in that store
    backend: str = "gloo"  # "nccl" when both caches are on CUDA and both sides offer it, else "gloo"
    num_blocks: int = 0  # blocks per layer in the receiver's cache (the sender checks dst ids against it)
    incarnation: str = ""  # the receiver process's start (a sender checks it against the endpoint's)
