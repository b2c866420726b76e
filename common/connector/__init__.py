"""KV connectors: everything about a request whose KV crosses between services, one object per request
(`remote_kv.py`), and per role the two halves that use it. The scheduler side owns the requests (their
blocks, fence, lease and state) and turns each engine step into transfer work; the worker side is
called where the bytes move: by the model runner per layer on a prefill service (`save_layer`), by the
KV receiver on a decode service (`may_write`, `layer_arrived`, `kv_done`)."""
