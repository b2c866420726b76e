"""Every message that crosses a process boundary, in one place.

Bodies are msgpack maps carrying `protocol_version`; a peer speaking another version is refused
with an error naming both versions. Streams are length-prefixed frames: a 4-byte big-endian length,
then one msgpack message. Messages are small dataclasses: block ids and token counts, never objects.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack

PROTOCOL_VERSION = 1
_LEN = struct.Struct(">I")

M = TypeVar("M", bound="Message")


class ProtocolError(ValueError):
    """A message that cannot be understood: wrong version, unknown kind, missing field."""


@dataclass
class Message:
    kind: ClassVar[str] = ""
    _registry: ClassVar[dict[str, type[Message]]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.kind:
            Message._registry[cls.kind] = cls

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["kind"] = self.kind
        d["protocol_version"] = PROTOCOL_VERSION
        return d


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.to_dict(), use_bin_type=True)


def decode(data: bytes, expect: type[M] | None = None) -> Any:
    """Decode one message; with `expect`, anything else is a ProtocolError."""
    try:
        d = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {e}") from e
    if not isinstance(d, dict):
        raise ProtocolError("a message must be a map")
    version = d.pop("protocol_version", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol_version {version} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    kind = d.pop("kind", None)
    cls = Message._registry.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if expect is not None and cls is not expect:
        raise ProtocolError(f"expected {expect.kind!r}, got {kind!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in d.items() if k in names})
    except TypeError as e:
        raise ProtocolError(f"bad {kind!r} message: {e}") from e


def frame(msg: Message) -> bytes:
    body = encode(msg)
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into messages (for length-prefixed streaming responses)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= 4:
            (n,) = _LEN.unpack_from(self._buf)
            if len(self._buf) < 4 + n:
                break
            out.append(decode(bytes(self._buf[4 : 4 + n])))
            del self._buf[: 4 + n]
        return out


# --- KV transfer (data plane) ----------------------------------------------------------------------
@dataclass
class KVCompat:
    """What two services must agree on before KV moves between them (the compatibility preflight)."""

    kind: ClassVar[str] = "kv_compat"
    model_id: str
    weights_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = "LBSHD"  # (layer, block, slot, kv_head, head_dim), K and V separate
    protocol_version: int = PROTOCOL_VERSION

    def mismatches(self, other: KVCompat) -> list[str]:
        """Names of the fields that differ, e.g. ['block_size (16 != 32)']."""
        return [
            f"{f.name} ({getattr(self, f.name)!r} != {getattr(other, f.name)!r})"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass
class KVLayerHeader(Message):
    """One layer's K and V for a list of destination blocks; raw bytes follow (all K, then all V)."""

    kind: ClassVar[str] = "kv_layer"
    request_id: str
    fence: int
    layer: int
    block_ids: list[int]
    nbytes: int
    traceparent: str | None = None


@dataclass
class KVDone(Message):
    """All layers of a request's prompt were written: decode may run it."""

    kind: ClassVar[str] = "kv_done"
    request_id: str
    fence: int
    first_token: int
    num_tokens: int
    traceparent: str | None = None


@dataclass
class KVHello(Message):
    """First message on a transport connection: the sender's compatibility record."""

    kind: ClassVar[str] = "kv_hello"
    compat: dict[str, Any] = field(default_factory=dict)
    sender_id: str = ""


@dataclass
class KVHelloReply(Message):
    kind: ClassVar[str] = "kv_hello_reply"
    ok: bool = True
    error: str = ""


# --- control plane: router <-> decode service -------------------------------------------------------
@dataclass
class GenerateRequest(Message):
    """POST /internal/generate on a decode service. mode "remote": reserve blocks and wait for a
    prefill service to write the prompt's KV; mode "local": prefill here, in chunks."""

    kind: ClassVar[str] = "generate"
    request_id: str
    token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields (stop strings stay at the router)
    mode: str = "remote"
    deadline: float | None = None  # unix time; past it every hop stops work
    traceparent: str | None = None


@dataclass
class Reserved(Message):
    """First frame of a remote-mode generate stream: where the prefill service must write."""

    kind: ClassVar[str] = "reserved"
    request_id: str
    block_ids: list[int]
    fence: int
    num_cached_tokens: int  # prompt tokens whose KV the decode service already holds (prefix cache)
    kv_endpoint: str
    decode_id: str


@dataclass
class TokenFrame(Message):
    """Generated tokens; `index` is the output position of token_ids[0], so a reader that already
    has some tokens (the first one comes from the prefill service) can skip them."""

    kind: ClassVar[str] = "tokens"
    request_id: str
    token_ids: list[int]
    index: int
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class ErrorFrame(Message):
    kind: ClassVar[str] = "error"
    request_id: str
    error: str
    code: int = 500


# --- control plane: router <-> prefill service ------------------------------------------------------
@dataclass
class PrefillRequest(Message):
    """POST /internal/prefill: compute the prompt, write its KV into the decode service's blocks."""

    kind: ClassVar[str] = "prefill"
    request_id: str
    token_ids: list[int]
    sampling: dict[str, Any]
    kv_endpoint: str
    block_ids: list[int]
    fence: int
    num_cached_tokens: int = 0  # the decode side already has these: do not send their blocks
    deadline: float | None = None
    traceparent: str | None = None


@dataclass
class PrefillResult(Message):
    kind: ClassVar[str] = "prefill_result"
    request_id: str
    first_token: int
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hits on the prefill service
    prefill_ms: float
    transfer_bytes: int


@dataclass
class AbortRequest(Message):
    """POST /internal/abort on either service: stop the request and free what it holds."""

    kind: ClassVar[str] = "abort"
    request_id: str


# --- KV transfer, nixl backend: the control connection beside the one-sided writes ------------------
# (kv_transfer/nixl.py describes the exchange; KVHello and KVDone are reused as they are.)
@dataclass
class KVNixlHelloReply(Message):
    """Answer to KVHello on a nixl control connection: the receiver's agent and where its KV tensors live."""

    kind: ClassVar[str] = "kv_nixl_hello_reply"
    ok: bool = True
    error: str = ""
    agent_metadata: bytes = b""  # nixl_agent.get_agent_metadata(): for the sender's add_remote_agent
    regions: list[list[int]] = field(default_factory=list)  # [[address, nbytes, device_id]] of K, then V
    mem_type: str = "DRAM"  # "DRAM" or "VRAM"
    num_blocks: int = 0  # blocks per layer in the receiver's tensors (the sender checks dst ids against it)


@dataclass
class KVNixlBegin(Message):
    """Sender → receiver, before the first write of a request: may I write into its blocks under `fence`?"""

    kind: ClassVar[str] = "kv_nixl_begin"
    request_id: str
    fence: int


@dataclass
class KVNixlBeginReply(Message):
    kind: ClassVar[str] = "kv_nixl_begin_reply"
    request_id: str
    fence: int
    ok: bool  # False: the fence is stale, write nothing for this (request, fence)


@dataclass
class KVNixlRevoke(Message):
    """Receiver → sender: stop writing this request; answer with KVNixlEnd once no write is in flight."""

    kind: ClassVar[str] = "kv_nixl_revoke"
    request_id: str
    fence: int


@dataclass
class KVNixlEnd(Message):
    """Sender → receiver: no more writes for (request_id, fence); `layers` writes completed and each
    brings its KVNixlLayer notification. Sent before the request's KVDone, or as the answer to a revoke.
    `layers` is -1 when the sender knows nothing of the request."""

    kind: ClassVar[str] = "kv_nixl_end"
    request_id: str
    fence: int
    layers: int
    revoked: bool = False


@dataclass
class KVNixlLayer(Message):
    """The notification a layer's WRITE carries; NIXL delivers it after the written bytes are in place."""

    kind: ClassVar[str] = "kv_nixl_layer"
    request_id: str
    fence: int
    layer: int
    num_blocks: int
    traceparent: str | None = None


# --- KV transfer, torch_dist backend: the control connection beside a pair's process group ---------
# (kv_transfer/torch_dist.py describes the exchange; KVLayerHeader and KVDone are reused as they are.)
@dataclass
class KVTorchDistHello(Message):
    """First message on a torch_dist control connection: KVHello plus the group backends the sender has."""

    kind: ClassVar[str] = "kv_torch_dist_hello"
    compat: dict[str, Any] = field(default_factory=dict)
    sender_id: str = ""
    backends: list[str] = field(default_factory=lambda: ["gloo"])  # preferred first: "nccl", "gloo"


@dataclass
class KVTorchDistHelloReply(Message):
    """The preflight's answer; when ok, where to meet for this pair's two-rank process group."""

    kind: ClassVar[str] = "kv_torch_dist_hello_reply"
    ok: bool = True
    error: str = ""
    store_port: int = 0  # the receiver's TCPStore, on the host of the control endpoint
    group: str = ""  # this pair's key prefix in that store
    backend: str = "gloo"  # "nccl" when both caches are on CUDA and both sides offer it, else "gloo"
    num_blocks: int = 0  # blocks per layer in the receiver's cache (the sender checks dst ids against it)
