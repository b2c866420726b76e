"""Cluster state in Redis: request records, the worker registry, the transfer ledger; an embedded server."""
