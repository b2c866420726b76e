"""Tensor parallelism inside one engine: the head/vocab partition, the collectives, the worker ranks."""
