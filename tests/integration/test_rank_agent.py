"""A tensor-parallel worker rank's transfer agent (kv_transfer/ranks.py) over its control pipe, as rank 0
drives it: a finish with no layer write before it (every block already held by the decode side) still
makes the rank's sender, on the agent's own loop, and sends this rank's kv_done; a call that does not
decode is refused with the reason, and the agent goes on serving."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import multiprocessing.connection

import msgspec

from common.parallel.messages import AgentMessage, Finish, RankCall, RankOp, RankReply, Settle
from common.protocol import PROTOCOL_VERSION, KVDone, decode, encode
from kv_transfer.backends.tcp import TcpReceiver
from kv_transfer.ranks import RankAgent, RankTransfer
from tests.support.kv_helpers import MODEL_KV_HEADS, LoopReceiver, filled, shard_compat, shard_spec


def prefill_agent(conn: multiprocessing.connection.Connection) -> RankAgent:
    kv, compat = filled(shard_spec(MODEL_KV_HEADS, 2, 1)), shard_compat(MODEL_KV_HEADS, 2, 1)
    return RankTransfer("prefill", "", {"sender_id": "p0"}).start(kv, compat, conn)


def reply(conn: multiprocessing.connection.Connection, call_id: int) -> str:
    """Rank 0's side: read the agent's messages (its counters among them) until call_id's answer."""
    while conn.poll(10):
        msg = decode(conn.recv_bytes(), AgentMessage)
        if isinstance(msg, RankReply) and msg.call_id == call_id:
            return msg.error
    raise AssertionError(f"no answer to call {call_id}")


def call(conn: multiprocessing.connection.Connection, call_id: int, op: RankOp) -> str:
    conn.send_bytes(encode(RankCall(call_id=call_id, op=op)))
    return reply(conn, call_id)


def test_a_rank_finishing_without_writes_still_sends_its_kv_done() -> None:
    async def main() -> None:
        receiver = LoopReceiver(
            TcpReceiver, shard_spec(MODEL_KV_HEADS, 1, 0), kv_compat=shard_compat(MODEL_KV_HEADS, 1, 0)
        )
        async with receiver:
            ours, theirs = mp.Pipe()
            agent = prefill_agent(theirs)
            try:
                done = KVDone("r", 1, 42, 7, 0)
                error = await asyncio.to_thread(call, ours, 1, Finish("r", receiver.endpoint, done))
                assert error == ""
                await receiver.wait_done(1)
                (got,) = receiver.done
                assert (got.layer_writes, got.src_rank, got.senders, got.first_token) == (0, 1, 2, 42)
                assert agent.senders["tcp"].sender_id == "p0/tp1"
            finally:
                agent.close()
                ours.close()

    asyncio.run(main())


def test_a_call_that_does_not_decode_is_refused_with_the_reason() -> None:
    ours, theirs = mp.Pipe()
    agent = prefill_agent(theirs)
    try:

        def raw(call_id: int, op: dict[str, object]) -> str:
            body = {"kind": "rank_call", "protocol_version": PROTOCOL_VERSION, "call_id": call_id, "op": op}
            ours.send_bytes(msgspec.msgpack.encode(body))
            return reply(ours, call_id)

        assert raw(1, {"op": "setle", "request_id": "r"}) == (
            "rank 1: bad 'rank_call' message: Invalid value 'setle' - at `$.op.op`"
        ), "a misspelled operation"
        assert raw(2, {"op": "settle", "request_id": 7}) == (
            "rank 1: bad 'rank_call' message: Expected `str`, got `int` - at `$.op.request_id`"
        ), "a mistyped argument"
        assert "missing required field `request_id`" in raw(3, {"op": "settle"})
        assert call(ours, 4, Settle("r")) == "", "the agent goes on serving"
    finally:
        agent.close()
        ours.close()
