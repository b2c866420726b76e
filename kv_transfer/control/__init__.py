"""The control plane every KV backend shares: one endpoint type, framed typed messages on a stream, and
the compatibility preflight (sender and receiver halves). The bytes of KV never cross it."""
