"""What every backend does the same way around its compatibility preflight.

Sender side (`PreflightSender`): one connection per receiver endpoint, opened at most once at a time per
endpoint, and a refused preflight remembered so that a hopeless peer is not asked again.
Receiver side (`PreflightReceiver`): checking a sender's compat record, counting and logging a refusal,
and calling its owner (`may_write`, `layer_arrived`, `kv_done`) without letting the owner's bugs break a
connection.
"""

from __future__ import annotations

import asyncio
import logging
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from common.protocol import KVCompat, KVDone, Message
from kv_transfer.base import KVReceiver, KVSender, PreflightError, TransferError
from kv_transfer.control.endpoint import Endpoint
from kv_transfer.control.framing import read_msg, write_msg

P = TypeVar("P")

PREFLIGHT_FAILED = "KV compatibility preflight failed (sender != receiver): "


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

    def __init__(self, kv: Any, compat: KVCompat, sender_id: str, connect_timeout: float) -> None:
        super().__init__(kv, compat)
        self.sender_id = sender_id
        self.connect_timeout = connect_timeout
        self._peers: dict[str, P] = {}
        self._refused: dict[str, str] = {}  # endpoint -> preflight error, so we do not retry a hopeless peer
        self._connecting: dict[str, asyncio.Lock] = {}

    @abstractmethod
    async def _connect(self, endpoint: str) -> P:
        """Open a connection to endpoint and run the preflight; raise `_refuse(...)` when refused."""

    @abstractmethod
    def _retire(self, endpoint: str, peer: P) -> None:
        """Drop a peer whose receiver process is gone (it restarted under a new incarnation)."""

    async def _peer(self, endpoint: str) -> P:
        async with self._connecting.setdefault(endpoint, asyncio.Lock()):
            if endpoint in self._refused:
                raise PreflightError(self._refused[endpoint])
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

    def _check_source(self, layer: int, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """send_layer's arguments against our own cache: ValueError before anything is sent."""
        s = self.kv.spec
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
        self._refused[endpoint] = f"{endpoint} refused the KV transfer: {error}"
        return PreflightError(self._refused[endpoint])

    async def _open_control(
        self, endpoint: str, host: str, port: int, hello: Message, reply_kind: type[Any], check: Any = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
        """Open a control connection, send hello and read the reply (of type reply_kind). `check(reply)`,
        when given, may raise ValueError for a reply it cannot use. A refusal raises PreflightError."""
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(host, port)
                write_msg(writer, hello)
                await writer.drain()
                reply = await read_msg(reader, reply_kind)
            if reply is None:
                raise ConnectionError("connection closed during the preflight")
            if check is not None:
                check(reply)
        except (OSError, TimeoutError, ValueError) as e:
            if writer is not None:
                writer.close()
            raise TransferError(f"cannot open a KV control connection to {endpoint}: {e}") from e
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
