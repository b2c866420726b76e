"""What every backend does the same way around its compatibility preflight.

Sender side (`PreflightSender`): one connection per receiver endpoint, opened at most once at a time per
endpoint, authenticated first (control.auth), and a refused preflight or failed authentication
remembered so that a hopeless peer is not asked again.
Receiver side (`PreflightReceiver`): authenticating a sender first (counting and logging a failure),
checking its compat record, counting and logging a refusal, and calling its owner (`may_write`,
`layer_arrived`, `kv_done`) without letting the owner's bugs break a connection.
"""

from __future__ import annotations

import asyncio
import logging
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from common.kv.kv_cache import PagedKVCache
from common.protocol import KVCompat, KVDone, Message
from common.security.secret import InternalSecret
from kv_transfer.base import (
    AuthError,
    HeadSlice,
    KVReceiver,
    KVSender,
    PreflightError,
    ReceiverOwner,
    TransferError,
)
from kv_transfer.control.auth import (
    SAME_SECRET,
    AuthFailed,
    AuthRefused,
    authenticate_sender,
    authenticate_to_receiver,
)
from kv_transfer.control.endpoint import Endpoint
from kv_transfer.control.framing import MAX_CONTROL_FRAME, Recv, Send, stream_io

P = TypeVar("P")

PREFLIGHT_FAILED = "KV compatibility preflight failed (sender != receiver): "
HANDSHAKE_TIMEOUT_S = 10.0  # a receiver drops a peer that has not authenticated and said hello by then


class ControlPeer(Protocol):
    """A sender's peer with a control connection (nixl, torch_dist)."""

    writer: asyncio.StreamWriter
    broken: str  # why it was dropped; "" while usable


async def drain_control(endpoint: str, peer: ControlPeer, drop: Callable[[str, Any, str], None]) -> None:
    """Flush peer's control connection; a broken one is dropped (drop(endpoint, peer, why)) and raises."""
    if peer.broken:
        raise TransferError(f"KV control connection to {endpoint} is gone: {peer.broken}")
    try:
        await peer.writer.drain()
    except OSError as e:
        drop(endpoint, peer, str(e))
        raise TransferError(f"KV control connection to {endpoint} broke: {e}") from e


class PreflightSender(KVSender, Generic[P]):
    """A sender that keeps one peer of type P per endpoint, made by `_connect` (which runs the preflight)."""

    def __init__(
        self,
        kv: Any,
        compat: KVCompat,
        sender_id: str,
        connect_timeout: float,
        secret: InternalSecret | None = None,
    ) -> None:
        super().__init__(kv, compat)
        self.sender_id = sender_id
        self.connect_timeout = connect_timeout  # bounds connecting, authenticating and the preflight
        self.secret = InternalSecret.from_env() if secret is None else secret
        self._peers: dict[str, P] = {}
        # endpoint -> its refusal (PreflightError or AuthError), so we do not retry a hopeless peer
        self._refused: dict[str, PreflightError] = {}
        self._connecting: dict[str, asyncio.Lock] = {}

    @abstractmethod
    async def _connect(self, endpoint: str) -> P:
        """Open a connection to endpoint, authenticate (`_authenticate`) and run the preflight; raise
        `_refuse(...)` when refused."""

    @abstractmethod
    def _retire(self, endpoint: str, peer: P) -> None:
        """Drop a peer whose receiver process is gone (it restarted under a new incarnation)."""

    async def _peer(self, endpoint: str) -> P:
        async with self._connecting.setdefault(endpoint, asyncio.Lock()):
            if endpoint in self._refused:
                refused = self._refused[endpoint]
                raise type(refused)(*refused.args)
            if endpoint not in self._peers:
                peer = await self._connect(endpoint)  # the receiver confirmed the incarnation
                self._retire_other_incarnations(endpoint)
                self._peers[endpoint] = peer
            return self._peers[endpoint]

    def _retire_other_incarnations(self, endpoint: str) -> None:
        """First contact with a new incarnation at an address: what we kept for the old process there
        (connection, agent, descriptors, a refusal) is stale; drop it now, not after a failed write."""
        new = Endpoint.parse(endpoint)
        for old in [e for e in set(self._peers) | set(self._refused) if e != endpoint]:
            if Endpoint.parse(old).address == new.address:
                self._refused.pop(old, None)
                if old in self._peers:
                    self._retire(old, self._peers[old])
                    self._peers.pop(old, None)

    @staticmethod
    def _check_incarnation(endpoint: str, incarnation: str) -> None:
        """The receiver that answered is the process the endpoint names (TransferError otherwise: the
        reservation the endpoint came with belonged to a process that is gone)."""
        want = Endpoint.parse(endpoint).incarnation
        if want and incarnation != want:
            raise TransferError(
                f"{endpoint}: the receiver there restarted (incarnation {incarnation or '?'}, this request's "
                f"reservation was made with {want})"
            )

    def _check_source(
        self, layer: int, src_block_ids: list[int], dst_block_ids: list[int], heads: HeadSlice | None = None
    ) -> None:
        """send_layer's arguments against our own cache: ValueError before anything is sent."""
        s = self.kv.spec
        if heads is not None and not (
            heads.count > 0
            and heads.src_start >= 0
            and heads.dst_start >= 0
            and heads.src_start + heads.count <= s.num_kv_heads
        ):
            raise ValueError(f"{heads} is not a range of heads within this shard's {s.num_kv_heads}")
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(
                f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks"
            )
        if not 0 <= layer < s.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {s.num_layers})")
        if any(not 0 <= b < s.num_blocks for b in src_block_ids):
            raise ValueError(f"source block ids out of range [0, {s.num_blocks}): {src_block_ids}")

    @staticmethod
    def _check_destination(num_blocks: int, dst_block_ids: list[int]) -> None:
        """Destination block ids against the receiver's cache (from its hello reply): in range, distinct."""
        if any(not 0 <= b < num_blocks for b in dst_block_ids) or len(set(dst_block_ids)) != len(
            dst_block_ids
        ):
            raise ValueError(f"bad destination block ids for [0, {num_blocks}): {dst_block_ids}")

    def _refuse(self, endpoint: str, error: str) -> PreflightError:
        """Remember that endpoint refused us; the error to raise, now and on every later call."""
        refused = self._refused[endpoint] = PreflightError(f"{endpoint} refused the KV transfer: {error}")
        return refused

    async def _authenticate(self, endpoint: str, send: Send, recv: Recv) -> None:
        """The first exchange on a new connection (control.auth), before any other message. A peer that
        cannot prove the secret, or refuses our proof, is remembered like a refusal: AuthError."""
        try:
            await authenticate_to_receiver(send, recv, self.secret, self.sender_id)
        except AuthRefused as e:
            raise self._refuse(endpoint, str(e)) from None
        except AuthFailed as e:
            err = self._refused[endpoint] = AuthError(
                f"KV peer at {endpoint} failed authentication: {SAME_SECRET} ({e.why})"
            )
            raise err from None

    async def _open_control(
        self, endpoint: str, host: str, port: int, hello: Message, reply_kind: type[Any], check: Any = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
        """Open a control connection, authenticate, send hello and read the reply (of type reply_kind).
        `check(reply)`, when given, may raise ValueError for a reply it cannot use. A refusal raises
        PreflightError, a failed authentication AuthError."""
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(host, port)
                send, recv = stream_io(reader, writer)
                await self._authenticate(endpoint, send, recv)
                await send(hello)
                reply = await recv(reply_kind, MAX_CONTROL_FRAME)
            if reply is None:
                raise ConnectionError("connection closed during the preflight")
            if check is not None:
                check(reply)
        except (OSError, TimeoutError, ValueError) as e:
            if writer is not None:
                writer.close()
            why = str(e) or type(e).__name__  # a timeout says nothing itself
            raise TransferError(f"cannot open a KV control connection to {endpoint}: {why}") from e
        except BaseException:  # refused (PreflightError, AuthError), or cancelled
            if writer is not None:
                writer.close()
            raise
        if not reply.ok:
            writer.close()
            raise self._refuse(endpoint, reply.error)
        try:
            self._check_incarnation(endpoint, reply.incarnation)
        except TransferError:
            writer.close()
            raise
        return reader, writer, reply


class PreflightReceiver(KVReceiver):
    """A receiver's preflight check and its guarded calls into the owner's callbacks."""

    _name = ""  # the backend's name in log lines
    _on_accept_error = "dropping the layer"  # what a failing `may_write` means for the caller

    def __init__(
        self,
        kv: PagedKVCache,
        compat: KVCompat,
        owner: ReceiverOwner,
        secret: InternalSecret | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        super().__init__(kv, compat, owner)
        self.secret = InternalSecret.from_env() if secret is None else secret
        self.handshake_timeout_s = handshake_timeout_s  # per step: authentication, then the hello

    async def _authenticate(self, send: Send, recv: Recv, peer: str) -> bool:
        """Authenticate a new connection's sender (control.auth) within handshake_timeout_s, before
        reading anything else from it. False: it did not prove the secret (counted in
        `stats.auth_failures` and logged, unless it closed without sending a byte); close the connection."""
        sender = "?"
        try:
            async with asyncio.timeout(self.handshake_timeout_s):
                return await authenticate_sender(send, recv, self.secret) is not None
        except AuthFailed as e:
            why, sender = e.why, e.sender_id
        except TimeoutError:
            why = f"it did not authenticate within {self.handshake_timeout_s:g} s"
        except OSError as e:
            why = f"connection lost: {e}"
        self.stats.auth_failures += 1
        self._log.warning(
            "kv %s: refusing %s (sender %r): authentication failed: %s", self._name, peer, sender, why
        )
        return False

    @property
    def _log(self) -> logging.Logger:
        return logging.getLogger(type(self).__module__)  # the backend module's logger, as before

    def _compat_problems(self, compat: KVCompat) -> list[str]:
        """What differs between a sender's compat record and ours."""
        return compat.mismatches(self.compat)

    def _refusal(self, peer: str, sender_id: Any, problems: list[str]) -> str:
        """Count and log a refused preflight; the error to send back."""
        self.stats.preflight_refusals += 1
        error = PREFLIGHT_FAILED + ", ".join(problems)
        self._log.warning("kv %s: refusing %s (%s): %s", self._name, peer, sender_id, error)
        return error

    def _accepts(self, request_id: str, fence: int) -> bool:
        try:
            return bool(self.owner.may_write(request_id, fence))
        except Exception:  # a failing owner callback must not write into blocks it could not vouch for
            self._log.exception(
                "kv %s: may_write(%r, %r) raised; %s", self._name, request_id, fence, self._on_accept_error
            )
            return False

    def _arrived(self, request_id: str, fence: int, layer: int, nbytes: int) -> None:
        """A layer write accepted under (request, fence) is in place: count it, tell the owner."""
        self.stats.layers_received += 1
        self.stats.bytes_received += nbytes
        try:
            self.owner.layer_arrived(request_id, fence, layer)
        except Exception:  # the owner's bug; the connection (and other requests on it) stays usable
            self._log.exception("kv %s: layer_arrived(%r) raised", self._name, request_id)

    def _notify_done(self, msg: KVDone) -> None:
        try:
            self.owner.kv_done(msg)
        except Exception:  # the owner's bug; the connection (and other requests on it) stays usable
            self._log.exception("kv %s: kv_done(%r) raised", self._name, msg.request_id)
