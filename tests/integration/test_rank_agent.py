"""A tensor-parallel worker rank's transfer agent (kv_transfer/ranks.py) against a real tcp receiver:
a finish with no layer write before it (every block already held by the decode side) still makes the
rank's sender, on the agent's own loop, and sends this rank's kv_done."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

from common.protocol import KVDone
from kv_transfer.backends.tcp import TcpReceiver
from kv_transfer.ranks import RankTransfer
from tests.support.kv_helpers import MODEL_KV_HEADS, LoopReceiver, filled, shard_compat, shard_spec


def test_a_rank_finishing_without_writes_still_sends_its_kv_done() -> None:
    async def main() -> None:
        receiver = LoopReceiver(
            TcpReceiver, shard_spec(MODEL_KV_HEADS, 1, 0), kv_compat=shard_compat(MODEL_KV_HEADS, 1, 0)
        )
        async with receiver:
            ours, theirs = mp.Pipe()
            kv = filled(shard_spec(MODEL_KV_HEADS, 2, 1))
            agent = RankTransfer("prefill", "", {"sender_id": "p0"}).start(
                kv, shard_compat(MODEL_KV_HEADS, 2, 1), theirs
            )
            try:
                done = KVDone("r", 1, 42, 7, 0)
                fut = asyncio.run_coroutine_threadsafe(
                    agent._op_finish("r", receiver.endpoint, done), agent.loop
                )
                await asyncio.wrap_future(fut)
                await receiver.wait_done(1)
                (got,) = receiver.done
                assert (got.layer_writes, got.src_rank, got.senders, got.first_token) == (0, 1, 2, 42)
                assert agent.senders["tcp"].sender_id == "p0/tp1"
            finally:
                agent.close()
                ours.close()

    asyncio.run(main())
