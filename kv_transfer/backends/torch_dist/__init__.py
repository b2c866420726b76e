"""The `torch_dist` KV transport: torch.distributed point-to-point send/recv, one two-rank process group
per (sender, receiver) pair, one message per layer. gloo over TCP on host memory; NCCL when both caches
are on CUDA.

Endpoints pair up dynamically (any prefill service with any decode service), so there is no default
group and no init_process_group: every pair builds its own group from a store (ProcessGroupGloo /
ProcessGroupNCCL(store, rank, 2)). Endpoint "torch_dist://host:port" is the receiver's *control* listener
(TCP, length-prefixed msgpack frames of common.protocol); the receiver also runs one TCPStore (any free
port, every interface) where each pair meets under its own key prefix. Receiver = rank 0, sender = rank 1.

Handshake, once per (sender, endpoint); nothing is sent before it passed:

    S ↔ R  mutual authentication (kv_transfer.control.auth): KVAuth, KVAuthChallenge, KVAuthProof,
           KVAuthReply; the store port and group are told only to a sender that proved the secret
    S → R  KVTorchDistHello{compat, sender_id, backends}    backends the sender can use, preferred first
    R → S  KVTorchDistHelloReply{ok, error, store_port, group, backend, num_blocks}

`ok=False` is the compatibility preflight refusing (same wording as tcp, every differing field named);
the sender raises PreflightError and remembers it. Otherwise both sides build the group on
`store_port`/`group` (each blocks until the other joins, on the pair's own thread); gloo listens on the
address of the control connection, so the pair takes the route the control stream takes.

Per layer:

    S → R  KVLayerHeader{request_id, fence, layer, block_ids, nbytes, head_start, head_count}
                                                                         on the control connection, then
    S ⇒ R  send of one uint8 tensor of nbytes: the layer's K blocks then V blocks (kv_transfer.layout
           order; head_count > 0: only those heads of each block), gathered from the source blocks
           into a staging buffer
    S → R  KVDone{..., layer_writes}                                     after the request's headers

Every group call of a pair runs on that pair's one thread (they block), in the order the headers were
queued, so the n-th header describes the n-th message on both sides. The receiver checks the header
(layer, ids, heads, nbytes; a bad one closes the connection) and asks its owner
`may_write(request_id, fence)`; then its thread receives into a staging buffer and, only if the fence
was current, scatters into kv.k/v[layer, block_ids] (a head slice: into those blocks' heads head_start..).
A stale layer is still received (the stream must stay in step) and dropped. The receiver parks each
kv_done until the pair's earlier layers have landed; a layer that failed loses the pair (its stream is
out of step), and that pair's later kv_done are never delivered (the lease expires).

Fences and cancelling: as with tcp, the fence is checked when the header arrives; an accepted layer
counts as writing until its scatter is done, and `wait_idle(request_id)` waits for those. The owner makes
the fence stale first, so later headers of the request are drained, not written.

Failure: a call that fails or passes `op_timeout_s` breaks the pair (gloo closes it on a timeout): the
receiver closes the control connection, the sender drops the pair on that end or on its own failed
send, and builds a new one on its next call. Dropping a group closes its sockets, so the other side's
pending call fails at once rather than at its timeout. A send_layer cancelled after its header went out
returns at once, but its packed copy is still sent (the receiver expects it): the pair stays in step.

Cost: one gather copy on the sender and one scatter copy on the receiver per layer, beside the socket
copies (the tcp backend moves host caches without either).
"""

from __future__ import annotations

from kv_transfer.backends.torch_dist.receiver import TorchDistReceiver
from kv_transfer.backends.torch_dist.sender import TorchDistSender

__all__ = ["TorchDistReceiver", "TorchDistSender"]
