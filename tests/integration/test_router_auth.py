"""API keys, scopes, tenants and rate limits at the router, with real processes: a real Redis, a real
decode service and two real router processes sharing that Redis (so the limits are one budget), called
over HTTP as users do (httpx and the official openai client)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from common.cluster.redis_server import RedisServer
from common.cluster.state import connect
from router.auth.keys import KeyStore, Limits
from tests.support.cluster import Cluster, Proc, free_port, wait_router_sees, wait_until

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()  # its own: keys and limits of no other module
    c = Cluster(redis.url, str(tmp_path_factory.mktemp("logs")))
    try:
        c.start("decode", "--threads", "1", "--kv-cache-mb", "64")
        one = c.start("router", "--require-api-key")
        two = c.start("router", "--require-api-key")
        c.wait_routed()
        yield redis.url, one, two
    finally:
        c.stop()
        redis.stop()


def create_key(redis_url: str, name: str, tenant: str = "default", **kw) -> str:  # type: ignore[no-untyped-def]
    async def main() -> str:
        r = connect(redis_url)
        try:
            secret, _ = await KeyStore(r).create(name, tenant, **kw)
            return secret
        finally:
            await r.aclose()

    return asyncio.run(main())


def revoke(redis_url: str, secret: str) -> None:
    key_id = secret.split("-")[2]

    async def main() -> None:
        r = connect(redis_url)
        try:
            assert await KeyStore(r).revoke(key_id)
        finally:
            await r.aclose()

    asyncio.run(main())


def complete(router: Proc, key: str | None, max_tokens: int = 2, **extra) -> httpx.Response:  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "default", "prompt": "Hi", "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(router.url + "/v1/completions", json=body, headers=headers, timeout=120)


def test_calls_without_a_valid_key_get_401(stack) -> None:  # type: ignore[no-untyped-def]
    redis_url, router, _ = stack
    for header in [None, "Basic abc", "Bearer sk-ss-k_000000000000-" + "x" * 43, "Bearer nonsense"]:
        r = httpx.post(
            router.url + "/v1/completions",
            json={"model": "default", "prompt": "Hi"},
            headers={"Authorization": header} if header else {},
        )
        assert r.status_code == 401, (header, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(router.url + "/v1/models").status_code == 401
    assert httpx.get(router.url + "/metrics").status_code == 401
    assert httpx.get(router.url + "/v1/requests/x").status_code == 401
    assert httpx.get(router.url + "/health").status_code == 200  # probes need no key


def test_the_openai_client_works_with_a_key(stack) -> None:  # type: ignore[no-untyped-def]
    redis_url, router, _ = stack
    key = create_key(redis_url, "client")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)
    out = client.completions.create(model="default", prompt="Hi", max_tokens=2, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data]
    bad = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-wrong-key-of-some-length", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="default", prompt="Hi", max_tokens=2)


def test_scopes_and_tenants(stack) -> None:  # type: ignore[no-untyped-def]
    redis_url, router, other_router = stack
    alice = create_key(redis_url, "alice", "team-a")
    bob = create_key(redis_url, "bob", "team-b")
    admin = create_key(redis_url, "ops", "ops", scopes=("admin",))
    r = complete(router, alice)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]

    def record(key: str) -> httpx.Response:
        return httpx.get(f"{other_router.url}/v1/requests/{rid}", headers={"Authorization": f"Bearer {key}"})

    wait_until(lambda: record(alice).status_code == 200, 5, "alice's record")
    rec = record(alice).json()
    assert rec["tenant"] == "team-a" and rec["key_id"] == alice.split("-")[2] and rec["state"] == "finished"
    assert record(bob).status_code == 404  # another tenant's request does not exist, as bob can tell
    assert record(admin).status_code == 200
    m = httpx.get(router.url + "/metrics", headers={"Authorization": f"Bearer {alice}"})
    assert m.status_code == 403 and m.json()["error"]["code"] == "permission_denied"
    m = httpx.get(router.url + "/metrics", headers={"Authorization": f"Bearer {admin}"})
    assert m.status_code == 200 and 'splitserve_router_auth_refused_total{reason="forbidden"}' in m.text


def test_revocation_and_expiry_take_effect_within_a_second(stack) -> None:  # type: ignore[no-untyped-def]
    redis_url, one, two = stack
    key = create_key(redis_url, "short-lived")
    assert complete(one, key).status_code == 200 and complete(two, key).status_code == 200  # cached now
    revoke(redis_url, key)
    time.sleep(1.0)
    for router in (one, two):
        r = complete(router, key)
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
    soon = create_key(redis_url, "expiring", expires_at=time.time() + 1.0)
    assert complete(one, soon).status_code == 200
    wait_until(lambda: complete(one, soon).status_code == 401, 10, "the key to expire")
    r = complete(one, soon)
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]


def test_requests_per_minute_are_one_budget_across_two_routers(stack) -> None:  # type: ignore[no-untyped-def]
    redis_url, one, two = stack
    key = create_key(redis_url, "rpm", limits=Limits(rpm=3))
    answers = [complete((one, two)[i % 2], key) for i in range(5)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429, 429]
    ok, refused = answers[0], answers[3]
    assert ok.headers["x-ratelimit-limit-requests"] == "3"
    assert ok.headers["x-ratelimit-remaining-requests"] == "2"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and "requests per minute" in err["message"]


def test_tokens_per_minute_are_charged_up_front_and_refunded(stack) -> None:  # type: ignore[no-untyped-def]
    redis_url, router, _ = stack
    key = create_key(redis_url, "tpm", limits=Limits(tpm=200))
    too_big = complete(router, key, max_tokens=300)  # more than the key may ever use in a minute
    assert too_big.status_code == 429 and too_big.json()["error"]["param"] == "max_tokens"
    # prompt + 150 charged up front; a stop sequence ends it within a few tokens, the rest comes back
    r = complete(router, key, max_tokens=150, stop=["-", " ", "\n", "."])
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["total_tokens"]
    again = complete(router, key, max_tokens=150)  # passes only if the first was refunded to actual
    assert used < 50 and again.status_code == 200, again.text


def test_concurrent_streams_are_limited(stack) -> None:  # type: ignore[no-untyped-def]
    redis_url, one, two = stack
    key = create_key(redis_url, "one-at-a-time", limits=Limits(max_concurrent=1))
    headers = {"Authorization": f"Bearer {key}"}
    body = {
        "model": "default",
        "prompt": "Tell me a story.",
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
    }

    async def main() -> tuple[int, int]:
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", one.url + "/v1/completions", json=body, headers=headers) as first:
                assert first.status_code == 200
                it = first.aiter_bytes()
                await anext(it)  # streaming now
                second = await c.post(
                    two.url + "/v1/completions", json={**body, "stream": False}, headers=headers
                )
                async for _ in it:
                    pass
            third = await c.post(one.url + "/v1/completions", json={**body, "stream": False}, headers=headers)
            return second.status_code, third.status_code

    assert asyncio.run(main()) == (429, 200)


def test_the_first_key_turns_auth_on_and_an_open_router_stays_on_loopback(tmp_path) -> None:  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path))
    try:
        router = c.start("router", "--decode-urls", "http://127.0.0.1:9")
        assert httpx.get(router.url + "/v1/models").status_code == 200  # no key exists: open
        assert "serves anyone" in router.log_tail(50)
        opted_out = c.start("router", "--decode-urls", "http://127.0.0.1:9", "--allow-unauthenticated")
        key = create_key(redis.url, "first")
        wait_until(lambda: httpx.get(router.url + "/v1/models").status_code == 401, 5, "auth on")
        # the explicit opt-out: no key is still served, a key sent is still checked
        time.sleep(1.5)
        assert httpx.get(opted_out.url + "/v1/models").status_code == 200
        bad = httpx.get(
            opted_out.url + "/v1/models", headers={"Authorization": "Bearer sk-not-a-real-key-at-all"}
        )
        assert bad.status_code == 401
        good = httpx.get(opted_out.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert good.status_code == 200
    finally:
        c.stop()
        redis.stop()
    # on an address other machines reach, with no key: it refuses to start unless told to serve openly
    env = {**os.environ, "SPLITSERVE_ROUTER_DECODE_URLS": "http://127.0.0.1:9"}
    cmd = [sys.executable, "-m", "splitserve", "router", "--host", "0.0.0.0", "--port", str(free_port())]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--allow-unauthenticated" in p.stdout + p.stderr


def test_keys_seen_before_ride_out_a_redis_outage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Redis goes away: keys the router verified before keep working (their limits unenforced and
    counted), a key it never saw gets a retryable 503, not a 401."""
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path))
    try:
        c.start("decode", "--threads", "1", "--kv-cache-mb", "64")
        router = c.start("router", "--require-api-key")
        c.wait_routed()
        limited = create_key(redis.url, "limited", limits=Limits(rpm=100))
        admin = create_key(redis.url, "ops", scopes=("admin",))
        unseen = create_key(redis.url, "unseen")
        assert complete(router, limited).status_code == 200
        assert (
            httpx.get(router.url + "/metrics", headers={"Authorization": f"Bearer {admin}"}).status_code
            == 200
        )
        redis.stop()
        r = complete(router, limited)
        assert r.status_code == 200, r.text
        r = complete(router, unseen)
        assert r.status_code == 503 and "retry-after" in r.headers, r.text
        m = httpx.get(router.url + "/metrics", headers={"Authorization": f"Bearer {admin}"}, timeout=30)
        assert "splitserve_router_rate_limits_unenforced_total 1.0" in m.text
    finally:
        c.stop()
        redis.stop()


def test_vllm_style_router_flags(stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--api-key (from the environment, as `splitserve up` passes it), --served-model-name,
    --max-model-len and --chat-template on a real router in front of the stack's decode service."""
    redis_url, _, _ = stack
    secret = "vllm-style-api-key-0123456789"
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[[{{ m.content }}]]{% endfor %}")
    c = Cluster(redis_url, str(tmp_path))
    try:
        router = c.start(
            "router",
            "--served-model-name",
            "my-model",
            "--max-model-len",
            "64",
            "--chat-template",
            str(template),
            env={"SPLITSERVE_ROUTER_API_KEY": secret},
        )
        wait_router_sees(router, decode=1)
        auth = {"Authorization": f"Bearer {secret}"}
        assert httpx.get(router.url + "/v1/models").status_code == 401
        models = httpx.get(router.url + "/v1/models", headers=auth).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("my-model", 64)]
        tok = httpx.post(
            router.url + "/tokenize",
            headers=auth,
            json={
                "model": "my-model",
                "messages": [{"role": "user", "content": "Hi"}],
                "return_token_strs": True,
            },
        ).json()
        assert "".join(tok["token_strs"]).replace("Ġ", " ") == "[[Hi]]", tok
        r = complete(router, secret, max_tokens=4, model="my-model")
        assert r.status_code == 200 and r.json()["model"] == "my-model", r.text
        long = complete(router, secret, max_tokens=16, model="my-model", prompt="word " * 60)
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded", (
            long.text
        )
    finally:
        c.stop()
