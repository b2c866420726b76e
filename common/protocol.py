"""Every message the services exchange, in one place: typed structs (msgspec), validated when decoded.

Bodies are msgpack maps tagged with their `kind` and carrying `protocol_version`; a peer speaking
another version is refused with an error naming both versions. A field of the wrong type, a missing
field or a value its struct refuses (`SamplingParams` checks its ranges) is a `ProtocolError` where
the bytes are decoded, before any handler sees the message. Streams are length-prefixed frames: a
4-byte big-endian length, then one message; a length over the reader's limit is refused before
anything is allocated.

Messages carry block ids and token counts, never objects. The KV transports' own messages (the
preflight, per-backend control messages) live with them, under `kv_transfer/`; the two that the
services see, `KVCompat` and `KVDone`, are here.
"""

from __future__ import annotations

import struct
from typing import Any, Literal, TypeVar, overload

import msgspec

from common.parallel.partition import kv_head_ranges
from common.sampling_params import SamplingParams, TokenLogprob

# 3: sampling gained penalties, logit bias, min_p, logprobs and structured-output guides; a version-2
# peer would ignore them and sample differently, so it is refused instead
# 4: KV layer headers may carry a head slice, kv_done a sender rank (tensor parallelism), NIXL begins
# the sender's agent; a version-3 receiver would ignore the slice and write it as whole blocks
# 5: generate and prefill requests carry a cache salt; a version-4 peer would ignore it and share one
# tenant's prefix cache with every other
PROTOCOL_VERSION = 5
MAX_FRAME_BYTES = 16 << 20  # one message: a 1M-token prompt is ~5 MB of msgpack ints
_LEN = struct.Struct(">I")

M = TypeVar("M", bound="Message")


class ProtocolError(ValueError):
    """A message that cannot be understood: wrong version, unknown kind, missing or mistyped field."""


class Message(msgspec.Struct, tag_field="kind", kw_only=True):
    """Base of every message; subclasses name their `kind` with `tag=`."""

    protocol_version: int = PROTOCOL_VERSION


class _Envelope(msgspec.Struct):
    """What any message has, for explaining why one did not decode."""

    kind: Any = None
    protocol_version: Any = None


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
_envelope = msgspec.msgpack.Decoder(_Envelope)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def _decoder(expect: Any) -> msgspec.msgpack.Decoder[Any]:
    d = _decoders.get(expect)
    if d is None:
        d = _decoders[expect] = msgspec.msgpack.Decoder(expect)
    return d


@overload
def decode(data: bytes, expect: type[M]) -> M: ...
@overload
def decode(data: bytes, expect: Any) -> Any: ...
def decode(data: bytes, expect: Any) -> Any:
    """Decode one message of type `expect` (a Message subclass, or a Union of them for a channel that
    carries several kinds); anything else, or anything malformed, is a ProtocolError."""
    try:
        msg = _decoder(expect).decode(data)
    except (msgspec.DecodeError, ValueError, TypeError) as e:  # __post_init__ raises ValueError itself
        raise ProtocolError(_why(data, e)) from e
    if msg.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(_version_error(msg.protocol_version))
    return msg


def _why(data: bytes, e: Exception) -> str:
    try:
        env = _envelope.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError):
        return f"undecodable message: {e}"
    if env.protocol_version is not None and env.protocol_version != PROTOCOL_VERSION:
        return _version_error(env.protocol_version)
    return f"bad {env.kind!r} message: {e}" if isinstance(env.kind, str) else f"bad message: {e}"


def _version_error(version: Any) -> str:
    return f"protocol_version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})"


def frame(msg: Message) -> bytes:
    body = encode(msg)
    return _LEN.pack(len(body)) + body


def frame_length(head: bytes, limit: int = MAX_FRAME_BYTES) -> int:
    """The body length a 4-byte frame header announces; ProtocolError past `limit`."""
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ProtocolError(f"frame of {n} bytes exceeds the {limit}-byte limit")
    return int(n)


class FrameReader:
    """Splits a byte stream into messages of type `expect` (for length-prefixed streaming responses)."""

    def __init__(self, expect: Any, limit: int = MAX_FRAME_BYTES) -> None:
        self.expect, self.limit = expect, limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= 4:
            n = frame_length(bytes(self._buf[:4]), self.limit)
            if len(self._buf) < 4 + n:
                break
            out.append(decode(bytes(self._buf[4 : 4 + n]), self.expect))
            del self._buf[: 4 + n]
        return out


# --- control plane: router <-> decode service -------------------------------------------------------
class GenerateRequest(Message, tag="generate"):
    """POST /internal/generate on a decode service. mode "remote": reserve blocks and wait for a
    prefill service to write the prompt's KV; mode "local": prefill here, in chunks."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    mode: Literal["remote", "local"] = "remote"
    deadline: float | None = None  # unix time; past it every hop stops work
    traceparent: str | None = None
    # A migrated request: the last num_output_tokens of token_ids are output already sent to the client;
    # generation continues at that output index (seeded sampling, max_tokens and min_tokens count them).
    num_output_tokens: int = 0
    # Whose request (fair-share admission: the API key's tenant, or x-splitserve-tenant without auth) and
    # its priority class inside the tenant (lower runs first). A peer that ignores them only orders its
    # queue differently; the tokens are the same, so they need no new protocol version.
    tenant: str = ""
    priority: int = 0
    # The prefix-cache namespace (common/prefix_hash.py cache_root): the router salts each request with its
    # tenant unless an operator shares the cache; prompts under different salts share no cached KV. A peer
    # that ignored it would share one tenant's cache with another: part of protocol version 5.
    cache_salt: str = ""


class Reserved(Message, tag="reserved"):
    """First frame of a generate stream, once the request holds its blocks: in remote mode, where the
    prefill service must write (local mode: no blocks to fill, fence 0)."""

    request_id: str
    block_ids: list[int]
    fence: int
    num_cached_tokens: int  # prompt tokens whose KV the decode service already holds (prefix cache)
    kv_endpoint: str
    decode_id: str
    # a model mixing full and sliding layers (common/kv/layer_groups.py): the blocks of layer groups
    # 1.. (block_ids are group 0's); the KV preflight has checked both sides lay their cache out alike
    group_block_ids: list[list[int]] = []


class TokenFrame(Message, tag="tokens"):
    """Output tokens; `index` is the output position of token_ids[0]. In remote mode the stream starts
    at index 1: token 0 reaches the router once, from the prefill service. The last frame has a
    finish_reason (and may carry no token: token 0 itself ended the request)."""

    request_id: str
    token_ids: list[int]
    index: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request's sampling asks
    # local mode, sampling.prompt_logprobs: the first frame scores the prompt (None for its first token)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ErrorFrame(Message, tag="error"):
    """The service ended the request itself (deadline, lost peer, incomplete KV); `code` is HTTP-like."""

    request_id: str
    error: str
    code: int = 500


DecodeFrame = Reserved | TokenFrame | ErrorFrame  # what a generate stream carries


# --- control plane: router <-> prefill service ------------------------------------------------------
class PrefillRequest(Message, tag="prefill"):
    """POST /internal/prefill: compute the prompt, write its KV into the decode service's blocks."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    kv_endpoint: str
    block_ids: list[int]
    fence: int
    num_cached_tokens: int = 0  # the decode side already has these: do not send their blocks
    deadline: float | None = None
    traceparent: str | None = None
    num_output_tokens: int = 0  # as in GenerateRequest: the token sampled here is output number this
    tenant: str = ""  # as in GenerateRequest
    priority: int = 0
    cache_salt: str = ""  # as in GenerateRequest
    group_block_ids: list[list[int]] = []  # as in Reserved: layer groups 1..'s destination blocks


class PrefillResult(Message, tag="prefill_result"):
    request_id: str
    first_token: int
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hits on the prefill service
    prefill_ms: float
    transfer_bytes: int
    first_logprob: TokenLogprob | None = None  # sampling.logprobs: token 0's
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sampling.prompt_logprobs: the prompt's


class AbortRequest(Message, tag="abort"):
    """POST /internal/abort on either service: stop the request, free what it holds, answer when done."""

    request_id: str


# --- KV transfer: what the services themselves see ---------------------------------------------------
class TransferError(Exception):
    """A KV transfer could not be carried out (peer unreachable, connection lost, protocol violation,
    a tensor-parallel rank's part of it failed). kv_transfer's backends raise it and its subclasses."""


class KVCompat(msgspec.Struct, frozen=True):
    """What two services must agree on before KV moves between them (the compatibility preflight)."""

    model_id: str
    weights_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = "LBSHD"  # (layer, block, slot, kv_head, head_dim), K and V separate
    architecture: str = ""  # the model family (model_type), e.g. "gemma3_text"
    layer_groups: str = ""  # KVCacheSpec.layer_groups(): which layers slide, and their windows
    kv_scales: str = ""  # fp8 KV: a digest of the rotation and the per-channel scales (common/kv/quant.py)
    protocol_version: int = PROTOCOL_VERSION
    # Tensor parallelism: this record is rank `tp_rank` of a service with `tp_size` ranks, whose KV shard
    # holds the heads `kv_head_ranges(num_kv_heads, tp_size)[tp_rank]` of every block. The two sides of
    # a transfer may differ here (heterogeneous TP): the per-rank fields are checked by `rank_problems`.
    tp_size: int = 1
    tp_rank: int = 0

    def mismatches(self, other: KVCompat) -> list[str]:
        """Names of the fields that differ, e.g. ['block_size (16 != 32)'], then what is wrong with
        either side's rank fields."""
        out = [
            f"{name} ({getattr(self, name)!r} != {getattr(other, name)!r})"
            for name in self.__struct_fields__
            if name not in RANK_FIELDS and getattr(self, name) != getattr(other, name)
        ]
        out += self.rank_problems() + [f"peer {p}" for p in other.rank_problems()]
        if not out and not set(self.kv_heads()) & set(other.kv_heads()):
            # a sender only connects to the decode ranks its heads go to: the endpoint list is wrong
            mine, theirs = _span(self.kv_heads()), _span(other.kv_heads())
            out.append(
                f"no KV head in common: rank {self.tp_rank} of {self.tp_size} holds heads {mine}, "
                f"peer rank {other.tp_rank} of {other.tp_size} {theirs}"
            )
        return out

    def kv_heads(self) -> range:
        """The model's KV heads this rank's shard holds."""
        return kv_head_ranges(self.num_kv_heads, self.tp_size)[self.tp_rank]

    def rank_problems(self) -> list[str]:
        """Why this record's tensor-parallel fields cannot describe a KV shard (empty when they can)."""
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            return [f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}"]
        return []


RANK_FIELDS = ("tp_size", "tp_rank")


def _span(r: range) -> str:
    return f"[{r.start}, {r.stop})"


class KVDone(Message, tag="kv_done"):
    """Sender -> receiver, after a request's last layer write: the prompt's KV is in place, decode may
    run it. `layer_writes` is how many layer writes the sender completed for (request, fence); the
    receiver runs the request only if as many landed. With tensor parallelism several prefill ranks
    may write into one receiver (heterogeneous TP): each sends its own kv_done, `src_rank` naming it,
    and the receiver's request is complete once all `senders` of them arrived and their layer writes
    (summed) all landed."""

    request_id: str
    fence: int
    first_token: int
    num_tokens: int
    layer_writes: int
    traceparent: str | None = None
    src_rank: int = 0
    senders: int = 1
