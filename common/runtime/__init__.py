"""Process helpers every role uses, the router included (no torch): the HTTP server's limits, tracing,
the CPU memory allocator's tuning."""
