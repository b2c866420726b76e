"""The messages between rank 0 and a worker rank's KV transfer agent (kv_transfer/ranks.py), over the
control pipe each worker has (common/engine/tp_workers.py).

Typed like every other process boundary (common/protocol.py: msgspec structs, tagged with their kind,
versioned): a misspelled operation, a missing or mistyped argument is a ProtocolError where the bytes
are decoded, never a tuple that unpacks wrong. Rank 0 sends `RankCall`s, each carrying one operation;
the agent answers each call once, with a `RankReply` naming the call (error "" when it went well):

    decode:  Open(rid, fence)              accept writes for (rid, fence) from now on
             Close(rid, fence)             refuse them, and answer once none is landing any more
    prefill: Finish(rid, endpoint, done)   every layer is posted: wait for them, send this rank's
                                           kv_done to each decode rank it wrote to
             Settle(rid)                   post nothing more for rid; answer once no write reads its
                                           blocks

A call the agent cannot decode is answered too, with the ProtocolError as its error, when its call id
can be read. An agent also reports on its own: `RankStats` (its sender or receiver counters, each
second they changed) and, a decode agent, `RankArrived` (every kv_done due to this rank was heard).
`RankGone` is never sent: rank 0 makes it when a worker's control pipe ends.
"""

from __future__ import annotations

import msgspec

from common.protocol import KVDone, Message


# --- rank 0 -> agent: one operation per call --------------------------------------------------------
class _Op(msgspec.Struct, tag_field="op"):
    """Base of the operations; each names itself with `tag=`."""


class Open(_Op, tag="open"):
    request_id: str
    fence: int


class Close(_Op, tag="close"):
    request_id: str
    fence: int


class Finish(_Op, tag="finish"):
    request_id: str
    endpoint: str  # the decode service's endpoint list, as the request named it
    done: KVDone  # rank 0's kv_done; each rank sends its own share of it


class Settle(_Op, tag="settle"):
    request_id: str


RankOp = Open | Close | Finish | Settle


class RankCall(Message, tag="rank_call"):
    call_id: int
    op: RankOp


# --- agent -> rank 0 ----------------------------------------------------------------------------------
class RankReply(Message, tag="rank_reply"):
    call_id: int
    error: str = ""  # "" = done; else why not ("rank 1: ...")


class RankStats(Message, tag="rank_stats"):
    """The agent's counters: a prefill agent's senders by backend (kv_transfer's SenderStats fields), a
    decode agent's receiver (ReceiverStats fields)."""

    sent: dict[str, dict[str, int]] = {}
    received: dict[str, int] | None = None


class RankArrived(Message, tag="rank_arrived"):
    """A decode agent heard every kv_done due to its rank for (request_id, fence); `why` is "" when
    every layer write landed, else why the rank's KV is incomplete."""

    request_id: str
    fence: int
    why: str


AgentMessage = RankReply | RankStats | RankArrived  # what an agent sends


class RankGone(msgspec.Struct):
    """Not sent: the worker's control pipe ended (the process exited)."""


RankReport = RankArrived | RankGone  # what rank 0 hands on to the connector (`TPWorkers.attach`)


class _CallId(msgspec.Struct):
    call_id: int | None = None


def call_id_of(data: bytes) -> int | None:
    """The call id of a message that did not decode, if it can be read (to answer that call)."""
    try:
        return msgspec.msgpack.decode(data, type=_CallId).call_id
    except (msgspec.DecodeError, ValueError, TypeError):
        return None
