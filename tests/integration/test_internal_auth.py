"""Internal calls are authenticated, against real service processes: a call without the cluster secret's
proof, with a wrong secret, a stale timestamp, a replayed nonce or a tampered body gets 401 before any
handler runs (nothing reserved, nothing aborted); a process others can reach refuses to start without a
secret."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from common.protocol import (
    AbortRequest,
    DecodeFrame,
    FrameReader,
    GenerateRequest,
    TokenFrame,
    encode,
)
from common.sampling_params import SamplingParams
from common.security.identity import audience
from common.security.internal_auth import sign_headers
from common.security.secret import InternalSecret
from tests.support.cluster import INTERNAL_SECRET, Cluster, free_port, get_json, internal_auth

pytestmark = pytest.mark.services
RIGHT = InternalSecret(INTERNAL_SECRET.encode())
WRONG = InternalSecret(b"not-the-cluster-secret-at-all!!")


@pytest.fixture(scope="module")
def decode_(tmp_path_factory):  # type: ignore[no-untyped-def]
    c = Cluster(None, str(tmp_path_factory.mktemp("logs")))
    try:
        yield c.start("decode", "--threads", "1", "--kv-cache-mb", "64")
    finally:
        c.stop()


def generate_body(max_tokens: int = 4) -> bytes:
    req = GenerateRequest(
        uuid.uuid4().hex, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens), mode="local"
    )
    return encode(req)


def refusals(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("splitserve_internal_auth_refused_total{"):
            out[line.split('reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def audience_of(url: str) -> str:
    h = get_json(url + "/health")
    return audience(h["worker_id"], h["incarnation"])


def idle(url: str) -> bool:
    h = get_json(url + "/health")
    return bool(h["free_blocks"] == h["total_blocks"] and h["running"] == h["waiting"] == 0)


def test_every_forged_call_gets_401_and_reserves_nothing(decode_) -> None:  # type: ignore[no-untyped-def]
    url, path = decode_.url, "/internal/generate"
    before = refusals(url)
    body = generate_body()
    stale = sign_headers(RIGHT, "POST", path, body, now=time.time() - 120)
    tampered = sign_headers(RIGHT, "POST", path, generate_body(max_tokens=1))  # signed for another body
    cases = {
        "missing": {},
        "bad_signature": sign_headers(WRONG, "POST", path, body),
        "stale": stale,
    }
    for reason, headers in cases.items():
        r = httpx.post(url + path, content=body, headers=headers)
        assert r.status_code == 401 and reason in r.json()["error"]["message"], (reason, r.text)
    r = httpx.post(url + path, content=body, headers=tampered)
    assert r.status_code == 401, r.text
    # a call recorded on the wire and sent again: the first goes through, the copy does not (a call is
    # signed for the one process it is meant for: the worker id and incarnation /health names)
    good = sign_headers(RIGHT, "POST", path, body, audience=audience_of(url))
    assert httpx.post(url + path, content=body, headers=good).status_code == 200
    r = httpx.post(url + path, content=body, headers=good)
    assert r.status_code == 401 and "replayed" in r.text
    after = refusals(url)
    for reason, n in {"missing": 1, "bad_signature": 2, "stale": 1, "replayed": 1}.items():
        assert after.get(reason, 0) - before.get(reason, 0) == n, (reason, after)
    assert idle(url)
    # /health and /metrics stay open to probes and scrapers
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/internal/kv").status_code == 401


def test_a_forged_abort_does_not_stop_the_request(decode_) -> None:  # type: ignore[no-untyped-def]
    rid = uuid.uuid4().hex
    req = GenerateRequest(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=24, ignore_eos=True), mode="local")

    aim = audience_of(decode_.url)

    async def main() -> tuple[int, str | None, list[int]]:
        tokens: list[int] = []
        async with (
            httpx.AsyncClient(timeout=60, auth=internal_auth) as signed,
            httpx.AsyncClient(timeout=60) as forged,
            httpx.AsyncClient(timeout=60) as anonymous,
            signed.stream("POST", decode_.url + "/internal/generate", content=encode(req)) as r,
        ):
            assert r.status_code == 200
            reader, refused = FrameReader(DecodeFrame), []
            async for chunk in r.aiter_bytes():
                for m in reader.feed(chunk):
                    if isinstance(m, TokenFrame):
                        tokens += m.token_ids
                        if not refused:  # the request is running: try to abort it without the secret
                            body = encode(AbortRequest(rid))
                            # signed for this very process, with a secret that is not the cluster's
                            wrong = sign_headers(WRONG, "POST", "/internal/abort", body, audience=aim)
                            for c, headers in ((forged, wrong), (anonymous, {})):
                                a = await c.post(
                                    decode_.url + "/internal/abort", content=body, headers=headers
                                )
                                refused.append(a.status_code)
                        if m.finished:
                            return len(tokens), m.finish_reason, refused
        raise AssertionError("stream ended without a finished frame")

    n, reason, refused = asyncio.run(main())
    assert refused == [401, 401]
    assert n == 24 and reason == "length"  # it ran to the end
    assert idle(decode_.url)


def _env_without_secret() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_INTERNAL_SECRET")}
    return {**env, "UCX_NET_DEVICES": "lo"}


@pytest.mark.parametrize("role", ["decode", "prefill", "router"])
def test_a_reachable_process_without_a_secret_refuses_to_start(role) -> None:  # type: ignore[no-untyped-def]
    cmd = [sys.executable, "-m", "splitserve", role, "--host", "0.0.0.0", "--port", str(free_port())]
    p = subprocess.run(cmd, env=_env_without_secret(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "SPLITSERVE_INTERNAL_SECRET" in p.stderr and "0.0.0.0" in p.stderr
