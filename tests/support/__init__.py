"""Helpers the tests share: real-process clusters, KV transport fixtures, in-memory router fakes."""
