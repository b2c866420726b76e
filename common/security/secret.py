"""The cluster's shared internal secret, and the proofs made with it.

Every process of one deployment (router, prefill, decode) holds the same secret and proves it on every
internal call (an HMAC over the call, see common.security.internal_auth) and on every KV connection (a
challenge-response in each backend's preflight). The secret itself never crosses the wire.

Where it comes from (first found wins for each):
  SPLITSERVE_INTERNAL_SECRET / SPLITSERVE_INTERNAL_SECRET_FILE          the secret this process signs with
  SPLITSERVE_INTERNAL_SECRET_ACCEPT / SPLITSERVE_INTERNAL_SECRET_ACCEPT_FILE
                                   further secrets accepted (comma-separated): the rotation window

Rotating without downtime (docs/security.md): roll out ACCEPT=new; then SECRET=new, ACCEPT=old; then
drop ACCEPT. At every moment each process signs with a secret every other process accepts.

No secret configured is allowed on loopback only (`require_for_bind`): proofs are then made with the
empty key, so two unconfigured processes still talk, and a configured one refuses an unconfigured one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass

MIN_SECRET_BYTES = 16


class SecretError(ValueError):
    """The internal secret is missing where it is required, or unusable."""


def _read(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "")
    path = environ.get(f"{name}_FILE", "")
    if not value and path:
        try:
            with open(path) as f:
                value = f.read()
        except OSError as e:
            raise SecretError(f"{name}_FILE={path}: {e.strerror or e}") from e
    return value.strip()


@dataclass(frozen=True, repr=False)
class InternalSecret:
    """The secret this process signs with (b"" when none is configured) and every secret it accepts."""

    current: bytes = b""
    extra: tuple[bytes, ...] = ()

    def __repr__(self) -> str:  # never print a secret
        return f"InternalSecret(configured={self.configured}, accepted={len(self.accepted)})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> InternalSecret:
        env = os.environ if environ is None else environ
        current = _read(env, "SPLITSERVE_INTERNAL_SECRET")
        extra = [s.strip() for s in _read(env, "SPLITSERVE_INTERNAL_SECRET_ACCEPT").split(",") if s.strip()]
        for s in [current, *extra]:
            if s and len(s.encode()) < MIN_SECRET_BYTES:
                raise SecretError(
                    f"the internal secret must be at least {MIN_SECRET_BYTES} bytes "
                    "(make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
                )
        if extra and not current:
            raise SecretError(
                "SPLITSERVE_INTERNAL_SECRET_ACCEPT is set but SPLITSERVE_INTERNAL_SECRET is not"
            )
        return cls(current.encode(), tuple(s.encode() for s in extra if s != current))

    @property
    def configured(self) -> bool:
        return bool(self.current)

    @property
    def accepted(self) -> tuple[bytes, ...]:
        return (self.current, *self.extra)

    def sign(self, *parts: bytes | str) -> str:
        """HMAC-SHA256 (hex) of the parts with the current secret."""
        return _mac(self.current, parts)

    def verify(self, proof: str, *parts: bytes | str) -> bool:
        """Whether `proof` is sign(*parts) under any accepted secret (constant-time comparison)."""
        ok = False
        for key in self.accepted:
            ok |= hmac.compare_digest(_mac(key, parts), proof)
        return ok

    def require_for_bind(self, host: str, what: str) -> None:
        """SecretError when `host` is reachable from outside this machine and no secret is configured."""
        if not self.configured and not is_loopback(host):
            raise SecretError(
                f"{what} binds {host}, which other machines can reach, but no internal secret is configured: "
                "set SPLITSERVE_INTERNAL_SECRET (the same value on every router, prefill and decode process) "
                "or bind 127.0.0.1"
            )


def ensure_for_children(environ: dict[str, str] | None = None) -> None:
    """Give the processes this one starts (`splitserve up`, benchmarks) a random shared secret, unless
    one is configured: local deployments authenticate internal calls like every other."""
    env = os.environ if environ is None else environ
    if not (env.get("SPLITSERVE_INTERNAL_SECRET") or env.get("SPLITSERVE_INTERNAL_SECRET_FILE")):
        env["SPLITSERVE_INTERNAL_SECRET"] = secrets.token_urlsafe(32)


def _mac(key: bytes, parts: tuple[bytes | str, ...]) -> str:
    m = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:  # length-prefixed: ("ab", "c") and ("a", "bc") sign differently
        b = p.encode() if isinstance(p, str) else p
        m.update(len(b).to_bytes(8, "big"))
        m.update(b)
    return m.hexdigest()


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this machine only ("localhost", 127.0.0.0/8, ::1)."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:  # a host name: loopback only if every address it resolves to is
        addrs = {ai[4][0] for ai in socket.getaddrinfo(h, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addrs)
