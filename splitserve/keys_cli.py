"""`splitserve keys create|list|revoke`: the router's API keys in Redis (router.auth.keys)."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.auth.keys import ApiKey, KeyStore

URL_ENVS = ("SPLITSERVE_REDIS_URL", "SPLITSERVE_ROUTER_REDIS_URL")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class UsageError(ValueError):
    """Bad input: exit 2."""


def parse_duration(text: str) -> float:
    """ "30d", "12h", "90m", "45s", "2w" as seconds; UsageError otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*([smhdw])\s*", text)
    if not match or int(match.group(1)) == 0:
        raise UsageError(
            f"--expires-in must be a positive number and a unit (s, m, h, d, w), e.g. 30d: {text!r}"
        )
    return int(match.group(1)) * _UNITS[match.group(2)]


def _redis_url(args: argparse.Namespace) -> str:
    url = args.redis_url or next((os.environ[e] for e in URL_ENVS if os.environ.get(e)), "")
    if not url:
        raise UsageError(f"no Redis to keep the keys in: pass --redis-url or set ${' or $'.join(URL_ENVS)}")
    return url


def _when(ts: float | None) -> str:
    if ts is None:
        return "never"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%MZ")


def _limits(key: ApiKey) -> str:
    limits = key.limits.to_dict()
    return " ".join(f"{k}={v}" for k, v in limits.items()) or "-"


def _as_dict(key: ApiKey) -> dict[str, Any]:
    return {
        "key_id": key.key_id,
        "name": key.name,
        "tenant": key.tenant,
        "scopes": sorted(key.scopes),
        "limits": key.limits.to_dict(),
        "created_at": key.created_at,
        "expires_at": key.expires_at,
        "status": key.status,
        "source": key.source,
    }


def _with_store(args: argparse.Namespace, body: Callable[[KeyStore], Awaitable[int]]) -> int:
    from common.cluster.state import connect
    from router.auth.keys import KeyStore, KeyStoreUnavailable

    url = _redis_url(args)

    async def main() -> int:
        client = connect(url)
        try:
            return await body(KeyStore(client, prefix=args.redis_prefix, cache_s=0))
        finally:
            await client.aclose()

    try:
        return asyncio.run(main())
    except KeyStoreUnavailable as e:
        print(f"error: cannot reach the key store: {e}", file=sys.stderr)
        return 1


def _create(args: argparse.Namespace) -> int:
    from router.auth.keys import SCOPES, Limits

    scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
    if not scopes or not set(scopes) <= SCOPES:
        raise UsageError(
            f"--scopes must be a comma-separated subset of {','.join(sorted(SCOPES))}: {args.scopes!r}"
        )
    for flag, value in (
        ("--rpm", args.rpm), ("--tpm", args.tpm), ("--max-concurrent", args.max_concurrent),
        ("--ttft-slo-ms", args.ttft_slo_ms), ("--tpot-slo-ms", args.tpot_slo_ms),
    ):  # fmt: skip
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    if not args.name.strip() or not args.tenant.strip():
        raise UsageError("--name and --tenant must not be empty")
    limits = Limits(
        rpm=args.rpm, tpm=args.tpm, max_concurrent=args.max_concurrent, ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
    )  # fmt: skip
    expires_at = time.time() + parse_duration(args.expires_in) if args.expires_in else None

    async def body(store: KeyStore) -> int:
        secret, key = await store.create(
            args.name, args.tenant, scopes=scopes, limits=limits, expires_at=expires_at
        )
        scopes_text = ",".join(sorted(key.scopes))
        print(f"created key {key.key_id} ({key.name}, tenant {key.tenant}, scopes {scopes_text})")
        print(f"limits: {_limits(key)}; expires: {_when(key.expires_at)}")
        print()
        print(secret)
        print()
        print(
            "This secret will not be shown again: store it now. Send it as 'Authorization: Bearer <secret>'."
        )
        return 0

    return _with_store(args, body)


def _list(args: argparse.Namespace) -> int:
    async def body(store: KeyStore) -> int:
        keys = await store.list()
        if args.json:
            print(json.dumps([_as_dict(k) for k in keys], indent=2))
            return 0
        if not keys:
            print("no keys")
            return 0
        header = ("ID", "NAME", "TENANT", "SCOPES", "LIMITS", "CREATED", "EXPIRES", "STATUS")
        rows = [
            (
                k.key_id,
                k.name,
                k.tenant,
                ",".join(sorted(k.scopes)),
                _limits(k),
                _when(k.created_at),
                _when(k.expires_at),
                k.status,
            )
            for k in keys
        ]
        widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        return 0

    return _with_store(args, body)


def _revoke(args: argparse.Namespace) -> int:
    async def body(store: KeyStore) -> int:
        if not await store.revoke(args.key_id):
            print(f"error: no key {args.key_id!r}", file=sys.stderr)
            return 1
        print(f"revoked {args.key_id} (routers refuse it within a second)")
        return 0

    return _with_store(args, body)


def _run(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return run


def add_keys_parser(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis-url", default=None, help=f"the router's Redis (default: ${URL_ENVS[0]}, else ${URL_ENVS[1]})"
    )
    common.add_argument(
        "--redis-prefix", default="splitserve:", help="key prefix in Redis (default splitserve:)"
    )

    k = sub.add_parser("keys", help="create, list and revoke the router's API keys (kept in Redis)")
    ksub = k.add_subparsers(dest="keys_command", required=True)

    c = ksub.add_parser("create", parents=[common], help="make a key and print its secret (shown only once)")
    c.add_argument("--name", required=True, help="what the key is for")
    c.add_argument("--tenant", default="default", help="whose requests these are (default: default)")
    c.add_argument(
        "--scopes",
        default="inference",
        help="comma-separated: inference, metrics, admin (default: inference)",
    )
    c.add_argument("--rpm", type=int, default=None, help="requests per minute (default: unlimited)")
    c.add_argument("--tpm", type=int, default=None, help="tokens per minute, prompt + output")
    c.add_argument("--max-concurrent", type=int, default=None, help="requests in flight at once")
    c.add_argument(
        "--ttft-slo-ms", type=int, default=None, help="time-to-first-token target for requests naming none"
    )
    c.add_argument(
        "--tpot-slo-ms", type=int, default=None, help="time-per-output-token target for requests naming none"
    )
    c.add_argument("--expires-in", default=None, help="e.g. 30d, 12h, 90m (default: never)")
    c.set_defaults(func=_run(_create))

    ls = ksub.add_parser("list", parents=[common], help="every key, without secrets")
    ls.add_argument("--json", action="store_true", help="a JSON array instead of a table")
    ls.set_defaults(func=_run(_list))

    r = ksub.add_parser("revoke", parents=[common], help="revoke a key (it stays listed as revoked)")
    r.add_argument("key_id", help="the key's id (k_...), as `keys list` shows it")
    r.set_defaults(func=_run(_revoke))
