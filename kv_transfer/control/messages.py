"""The messages every backend's preflight and layer stream use (backend-only ones live with their backend)."""

from __future__ import annotations

from common.protocol import KVCompat, Message


class KVHello(Message, tag="kv_hello"):
    """First message on a transport connection: the sender's compatibility record."""

    compat: KVCompat
    sender_id: str = ""


class KVHelloReply(Message, tag="kv_hello_reply"):
    ok: bool = True
    error: str = ""
    incarnation: str = ""  # the receiver process's start (a sender checks it against the endpoint's)


class KVLayerHeader(Message, tag="kv_layer"):
    """One layer's K and V for a list of destination blocks; raw bytes follow (all K, then all V)."""

    request_id: str
    fence: int
    layer: int
    block_ids: list[int]
    nbytes: int
    traceparent: str | None = None
