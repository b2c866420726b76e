"""The nixl backend's control messages (beside the shared KVHello and KVDone); the exchange is described in
kv_transfer/backends/nixl/__init__.py."""

from __future__ import annotations

from common.protocol import Message


class KVNixlHelloReply(Message, tag="kv_nixl_hello_reply"):
    """Answer to KVHello on a nixl control connection: the receiver's agent and where its KV tensors live."""

    ok: bool = True
    error: str = ""
    agent_metadata: bytes = b""  # nixl_agent.get_agent_metadata(): for the sender's add_remote_agent
    regions: list[tuple[int, int, int]] = []  # (address, nbytes, device_id) of K, then V
    mem_type: str = "DRAM"  # "DRAM" or "VRAM"
    num_blocks: int = 0  # blocks per layer in the receiver's tensors (the sender checks dst ids against it)
    # KV heads per block in the receiver's tensors (its tensor-parallel shard): where a head slice lies
    # within a block over there
    kv_heads: int = 0
    incarnation: str = ""  # the receiver process's start (a sender checks it against the endpoint's)


class KVNixlBegin(Message, tag="kv_nixl_begin"):
    """Sender → receiver, before the first write of a request: may I write into its blocks under `fence`?
    `agent` is the sender's NIXL agent, the name its notifications arrive under: each sender's writes of
    a request are counted apart (several tensor-parallel prefill ranks may write one request)."""

    request_id: str
    fence: int
    agent: str = ""


class KVNixlBeginReply(Message, tag="kv_nixl_begin_reply"):
    request_id: str
    fence: int
    ok: bool  # False: the fence is stale, write nothing for this (request, fence)


class KVNixlRevoke(Message, tag="kv_nixl_revoke"):
    """Receiver → sender: stop writing this request; answer with KVNixlEnd once no write is in flight."""

    request_id: str
    fence: int


class KVNixlEnd(Message, tag="kv_nixl_end"):
    """Sender → receiver: no more writes for (request_id, fence); `layers` writes completed and each
    brings its KVNixlLayer notification. Sent before the request's KVDone, or as the answer to a revoke.
    `layers` is -1 when the sender knows nothing of the request."""

    request_id: str
    fence: int
    layers: int
    revoked: bool = False


class KVNixlLayer(Message, tag="kv_nixl_layer"):
    """The notification a layer's WRITE carries; NIXL delivers it after the written bytes are in place."""

    request_id: str
    fence: int
    layer: int
    num_blocks: int
    traceparent: str | None = None
    head_count: int = 0  # a head slice: that many heads of each block were written (0: every head)
