"""A KV endpoint: "<backend>://host:port", the address a decode service's receiver advertises.

The scheme names the backend, so a prefill service picks the matching sender per endpoint; host:port is
the receiver's listener (tcp: the data stream itself; nixl and torch_dist: their control connection).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, scheme: str | None = None) -> Endpoint:
        """"tcp://host:port" (host may be "[v6addr]"); with `scheme`, any other scheme is a ValueError."""
        got, sep, rest = text.partition("://")
        host, colon, port = rest.rpartition(":")
        if not sep or not got or not colon or not host or not port.isdigit() or (scheme and got != scheme):
            want = f"{scheme or '<backend>'}://host:port"
            raise ValueError(f"not a{' ' + scheme if scheme else ''} KV endpoint: {text!r} (expected {want})")
        return cls(got, host.strip("[]"), int(port))

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"
