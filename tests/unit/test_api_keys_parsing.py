"""router.auth without Redis: the static keys file, bearer parsing and static-key authentication, the
OpenAI reset-duration format, and the `splitserve keys` CLI's input checks."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from router.auth.keys import ApiKey, InvalidKey, KeyStore, Limits, load_keys_file, parse_keys_text
from router.auth.ratelimit import Decision, RateLimiter, format_reset, retry_after_header
from splitserve.cli import main as cli_main
from splitserve.keys_cli import UsageError, parse_duration

GOOD = """\
# the static keys of a small setup

ops-secret-0123456789abcdef name=ops tenant=acme scopes=inference,admin rpm=60 tpm=10000 max_concurrent=4
   plain-secret-0123456789abcdef
scraper-secret-0123456789abcdef scopes=metrics  # a comment after a key
dated-secret-0123456789abcdef expires=2030-06-01T12:00:00+02:00 name=dated
day-secret-0123456789abcdef_! expires=2030-06-01
"""


def test_keys_file_good_lines(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(GOOD)
    entries = load_keys_file(str(path))
    assert len(entries) == 5
    digests = [d for d, _ in entries]
    assert digests[0] == hashlib.sha256(b"ops-secret-0123456789abcdef").hexdigest()
    ops, plain, scraper, dated, day = (k for _, k in entries)
    assert ops == ApiKey(
        key_id="file-" + digests[0][:8],
        name="ops",
        tenant="acme",
        scopes=frozenset({"inference", "admin"}),
        limits=Limits(rpm=60, tpm=10000, max_concurrent=4),
        created_at=0.0,
        source="file",
    )
    assert plain.name == plain.key_id and plain.tenant == "default" and plain.scopes == {"inference"}
    assert not plain.limits.any() and plain.expires_at is None
    assert scraper.scopes == {"metrics"}
    assert dated.expires_at == 1906538400.0  # 2030-06-01T10:00:00Z
    assert day.expires_at == 1906502400.0  # a date alone: its start, midnight UTC
    for secret in ("ops-secret", "plain-secret", "dated-secret"):
        assert all(secret not in repr(k) for _, k in entries)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("too-short", "at least 20"),
        ("long-enough-secret-0123456789 rpm=ten", "rpm must be a positive integer"),
        ("long-enough-secret-0123456789 rpm=0", "rpm must be a positive integer"),
        ("long-enough-secret-0123456789 colour=blue", "unknown option"),
        ("long-enough-secret-0123456789 justaword", "unknown option"),
        ("long-enough-secret-0123456789 scopes=root", "scopes"),
        ("long-enough-secret-0123456789 name=a name=b", "given twice"),
        ("long-enough-secret-0123456789 tenant=", "needs a value"),
        ("long-enough-secret-0123456789 expires=tomorrow", "ISO-8601"),
        ("ops-secret-0123456789abcdef", "same secret as line 3"),
    ],
)
def test_keys_file_bad_line_names_its_number(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(GOOD + line + "\n")
    with pytest.raises(ValueError, match="line 8") as info:
        load_keys_file(str(path))
    assert message in str(info.value) and str(path) in str(info.value)
    assert "long-enough-secret" not in str(info.value)  # the error never echoes a secret


def test_static_keys_authenticate_without_redis() -> None:
    text = "ops-secret-0123456789abcdef name=ops\nold-secret-0123456789abcdef expires=2001-01-01T00:00Z\n"
    store = KeyStore(None, static=parse_keys_text(text))

    async def main() -> None:
        assert await store.any_keys() and not await KeyStore(None).any_keys()
        key = await store.authenticate("Bearer ops-secret-0123456789abcdef")
        assert key.name == "ops" and key.source == "file"
        assert await store.get(key.key_id) == key and await store.get("file-00000000") is None
        old = hashlib.sha256(b"old-secret-0123456789abcdef").hexdigest()
        assert [(k.name, k.key_id) for k in await store.list()] == [
            ("ops", key.key_id),
            (f"file-{old[:8]}",) * 2,
        ]
        cases = {
            None: "missing",
            "  ": "missing",
            "Token ops-secret-0123456789abcdef": "malformed",
            "Bearer": "malformed",
            "Bearer a b": "malformed",
            "Bearer " + "x" * 600: "malformed",
            "Bearer sk-ss-broken": "malformed",
            "Bearer ops-secret-0123456789abcdeX": "unknown",
            "Bearer sk-ss-k_0123456789ab-" + "a" * 43: "unknown",
            "Bearer old-secret-0123456789abcdef": "expired",
        }
        for header, reason in cases.items():
            with pytest.raises(InvalidKey) as info:
                await store.authenticate(header)
            assert info.value.reason == reason, header
            assert "secret" not in str(info.value)

    asyncio.run(main())


def test_limits_are_positive_integers() -> None:
    assert Limits(rpm=1).to_dict() == {"rpm": 1}
    for bad in ({"rpm": 0}, {"tpm": -5}, {"max_concurrent": 1.5}, {"rpm": True}):
        with pytest.raises(ValueError):
            Limits(**bad)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-3, "0s"),
        (0.02, "20ms"),
        (0.0171, "18ms"),  # rounded up: never announce a reset early
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (59.9996, "1m0s"),
        (90, "1m30s"),
        (360, "6m0s"),
        (3600, "1h0m0s"),
        (3723.25, "1h2m3.25s"),
    ],
)
def test_reset_duration_format(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_retry_after_header_is_whole_seconds_at_least_one() -> None:
    assert [retry_after_header(s) for s in (0.001, 0.5, 1.0, 1.01, 19.99, 20.0)] == [
        "1",
        "1",
        "1",
        "2",
        "20",
        "20",
    ]
    assert Decision(False, -1.0, "tokens", {}).never and not Decision(False, 2.0, "requests", {}).never


def test_unlimited_key_decides_without_redis() -> None:
    # a client for a port nobody listens on: any command would fail, so none may be sent
    client = aioredis.Redis(port=1, socket_connect_timeout=0.2, decode_responses=True)
    key = ApiKey("k_000000000000", "n", "t", frozenset({"inference"}), Limits(), time.time())

    async def main() -> None:
        limiter = RateLimiter(client)
        decision = await limiter.acquire(key, "r", 10**9, 60.0)
        assert decision == Decision(True, 0.0, "", {})
        await limiter.release(key, "r", 10, 0)

    asyncio.run(main())


def test_duration_parsing() -> None:
    assert (
        parse_duration("30d") == 30 * 86400
        and parse_duration("12h") == 43200
        and parse_duration("90m") == 5400
    )
    for bad in ("", "30", "d", "1.5h", "0m", "3x", "-1d"):
        with pytest.raises(UsageError):
            parse_duration(bad)


def test_keys_cli_without_a_redis_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for env in ("SPLITSERVE_REDIS_URL", "SPLITSERVE_ROUTER_REDIS_URL"):
        monkeypatch.delenv(env, raising=False)
    assert cli_main(["keys", "list"]) == 2
    err = capsys.readouterr().err
    assert "--redis-url" in err and "SPLITSERVE_REDIS_URL" in err
    with pytest.raises(SystemExit) as info:
        cli_main(["keys"])  # a subcommand is required
    assert info.value.code == 2
