"""The `nixl` KV transport: NIXL agents with the UCX backend; one one-sided WRITE + notification per layer.

Endpoint "nixl://host:port" is the receiver's *control* listener (TCP, length-prefixed msgpack frames,
kv_transfer.control.framing). The KV bytes never cross it: they move agent to agent (UCX: shared memory /
CMA on one host, RDMA across hosts), straight from the sender's KV tensors into the receiver's. The
progress thread is off: the sender polls its own writes, the receiver's notification poller progresses
its agent.

Handshake, once per (sender, endpoint); nothing is written before it passed:

    S ↔ R  mutual authentication (kv_transfer.control.auth): KVAuth, KVAuthChallenge, KVAuthProof,
           KVAuthReply; the receiver's agent metadata is sent only to a sender that proved the secret
    S → R  KVHello{compat, sender_id}
    R → S  KVNixlHelloReply{ok, error, agent_metadata, regions, mem_type, num_blocks, kv_heads}

`ok=False` is the compatibility preflight refusing (same wording as tcp, every differing field named);
the sender raises PreflightError and remembers it. Otherwise the sender adds the receiver's agent and
prepares, once, a descriptor list of every (K|V, layer, block) of the receiver (`regions` = address, size
and device of its registered K and V tensors; a block of one layer is one contiguous run) next to one such
list of its own tensors; a layer's write then only picks rows from both (agent.row_indices) and NIXL
merges adjacent rows. Descriptors travel as plain integers, never pickled.

Head slices (`send_layer(..., heads=HeadSlice)`: heterogeneous tensor parallelism, the two shards hold
different KV heads). Within a block a slice is strided: one run per slot, at head `start` of that slot
(`kv_heads` in the reply says the receiver's heads per slot). Sliced writes use per-call descriptors, not
prepared lists (those are for the unsliced path; over every slot of a cache they would be millions of
rows): a sliced layer of n blocks is one WRITE over 2 * n * block_size descriptors on each side, one per
K and V slot of its blocks (agent.slice_rows: ours at src_start, the receiver's at dst_start), with one
notification as before. The receiver cannot check where a WRITE lands: the sender checks the slice
against both shards.

Per request (request_id, fence):

    S → R  KVNixlBegin{request_id, fence, agent}       before its first write ("may I write?")
    R → S  KVNixlBeginReply{ok}                        ok = owner.may_write(request_id, fence)
    S ⇒ R  WRITE of a layer's K and V blocks, notification KVNixlLayer{request_id, fence, layer,
           num_blocks, traceparent, head_count}        NIXL delivers it after the bytes are in place
    S → R  KVNixlEnd{request_id, fence, layers}        after the last write completed, then
    S → R  KVDone{..., layer_writes}                   parked by R until `layers` notifications arrived

so `kv_done` reaches the owner after every layer landed even though notifications and the control stream
are two channels. The receiver counts per sender (`agent`: the name its notifications arrive under), so
several senders may write one request (tensor-parallel prefill ranks, each its own heads), each with its
own KVNixlEnd and kv_done. A refused begin is remembered by the sender (it writes nothing for that pair
and counts `stale_skips`; the receiver counts one `stale_drops` per refused request, not per layer); its
kv_done is still passed on, as with tcp, and the owner ignores it.

Fences. A WRITE cannot be refused by its target, so the fence is checked before any write instead, and
the receiver tracks every (request, fence) it allowed until it is *settled*: its KVNixlEnd came and that
many notifications landed. To cancel, the owner makes the fence stale (no new begin passes `may_write`) and
awaits `wait_idle(request_id)`, which sends KVNixlRevoke{request_id, fence} for every open pair whose
fence `may_write` now refuses (a retry reusing the id under a current fence keeps writing: its blocks are its
own); the sender marks it revoked (nothing more is posted: the check and the post are one step of the
event loop), waits for its posted writes to finish and answers KVNixlEnd{layers, revoked}; wait_idle
returns once those notifications arrived. So when wait_idle returns, no byte of that request will land
any more and its blocks may be reused.

Limits of that guarantee:
- It rests on the sender keeping the protocol (checking and announcing before writing); the receiver can
  neither check block ids before bytes land (the sender checks them against `num_blocks`) nor stop a
  rogue agent that has its metadata. This is a trust boundary between our own services, not a fence
  against a hostile peer.
- If the control connection breaks while a request is open, nothing says when its last write lands: the
  receiver waits `lost_peer_grace_s` (2 s) before calling it settled, and drops its kv_done. The sender
  drops the peer on the first failed or abandoned (cancelled) write, which closes the connection.
- A WRITE that ends in error may have written part of its blocks and brings no notification; the
  sender drops the peer (same grace path). Each write is all K and V blocks (or their head slice) of
  one layer.
"""

from __future__ import annotations

from kv_transfer.backends.nixl.receiver import NixlReceiver
from kv_transfer.backends.nixl.sender import NixlSender

__all__ = ["NixlReceiver", "NixlSender"]
