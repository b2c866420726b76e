"""The mutual challenge-response every KV control connection runs before anything else crosses it.

Both ends prove that they hold the cluster's internal secret (common.security.secret) without sending
it: each proof is an HMAC over two fresh nonces, labelled by direction so that neither can be reflected
back, and checked against every secret the checking side accepts (the rotation window).

    S → R  KVAuth{nonce_s, sender_id}
    R → S  KVAuthChallenge{nonce_r, proof = sign("kv-recv", nonce_s, nonce_r)}
           the sender checks the proof; a receiver that cannot prove the secret is left at once, having
           seen nothing of the sender but a nonce
    S → R  KVAuthProof{proof = sign("kv-send", nonce_r, nonce_s)}
    R → S  KVAuthReply{ok, error}     ok=False ("authentication failed"): the receiver closes

Only then does a backend's preflight begin (KVHello, NIXL agent metadata, the torch_dist rendezvous).
A first message that is not a KVAuth is answered with KVAuthReply{ok=False, error=why} and the
connection closes. Each side bounds the exchange with its own timeout (the caller's). The exchange
authenticates the two ends; it does not encrypt or sign the bytes that follow on the connection.
"""

from __future__ import annotations

import contextlib
import os

from common.protocol import ProtocolError
from common.security.secret import InternalSecret
from kv_transfer.control.framing import Recv, Send
from kv_transfer.control.messages import NONCE_BYTES, KVAuth, KVAuthChallenge, KVAuthProof, KVAuthReply

AUTH_FRAME = 1024  # every auth message is ~150 bytes: a peer not yet authenticated gets no bigger buffer
RECEIVER_LABEL, SENDER_LABEL = "kv-recv", "kv-send"
AUTH_FAILED = "authentication failed"
SAME_SECRET = "is SPLITSERVE_INTERNAL_SECRET the same on both sides?"


class AuthFailed(Exception):
    """The peer did not prove the secret (receiver side: also a peer that broke off or sent garbage),
    or it refused our proof. `why` says which; `sender_id` is who the peer said it was ("?": unknown)."""

    def __init__(self, why: str, sender_id: str = "?") -> None:
        super().__init__(why)
        self.why, self.sender_id = why, sender_id


class AuthRefused(Exception):
    """Sender side: the receiver refused our first message itself (another protocol version); `str()` is
    the receiver's reason."""


async def authenticate_to_receiver(send: Send, recv: Recv, secret: InternalSecret, sender_id: str) -> None:
    """The sender's half: returns once both ends proved the secret. AuthFailed when the receiver's proof
    is wrong (nothing more is sent) or it refused ours; AuthRefused when it refused our KVAuth; a
    ConnectionError when it hung up; ProtocolError on a reply that is no part of this exchange."""
    nonce = os.urandom(NONCE_BYTES)
    await send(KVAuth(nonce=nonce, sender_id=sender_id))
    msg = await recv(KVAuthChallenge | KVAuthReply, AUTH_FRAME)
    if msg is None:
        raise ConnectionError("the receiver closed the connection during authentication")
    if isinstance(msg, KVAuthReply):
        if msg.ok:
            raise ProtocolError("the receiver accepted before challenging")
        raise AuthRefused(msg.error or "refused without a reason")
    if not secret.verify(msg.proof, RECEIVER_LABEL, nonce, msg.nonce):
        raise AuthFailed("its proof matches no secret we accept")
    await send(KVAuthProof(proof=secret.sign(SENDER_LABEL, msg.nonce, nonce)))
    reply = await recv(KVAuthReply, AUTH_FRAME)
    if reply is None:
        raise ConnectionError("the receiver closed the connection during authentication")
    if not reply.ok:
        raise AuthFailed(f"it refused our proof: {reply.error or AUTH_FAILED}")


async def authenticate_sender(send: Send, recv: Recv, secret: InternalSecret) -> KVAuth | None:
    """The receiver's half: the sender's KVAuth once it proved the secret; None when the peer closed the
    connection without sending a byte (a port probe, not an attempt). AuthFailed otherwise, after
    answering a bad message or proof with KVAuthReply{ok=False}; the caller closes the connection."""
    try:
        hello = await recv(KVAuth, AUTH_FRAME)
    except ProtocolError as e:  # garbage, another protocol version, or a sender that skips the auth
        await _refuse(send, f"expected kv_auth first: {e}")
        raise AuthFailed(f"bad first message: {e}") from e
    if hello is None:
        return None
    nonce = os.urandom(NONCE_BYTES)
    await send(KVAuthChallenge(nonce=nonce, proof=secret.sign(RECEIVER_LABEL, hello.nonce, nonce)))
    try:
        msg = await recv(KVAuthProof, AUTH_FRAME)
    except ProtocolError as e:
        await _refuse(send, AUTH_FAILED)
        raise AuthFailed(f"bad proof message: {e}", hello.sender_id) from e
    if msg is None:  # what a sender does when our proof does not match its secret
        raise AuthFailed(f"it hung up instead of proving the secret ({SAME_SECRET})", hello.sender_id)
    if not secret.verify(msg.proof, SENDER_LABEL, nonce, hello.nonce):
        await _refuse(send, AUTH_FAILED)
        raise AuthFailed(f"its proof matches no secret we accept ({SAME_SECRET})", hello.sender_id)
    await send(KVAuthReply(ok=True))
    return hello


async def _refuse(send: Send, error: str) -> None:
    with contextlib.suppress(OSError):  # best effort: the peer may be gone already
        await send(KVAuthReply(ok=False, error=error))
