"""Authenticated KV transfers: every backend's control connection runs the mutual challenge-response
(kv_transfer.control.auth) before anything else, over real sockets on 127.0.0.1 with the real backends.

Senders and receivers are given their secrets (`secret=`), so these tests do not depend on the
environment, except the one that checks the default (InternalSecret.from_env()).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from common.kv.kv_cache import PagedKVCache
from common.protocol import decode, frame, frame_length
from common.security.secret import InternalSecret
from decode_service.service import DecodeService
from kv_transfer import (
    AuthError,
    Endpoint,
    KVReceiver,
    KVSender,
    ReceiverStats,
    available_backends,
    make_receiver,
    make_sender,
)
from kv_transfer.control.auth import RECEIVER_LABEL
from kv_transfer.control.messages import (
    NONCE_BYTES,
    KVAuth,
    KVAuthChallenge,
    KVAuthProof,
    KVAuthReply,
    KVHello,
)
from tests.support.kv_helpers import DST, SPEC, SRC, LoopReceiver, assert_moved, compat, filled, push

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # read when the first NIXL agent starts

OLD = InternalSecret(b"kv-auth-tests-old-secret-0123456789")
NEW = InternalSecret(b"kv-auth-tests-new-secret-9876543210")
WRONG = InternalSecret(b"kv-auth-tests-wrong-secret-00000000")
NONE = InternalSecret()  # no secret configured: proofs with the empty key
SAME_SECRET = "failed authentication: is SPLITSERVE_INTERNAL_SECRET the same on both sides?"


def _backends() -> list[Any]:
    """Every backend; nixl is skipped only where its package does not import (as in test_kv_nixl.py)."""
    have = available_backends()
    skip = pytest.mark.skip(reason="the nixl backend needs the nixl-cu12 package")
    return [pytest.param(b, marks=() if b in have else skip) for b in ("tcp", "nixl", "torch_dist")]


BACKENDS = _backends()


def receiver(
    backend: str, secret: InternalSecret | None, handshake_timeout_s: float = 10.0
) -> LoopReceiver[KVReceiver]:
    options: dict[str, Any] = {"secret": secret, "handshake_timeout_s": handshake_timeout_s}
    if backend == "torch_dist":
        options["op_timeout_s"] = 20
    make: Callable[..., KVReceiver] = functools.partial(make_receiver, backend, **options)
    return LoopReceiver(make, SPEC)


def sender(backend: str, secret: InternalSecret | None, src: PagedKVCache | None = None) -> KVSender:
    options: dict[str, Any] = {"sender_id": "p0", "connect_timeout": 10, "secret": secret}
    if backend == "torch_dist":
        options["op_timeout_s"] = 20
    return make_sender(backend, filled(SPEC) if src is None else src, compat(SPEC), **options)


def fill_pattern(kv: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill a cache with a known pattern in place (nixl registered its memory) and return a copy."""
    kv.k.copy_(torch.arange(kv.k.numel(), dtype=kv.k.dtype).view_as(kv.k))
    kv.v.copy_(-torch.arange(kv.v.numel(), dtype=kv.v.dtype).view_as(kv.v))
    return kv.k.clone(), kv.v.clone()


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not cond():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def transfer(backend: str, rx_secret: InternalSecret | None, tx_secret: InternalSecret | None) -> None:
    """A request moves from a sender to a receiver holding the given secrets (they must agree)."""
    src = filled(SPEC)
    async with receiver(backend, rx_secret) as r:
        tx = sender(backend, tx_secret, src)
        try:
            await push(tx, r.endpoint, "r1", 1, [0, 2])
            await r.wait_done(1)
        finally:
            await tx.close()
        assert_moved(src, r.kv, [0, 2])
        assert r.rx.stats.auth_failures == 0 and r.rx.stats.layers_received == 2


async def refused(backend: str, rx_secret: InternalSecret, tx_secret: InternalSecret) -> None:
    """The sender fails with the clear error, remembered; the receiver counted one failed authentication
    and did not write one byte of its cache."""
    async with receiver(backend, rx_secret) as r:
        k, v = fill_pattern(r.kv)
        tx = sender(backend, tx_secret)
        try:
            for _ in range(2):  # the second call fails from the remembered refusal, without connecting
                with pytest.raises(AuthError, match=SAME_SECRET) as e:
                    await push(tx, r.endpoint, "r1", 1, [0, 1, 2])
                assert r.endpoint in str(e.value)
            await until(lambda: r.rx.stats.auth_failures > 0, "the receiver to count the failure")
            await asyncio.sleep(0.1)  # a second connection would be counted by now
        finally:
            await tx.close()
        stats = r.rx.stats
        assert (stats.auth_failures, stats.preflight_refusals, stats.layers_received) == (1, 0, 0)
        assert (stats.dones_received, stats.bad_messages) == (0, 0)
        assert r.owner.arrived == [] and r.done == []
        assert torch.equal(r.kv.k, k) and torch.equal(r.kv.v, v), "a refused sender changed the KV cache"


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_secret_on_both_sides_transfers(backend: str) -> None:
    asyncio.run(transfer(backend, NEW, NEW))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sender_with_the_wrong_secret_is_refused_and_writes_nothing(backend: str) -> None:
    asyncio.run(refused(backend, NEW, WRONG))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sender_signing_with_a_secret_the_receiver_does_not_accept_is_refused(backend: str) -> None:
    # rotation in the wrong order: the sender signs with NEW before the receiver accepts it. The sender
    # accepts the receiver's proof, sends its own, and the receiver refuses it.
    asyncio.run(refused(backend, OLD, InternalSecret(NEW.current, (OLD.current,))))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotation_a_receiver_on_the_new_secret_accepts_a_sender_still_signing_with_the_old(
    backend: str,
) -> None:
    # docs/security.md's order: everyone accepts NEW first; then the receiver signs with NEW and still
    # accepts OLD, while this sender signs with OLD (and accepts NEW, from the first step)
    asyncio.run(
        transfer(
            backend, InternalSecret(NEW.current, (OLD.current,)), InternalSecret(OLD.current, (NEW.current,))
        )
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receiver_with_a_secret_refuses_a_sender_without_one(backend: str) -> None:
    asyncio.run(refused(backend, NEW, NONE))


def test_rotation_windows_in_both_directions_and_closing_the_window() -> None:
    old_accepting_new = InternalSecret(OLD.current, (NEW.current,))
    new_accepting_old = InternalSecret(NEW.current, (OLD.current,))

    async def main() -> None:
        await transfer("tcp", old_accepting_new, new_accepting_old)  # the sender has moved on first
        await transfer("tcp", old_accepting_new, OLD)  # step 1 on the receiver only
        await transfer("tcp", NONE, NONE)  # two unconfigured processes still talk (loopback)
        await refused("tcp", NEW, OLD)  # the window closed: a sender still on OLD is refused
        await refused("tcp", NONE, NEW)  # a configured sender refuses an unconfigured receiver

    asyncio.run(main())


def test_the_default_secret_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_INTERNAL_SECRET", NEW.current.decode())
    monkeypatch.delenv("SPLITSERVE_INTERNAL_SECRET_ACCEPT", raising=False)

    async def main() -> None:
        await transfer("tcp", None, None)
        await refused("tcp", InternalSecret.from_env(), WRONG)

    asyncio.run(main())


class FakeReceiver:
    """A listener that does not know the secret: it answers a KVAuth with a bogus proof and records every
    byte a sender sends it."""

    def __init__(self) -> None:
        self.received = b""
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readexactly(4)
        body = await reader.readexactly(frame_length(head))
        self.received = head + body
        hello = decode(body, KVAuth)
        guess = WRONG.sign(RECEIVER_LABEL, hello.nonce, b"\x01" * NONCE_BYTES)  # all it can do
        writer.write(frame(KVAuthChallenge(nonce=b"\x01" * NONCE_BYTES, proof=guess)))
        await writer.drain()
        self.received += await reader.read()  # whatever else the sender says, until it hangs up
        writer.close()
        self.closed.set()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receiver_that_cannot_prove_the_secret_hears_nothing_but_the_auth_message(backend: str) -> None:
    async def main() -> None:
        fake = FakeReceiver()
        endpoint = str(Endpoint(backend, "127.0.0.1", await fake.start()))
        tx = sender(backend, NEW)
        try:
            with pytest.raises(AuthError, match=SAME_SECRET):
                await tx.send_layer(endpoint, "r1", 1, 0, SRC, DST)
            async with asyncio.timeout(10):
                await fake.closed.wait()
        finally:
            await tx.close()
            await fake.close()
        # one frame, our KVAuth: no proof, no KVHello (compat), nothing of the backend's preflight
        n = frame_length(fake.received[:4])
        assert len(fake.received) == 4 + n
        assert decode(fake.received[4:], KVAuth).sender_id == "p0"
        assert NEW.current not in fake.received

    asyncio.run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bogus_proof_is_refused_and_the_connection_closed_before_the_preflight(backend: str) -> None:
    async def main() -> None:
        async with receiver(backend, NEW) as r:
            ep = Endpoint.parse(r.endpoint)
            reader, writer = await asyncio.open_connection(ep.host, ep.port)
            nonce = os.urandom(NONCE_BYTES)
            writer.write(frame(KVAuth(nonce=nonce, sender_id="mallory")))
            challenge = await read(reader, KVAuthChallenge)
            assert NEW.verify(challenge.proof, RECEIVER_LABEL, nonce, challenge.nonce)  # a genuine receiver
            bogus = WRONG.sign("kv-send", challenge.nonce, nonce)
            writer.write(frame(KVAuthProof(proof=bogus)) + frame(KVHello(compat=compat(SPEC))))
            reply = await read(reader, KVAuthReply)
            assert (reply.ok, reply.error) == (False, "authentication failed")
            # closed (a reset where our hello was left unread): the hello behind the proof is never answered
            async with asyncio.timeout(5):
                with contextlib.suppress(ConnectionResetError):
                    assert await reader.read() == b""
            writer.close()
            await until(lambda: r.rx.stats.auth_failures == 1, "the receiver to count the bogus proof")
            assert r.rx.stats.preflight_refusals == 0

    asyncio.run(main())


async def read(reader: asyncio.StreamReader, expect: Any) -> Any:
    async with asyncio.timeout(5):
        head = await reader.readexactly(4)
        return decode(await reader.readexactly(frame_length(head)), expect)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("client", ["garbage", "silence"])
def test_a_stranger_is_disconnected_and_the_receiver_stays_usable(backend: str, client: str) -> None:
    src = filled(SPEC)

    async def main() -> None:
        async with receiver(backend, NEW, handshake_timeout_s=0.5) as r:
            ep = Endpoint.parse(r.endpoint)
            reader, writer = await asyncio.open_connection(ep.host, ep.port)
            if client == "garbage":
                writer.write(b"\x00\x00\x00\x05hello")
            async with asyncio.timeout(5):  # "silence": dropped after handshake_timeout_s
                got = await reader.read()  # until the receiver hangs up
            writer.close()
            if client == "garbage":  # told why, then dropped
                reply = decode(got[4 : 4 + frame_length(got[:4])], KVAuthReply)
                assert not reply.ok and "expected kv_auth first" in reply.error
            else:
                assert got == b""
            await until(lambda: r.rx.stats.auth_failures == 1, "the receiver to count the stranger")
            # a well-behaved sender is served as before
            tx = sender(backend, NEW, src)
            try:
                await push(tx, r.endpoint, "r1", 1, [1])
                await r.wait_done(1)
            finally:
                await tx.close()
            assert_moved(src, r.kv, [1])
            assert r.rx.stats.auth_failures == 1

    asyncio.run(main())


def test_auth_failures_are_exported_with_the_decode_services_transfer_counters() -> None:
    receiver = SimpleNamespace(stats=ReceiverStats(auth_failures=3), rank=0)
    service = SimpleNamespace(kv_backend="tcp", receiver=receiver, engine=SimpleNamespace(tp_workers=None))
    service.receiver_stats = lambda: DecodeService.receiver_stats(cast(Any, service))
    counters = {c.name: c for c in DecodeService.transfer_counters(cast(Any, service))}
    c = counters["splitserve_kv_transfer_auth_failures"]  # /metrics: ..._auth_failures_total{backend,rank}
    assert (c.value, c.backend, c.rank) == (3, "tcp", 0)
