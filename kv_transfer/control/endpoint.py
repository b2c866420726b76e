"""A KV endpoint: "<backend>://host:port[/incarnation]", the address a decode service's receiver advertises.

The scheme names the backend, so a prefill service picks the matching sender per endpoint; host:port is
the receiver's listener (tcp: the data stream itself; nixl and torch_dist: their control connection).
The incarnation names one start of the receiver's process: a decode service restarted on the same
address advertises a new one, so a sender's cached connection, NIXL agent and preflight result for the
old process are recognized as stale on first contact, not after a failed transfer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int
    incarnation: str = ""

    @classmethod
    def parse(cls, text: str, scheme: str | None = None) -> Endpoint:
        """Parse `tcp://host:port[/incarnation]` (host may be `[v6addr]`); with `scheme`, any other scheme
        is a ValueError."""
        got, sep, rest = text.partition("://")
        address, _, incarnation = rest.partition("/")
        host, colon, port = address.rpartition(":")
        if not sep or not got or not colon or not host or not port.isdigit() or (scheme and got != scheme):
            want = f"{scheme or '<backend>'}://host:port"
            raise ValueError(f"not a{' ' + scheme if scheme else ''} KV endpoint: {text!r} (expected {want})")
        return cls(got, host.strip("[]"), int(port), incarnation)

    @property
    def address(self) -> tuple[str, str, int]:
        """What stays the same when the receiver restarts on the same port."""
        return (self.scheme, self.host, self.port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        tail = f"/{self.incarnation}" if self.incarnation else ""
        return f"{self.scheme}://{host}:{self.port}{tail}"
