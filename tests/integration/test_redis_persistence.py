"""API keys and their limits survive a Redis restart when Redis keeps an append-only file (issue 29):
a real embedded Redis (common/cluster/redis_server.py, `data_dir=`, what `splitserve up --redis-data`
runs and what compose and the chart configure), keys made and revoked with the `splitserve keys` CLI,
and a real router with keys required, called over HTTP as clients do.

What the crash test proves, and what it cannot:

- Redis is killed with SIGKILL: it writes nothing at exit (no final fsync, no snapshot; it has no save
  points either). What comes back was in the append-only file before the kill, so the keys survive
  because each write reached the AOF as it was made, not because of a clean shutdown.
- The kill comes once the AOF holds the last write (the revocation), checked on the file. Redis writes
  the AOF before it replies (appendfsync everysec defers only the fsync), so that holds as soon as the
  CLI returns; the test checks rather than assumes it, and sleeps nowhere.
- A SIGKILL leaves the kernel's page cache alone, so it cannot tell "fsynced" from "written": that a
  crash of the machine loses at most a second is Redis' guarantee for everysec, checked here only as
  the setting the server runs with (CONFIG GET appendfsync).
- The control runs the same steps against an ephemeral Redis: every key is gone (401) where the
  persistent one answers 200 and 429, so these checks can fail.

The router runs on through the restart. Right after it, one call may meet a connection of the router's
pool that the dead server closed: the key check then answers 503 (or from the router's cache of keys
verified in the last 5 minutes), the limiter lets the call through unmetered. `settled` polls past
those answers to the one the router gives once it reads Redis again.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis

from common.cluster.redis_server import (
    LOCK_FILENAME,
    RedisServer,
    find_redis_server_binary,
    redis_server_version,
)
from common.cluster.state import connect
from router.auth.keys import KeyStore, Limits
from splitserve.cli import main as cli_main
from tests.support.cluster import Cluster, Proc, free_port, wait_until

pytestmark = pytest.mark.services

SECRET_RE = re.compile(r"sk-ss-(k_[0-9a-f]{12})-[A-Za-z0-9_-]{43}")
PREFIX = "splitserve:"  # the CLI's and the router's default key prefix
Response = httpx.Response


# ---- the CLI, the router, the files ----


def keys_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert cli_main(["keys", *argv]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def create_key(capsys: pytest.CaptureFixture[str], redis_url: str, name: str, *flags: str) -> tuple[str, str]:
    """(secret, key id) of a key made as users make them: `splitserve keys create`."""
    out = keys_cli(capsys, "create", "--name", name, "--redis-url", redis_url, *flags)
    match = SECRET_RE.search(out)
    assert match, out
    return match.group(0), match.group(1)


def models(router: Proc, secret: str) -> Response:
    """An authenticated call that touches no service: the key check alone."""
    return httpx.get(router.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=30)


def complete(router: Proc, secret: str) -> Response:
    """A generation: the key check, then its rate limits (no service runs here, so one let in ends 503
    "no decode service", after being charged)."""
    body = {"model": "default", "prompt": "Hi", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {secret}"}
    return httpx.post(router.url + "/v1/completions", json=body, headers=headers, timeout=30)


def metered(r: Response) -> bool:
    """The answer of a call the limits were checked for (refused, or let in and charged)."""
    return r.status_code == 429 or "x-ratelimit-limit-requests" in r.headers


def reads_redis(r: Response) -> bool:
    """Not the router's "cannot check API keys now" (503 from the key check)."""
    return not (r.status_code == 503 and "cannot check API keys" in r.text)


def settled(
    call: Callable[[], Response], done: Callable[[Response], bool], timeout_s: float = 15.0
) -> Response:
    """call() until done(answer), for at most timeout_s; the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = call()
        if done(r) or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def message(r: Response) -> str:
    return str(r.json()["error"]["message"])


def aof_bytes(data_dir: Path) -> bytes:
    """Every append-only file of the data dir: appendonly.aof (Redis 6), appendonlydir/*.aof (7+)."""
    return b"".join(p.read_bytes() for p in sorted(data_dir.rglob("*.aof")))


def revocation_logged(data_dir: Path, key_id: str) -> bool:
    """Whether the AOF holds `HSET <prefix>apikey:<id> revoked 1` (`splitserve keys revoke`), as RESP."""
    key = f"{PREFIX}apikey:{key_id}".encode()
    command = rb"\$4\r\nHSET\r\n\$%d\r\n%s\r\n\$7\r\nrevoked\r\n\$1\r\n1\r\n" % (len(key), re.escape(key))
    return re.search(command, aof_bytes(data_dir)) is not None


# ---- the scenario ----


class Keys:
    """Five keys, made and used before the restart:

    used       checked before and after
    fresh      made before, first used after: nothing of it cached in the router
    exhausted  --rpm 1, its minute spent before (a generation let in, the next refused)
    limited    --rpm 1, first used after
    revoked    used, then revoked (`keys revoke`) before
    """

    def __init__(self, capsys: pytest.CaptureFixture[str], redis_url: str, router: Proc) -> None:
        self.used, _ = create_key(capsys, redis_url, "used")
        self.fresh, _ = create_key(capsys, redis_url, "fresh")
        self.exhausted, _ = create_key(capsys, redis_url, "exhausted", "--rpm", "1")
        self.limited, _ = create_key(capsys, redis_url, "limited", "--rpm", "1")
        self.revoked, self.revoked_id = create_key(capsys, redis_url, "revoked")

        assert models(router, self.used).status_code == 200
        assert models(router, self.revoked).status_code == 200
        first = complete(router, self.exhausted)
        assert first.status_code == 503 and first.headers["x-ratelimit-remaining-requests"] == "0", first.text
        assert complete(router, self.exhausted).status_code == 429
        keys_cli(capsys, "revoke", self.revoked_id, "--redis-url", redis_url)
        # routers see a revocation within a second (their cache of verified keys)
        wait_until(lambda: models(router, self.revoked).status_code == 401, 10, "the revocation to apply")
        assert "revoked" in message(models(router, self.revoked))


@pytest.fixture
def logs(tmp_path: Path) -> str:
    d = tmp_path / "logs"
    d.mkdir()
    return str(d)


def test_keys_limits_and_revocations_survive_a_redis_crash(
    tmp_path: Path, logs: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "redis-data"  # does not exist yet: the server makes it, private
    server = RedisServer(port=free_port(), data_dir=data).start()
    cluster = Cluster(server.url, logs)
    try:
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        client.close()
        router = cluster.start("router", "--require-api-key")
        keys = Keys(capsys, server.url, router)

        # the last write is in the append-only file: nothing more is needed for a process crash
        wait_until(lambda: revocation_logged(data, keys.revoked_id), 10, "the revocation to reach the AOF")
        info = redis.Redis.from_url(server.url).info("persistence")
        assert (info["aof_enabled"], info["aof_last_write_status"]) == (1, "ok")
        before = server.pid
        server.restart(kill=True)  # SIGKILL: a crash; the same port and data dir
        assert server.pid != before

        # the key never used before: nothing cached, answered from the reloaded Redis
        r = settled(lambda: models(router, keys.fresh), reads_redis)
        assert r.status_code == 200, r.text
        r = settled(lambda: models(router, keys.used), reads_redis)
        assert r.status_code == 200, r.text
        # revoked stays revoked (polled past an answer from the router's cache, should one come)
        r = settled(lambda: models(router, keys.revoked), lambda r: r.status_code == 401)
        assert r.status_code == 401 and "revoked" in message(r), r.text
        # the limit applies to a key first used now: one let in, the next refused ...
        r = settled(lambda: complete(router, keys.limited), metered)
        assert r.status_code != 429 and r.headers["x-ratelimit-limit-requests"] == "1", r.text
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        r = settled(lambda: complete(router, keys.limited), metered)
        assert r.status_code == 429, r.text
        # ... and a minute spent before the crash stays spent (the bucket came back too)
        r = settled(lambda: complete(router, keys.exhausted), metered)
        assert r.status_code == 429 and "rate limit reached" in message(r), r.text
    finally:
        cluster.stop()
        server.stop()


def test_control_an_ephemeral_redis_loses_every_key(
    tmp_path: Path, logs: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same steps without a data dir (what `splitserve up` ran before --redis-data): every key is
    gone after the restart, so the checks above can fail."""
    server = RedisServer(port=free_port()).start()
    cluster = Cluster(server.url, logs)
    try:
        router = cluster.start("router", "--require-api-key")
        keys = Keys(capsys, server.url, router)
        server.restart(kill=True)

        for secret in (keys.fresh, keys.used, keys.revoked, keys.limited, keys.exhausted):
            r = settled(functools.partial(models, router, secret), lambda r: r.status_code == 401)
            assert r.status_code == 401 and "Incorrect API key" in message(r), r.text
        r = settled(lambda: complete(router, keys.exhausted), lambda r: r.status_code == 401)
        assert r.status_code == 401, r.text
    finally:
        cluster.stop()
        server.stop()


# ---- the server's data dir itself ----


def test_a_clean_restart_keeps_keys_and_one_server_owns_a_data_dir(tmp_path: Path) -> None:
    """SIGTERM (a clean shutdown) keeps the keys too; a second server on the same data dir is refused
    while the first runs (two servers appending to one AOF would corrupt it), and starts once it stopped."""

    async def make(url: str) -> str:
        client = connect(url)
        try:
            secret, _ = await KeyStore(client).create("ci", limits=Limits(tpm=1000))
            return secret
        finally:
            await client.aclose()

    async def limits(url: str, secret: str) -> Limits:
        client = connect(url)
        try:
            return (await KeyStore(client).authenticate(f"Bearer {secret}")).limits
        finally:
            await client.aclose()

    data = tmp_path / "nested" / "redis-data"
    server = RedisServer(data_dir=data).start()
    try:
        port = server.port
        secret = asyncio.run(make(server.url))
        with pytest.raises(RuntimeError, match="in use by another"):
            RedisServer(data_dir=data).start()
        server.restart()  # SIGTERM
        assert server.port == port  # a port picked at start is kept
        assert asyncio.run(limits(server.url, secret)) == Limits(tpm=1000)
        # where the AOF is: Redis 6 one file, 7+ a directory of them
        version = redis_server_version(find_redis_server_binary())
        aof = data / ("appendonly.aof" if version < (7,) else "appendonlydir")
        assert aof.exists() and (data / LOCK_FILENAME).exists(), sorted(os.listdir(data))
    finally:
        server.stop()
    again = RedisServer(data_dir=data).start()  # the data dir stays, unlocked
    try:
        assert asyncio.run(limits(again.url, secret)) == Limits(tpm=1000)
    finally:
        again.stop()
