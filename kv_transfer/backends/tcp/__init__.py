"""The `tcp` KV transport: one TCP connection per (sender, receiver) pair, reused for every request.

Connection = the mutual authentication (kv_transfer.control.auth: KVAuth → KVAuthChallenge → KVAuthProof
→ KVAuthReply; failed → the receiver closes), KVHello → KVHelloReply (the compatibility preflight;
refused → the receiver closes), then any number of messages, each a length-prefixed msgpack frame
(common.protocol.frame):

    KVLayerHeader{request_id, fence, layer, block_ids, nbytes, head_start, head_count}
                 followed by exactly nbytes raw bytes in the order of kv_transfer.layout (K of each block
                 in block_ids order, then V of each; head_count > 0: only those heads of each block)
    KVDone{request_id, fence, first_token, num_tokens, layer_writes}   no payload

The receiver reads the raw bytes straight into its KV tensors (recvmsg_into over the destination runs),
after checking the header (layer, block ids and heads in range, nbytes exact) and the fence. A bad header
closes the connection before any byte is written; a stale fence reads the payload into scratch and drops it.
Caches on a device are staged through one host buffer per layer (this backend moves host bytes), and so
is a head slice that is part of the receiver's shard (then scattered into its heads); the sender packs a
slice that is part of its own shard into one buffer (`send_layer(..., heads=HeadSlice)`).
"""

from kv_transfer.backends.tcp.receiver import TcpReceiver
from kv_transfer.backends.tcp.sender import TcpSender

__all__ = ["TcpReceiver", "TcpSender"]
