"""A decode service restarted on the same address is a new incarnation: its endpoint says so, and a
sender's first contact with it drops whatever it kept for the old process (connection, NIXL agent and
descriptors, torch_dist pair) instead of failing a transfer on it. A write meant for a reservation of
the old process is refused by name, and writes nothing. Every backend, real receivers on loopback."""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Any

import pytest

from kv_transfer import Endpoint, TransferError, available_backends, make_sender
from kv_transfer.backends.nixl import NixlReceiver
from kv_transfer.backends.tcp import TcpReceiver
from kv_transfer.backends.torch_dist import TorchDistReceiver
from tests.support.cluster import free_port
from tests.support.kv_helpers import DST, SPEC, SRC, LoopReceiver, assert_moved, compat, filled, push

RECEIVERS: dict[str, Any] = {
    "tcp": TcpReceiver,
    "nixl": NixlReceiver,
    "torch_dist": functools.partial(TorchDistReceiver, op_timeout_s=20),
}


@pytest.mark.parametrize("backend", ["tcp", "nixl", "torch_dist"])
def test_a_restarted_receiver_is_a_new_incarnation_at_first_contact(backend: str) -> None:
    if backend not in available_backends():
        pytest.skip(f"{backend} does not import here")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    port = free_port()
    make = functools.partial(RECEIVERS[backend], port=port)
    src = filled(SPEC)

    async def main() -> None:
        tx = make_sender(backend, src, compat(SPEC), sender_id="p0", connect_timeout=5)
        async with LoopReceiver(make, SPEC) as first:
            await push(tx, first.endpoint, "r1", 1, [0])
            await first.wait_done(1)
        old = first.endpoint
        async with LoopReceiver(make, SPEC) as second:  # the same port, a new process start
            new = second.endpoint
            assert new != old and Endpoint.parse(new).address == Endpoint.parse(old).address
            # the next request's reservation names the new incarnation: it works at once
            await push(tx, new, "r2", 1, [0, 1])
            await second.wait_done(1)
            assert list(tx._peers) == [new], "what was kept for the old process is gone"  # type: ignore[attr-defined]
            # a write for a reservation the old process made: refused by name, nothing written
            with pytest.raises(TransferError, match="restarted"):
                await tx.send_layer(old, "r0", 1, 2, SRC, DST)
            assert list(tx._peers) == [new]  # type: ignore[attr-defined]
            await tx.close()
        assert_moved(src, second.kv, [0, 1])
        assert second.owner.arrived == [("r2", 1, 0), ("r2", 1, 1)]

    asyncio.run(main())
