"""A service's identity, signed with the internal secret.

Every prefill and decode process states who it is — worker id, role, URL, KV endpoint, incarnation (this
start of the process) and capacity — and signs that statement:

    sig = HMAC(secret, "splitserve-worker-v1", id, role, url, kv_endpoint, incarnation, capacity JSON)

It publishes the statement twice: in its registry entry (common/cluster/registry.py), where the router
ignores an entry whose signature does not verify (Redis is not trusted with where prompts go), and at
its /health, where a caller that is about to sign a call for it reads who answers at that URL
(common/security/internal_auth.SignedCalls). A statement only counts for the URL it names: one copied
from another service's /health and served at another address proves nothing there.

The audience of a signed call is `<id>#<incarnation>`: a call signed for one process is refused by every
other, and by a later start of the same worker (a new incarnation), so a recorded call replays nowhere.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.security.secret import InternalSecret

_VERSION = "splitserve-worker-v1"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def audience(worker_id: str, incarnation: str) -> str:
    """What a call signed for this process names (and the header `x-splitserve-audience` carries)."""
    return f"{worker_id}#{incarnation}"


def origin(url: str) -> str:
    """scheme://host:port of a URL, normalized (lower case, default port made explicit): what one
    service process answers at."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    try:
        port = parts.port or _DEFAULT_PORTS.get(scheme, 0)
    except ValueError:  # a port that is no number: matches nothing real
        port = -1
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port}"


@dataclass(frozen=True)
class WorkerIdentity:
    id: str
    role: str
    url: str
    kv_endpoint: str
    incarnation: str
    capacity: Mapping[str, Any] = field(default_factory=dict)

    @property
    def audience(self) -> str:
        return audience(self.id, self.incarnation)

    def _parts(self) -> tuple[str, ...]:
        cap = json.dumps(dict(self.capacity), sort_keys=True, separators=(",", ":"))
        return (_VERSION, self.id, self.role, self.url, self.kv_endpoint, self.incarnation, cap)

    def sign(self, secret: InternalSecret) -> str:
        return secret.sign(*self._parts())

    def verify(self, secret: InternalSecret, sig: str) -> bool:
        """Whether `sig` is this statement signed under a secret `secret` accepts."""
        return bool(sig) and secret.verify(sig, *self._parts())

    def to_json(self, secret: InternalSecret) -> dict[str, Any]:
        """The signed statement, as /health publishes it."""
        return {
            "worker_id": self.id,
            "role": self.role,
            "url": self.url,
            "kv_endpoint": self.kv_endpoint,
            "incarnation": self.incarnation,
            "capacity": dict(self.capacity),
            "sig": self.sign(secret),
        }

    @classmethod
    def from_json(cls, body: Any) -> tuple[WorkerIdentity, str]:
        """(statement, signature) from `to_json`'s shape; ValueError for anything else."""
        if not isinstance(body, dict):
            raise ValueError("no identity statement")
        try:
            fields = {k: body[k] for k in ("worker_id", "role", "url", "kv_endpoint", "incarnation", "sig")}
            capacity = body.get("capacity", {})
        except KeyError as e:
            raise ValueError(f"identity statement without {e}") from None
        if not all(isinstance(v, str) for v in fields.values()) or not isinstance(capacity, dict):
            raise ValueError("malformed identity statement")
        ident = cls(
            fields["worker_id"], fields["role"], fields["url"], fields["kv_endpoint"], fields["incarnation"],
            capacity,
        )  # fmt: skip
        return ident, fields["sig"]
