"""The messages every backend's preflight and layer stream use (backend-only ones live with their backend)."""

from __future__ import annotations

from typing import Annotated

import msgspec

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
    """One layer's K and V for a list of destination blocks; raw bytes follow (all K, then all V).
    head_count > 0: only the receiver's local KV heads head_start .. head_start + head_count of each
    block, packed (block_size, head_count, head_dim) per block (kv_transfer/layout.py)."""

    request_id: str
    fence: int
    layer: int
    block_ids: list[int]
    nbytes: int
    traceparent: str | None = None
    head_start: int = 0
    head_count: int = 0  # 0: every head of the receiver's shard, the plain block layout


# --- authentication: the first four messages on every KV control connection (control/auth.py) ---------
NONCE_BYTES = 32
Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
Proof = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]  # an HMAC-SHA256, hex


class KVAuth(Message, tag="kv_auth"):
    """Sender → receiver, the very first message: a fresh nonce for the receiver to prove the secret on."""

    nonce: Nonce
    sender_id: str = ""


class KVAuthChallenge(Message, tag="kv_auth_challenge"):
    """Receiver → sender: its proof over both nonces, and its own fresh nonce for the sender to prove on."""

    nonce: Nonce
    proof: Proof  # sign("kv-recv", sender nonce, receiver nonce)


class KVAuthProof(Message, tag="kv_auth_proof"):
    proof: Proof  # sign("kv-send", receiver nonce, sender nonce)


class KVAuthReply(Message, tag="kv_auth_reply"):
    """Receiver → sender: the verdict on its proof (ok=False: the receiver closes the connection); also
    the answer to a first message that is not a KVAuth."""

    ok: bool
    error: str = ""
