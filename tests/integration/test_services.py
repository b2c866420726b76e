"""Prefill and decode services as real processes, spoken to at the protocol level: the split path
(reserve on D, prefill on P, layer-wise KV push over TCP, decode on D) and the local path must give
the tokens the in-process engine gives, and every block must be free afterwards."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import msgspec
import pytest

from common.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    DecodeFrame,
    FrameReader,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    Reserved,
    TokenFrame,
    decode,
    encode,
)
from common.sampling_params import SamplingParams
from tests.integration.conftest import MAX_TOKENS, QUESTIONS
from tests.support.cluster import Cluster, internal_auth

pytestmark = pytest.mark.services
SERVICE_FLAGS = ("--threads", "1", "--kv-cache-mb", "64")


@pytest.fixture(scope="module", params=["nixl", "tcp", "torch_dist"])
def services(request, tmp_path_factory, redis_url):  # type: ignore[no-untyped-def]
    """The same suite runs over each KV transfer backend."""
    cluster = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    try:
        prefill = cluster.start("prefill", *SERVICE_FLAGS)
        decode_ = cluster.start("decode", *SERVICE_FLAGS, "--kv-backend", request.param)
        info = httpx.get(decode_.url + "/internal/kv", auth=internal_auth).json()
        assert info["backend"] == request.param and info["kv_endpoint"].startswith(request.param + "://")
        yield cluster, prefill, decode_
    finally:
        cluster.stop()


async def run_request(
    client: httpx.AsyncClient,
    decode_url: str,
    prefill_url: str,
    ids: list[int],
    mode: str,
    max_tokens: int = MAX_TOKENS,
    stop_after: int | None = None,
) -> tuple[list[int], str | None]:
    rid = uuid.uuid4().hex
    sampling = SamplingParams(max_tokens=max_tokens)
    req = GenerateRequest(rid, ids, sampling, mode=mode)
    tokens: list[int] = []
    async with client.stream("POST", decode_url + "/internal/generate", content=encode(req)) as r:
        assert r.status_code == 200, await r.aread()
        reader = FrameReader(DecodeFrame)
        async for chunk in r.aiter_bytes():
            for m in reader.feed(chunk):
                if isinstance(m, Reserved) and mode == "remote":
                    assert m.fence > 0 and len(m.block_ids) == -(-len(ids) // 16)
                    pr = PrefillRequest(
                        rid, ids, sampling, m.kv_endpoint, m.block_ids, m.fence, m.num_cached_tokens
                    )
                    resp = await client.post(prefill_url + "/internal/prefill", content=encode(pr))
                    assert resp.status_code == 200, resp.text
                    result = decode(resp.content, PrefillResult)
                    assert result.transfer_bytes > 0
                    tokens.append(result.first_token)  # token 0 comes from the prefill service, once
                elif isinstance(m, TokenFrame):
                    assert m.index == len(tokens), "token frames arrive in order, none lost or repeated"
                    tokens += m.token_ids
                    if m.finished:
                        return tokens, m.finish_reason
                    if stop_after is not None and len(tokens) >= stop_after:
                        return tokens, None  # leaving the block closes the stream: a disconnect
    raise AssertionError("stream ended without a finished frame")


@pytest.mark.parametrize("mode", ["remote", "local"])
def test_paths_match_the_engine_token_for_token(services, prompts, reference, mode) -> None:  # type: ignore[no-untyped-def]
    cluster, prefill, decode_ = services

    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120, auth=internal_auth) as c:
            outs = await asyncio.gather(*(run_request(c, decode_.url, prefill.url, p, mode) for p in prompts))
        return [t for t, _ in outs]

    got = asyncio.run(main())
    for g, want, q in zip(got, reference, QUESTIONS, strict=True):
        assert g == want, f"{mode} path differs for {q!r}"
    for proc in (prefill, decode_):
        h = cluster.wait_blocks_free(proc)
        assert h["free_blocks"] == h["total_blocks"], f"{proc.role} leaked blocks: {h}"
    if mode == "remote":
        stats = httpx.get(decode_.url + "/internal/kv", auth=internal_auth).json()["stats"]
        assert stats["bytes_received"] > 0 and stats["stale_drops"] == 0, stats


def test_disconnect_frees_blocks(services, prompts) -> None:  # type: ignore[no-untyped-def]
    cluster, prefill, decode_ = services

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120, auth=internal_auth) as c:
            for mode in ("remote", "local"):
                toks, reason = await run_request(
                    c, decode_.url, prefill.url, prompts[0], mode, max_tokens=200, stop_after=3
                )
                assert reason is None and len(toks) >= 3

    asyncio.run(main())
    for proc in (prefill, decode_):
        h = cluster.wait_blocks_free(proc)
        assert h["free_blocks"] == h["total_blocks"], f"{proc.role} leaked blocks after a disconnect: {h}"


def test_bad_internal_requests_are_refused(services) -> None:  # type: ignore[no-untyped-def]
    _, prefill, decode_ = services
    r = httpx.post(decode_.url + "/internal/generate", content=b"\x93not msgpack map", auth=internal_auth)
    assert r.status_code == 400 and "message" in r.json()["error"]
    VERSION = PROTOCOL_VERSION  # noqa: N806
    good = {"kind": "generate", "protocol_version": PROTOCOL_VERSION, "request_id": "x", "token_ids": [1, 2],
            "sampling": {"max_tokens": 4}}  # fmt: skip
    for change, says in [
        ({"sampling": {"max_tokens": 0}}, "max_tokens must be at least 1"),  # the struct's own check
        ({"token_ids": "abc"}, "token_ids"),  # a wrong type, named, before any handler runs
        ({"sampling": {"max_tokens": 4, "top_p": "1"}}, "top_p"),
        ({"mode": "sideways"}, "mode"),
        ({"protocol_version": 99}, f"protocol_version 99 is not supported (this side speaks {VERSION}"),
        ({"kind": "prefill"}, "kind"),
    ]:
        r = httpx.post(
            decode_.url + "/internal/generate",
            content=msgspec.msgpack.encode({**good, **change}),
            auth=internal_auth,
        )
        assert r.status_code == 400 and says in r.json()["error"]["message"], (change, r.text)
    r = httpx.post(
        decode_.url + "/internal/generate", content=b"\x00\x00\x00" * (6 << 20), auth=internal_auth
    )
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]  # larger than a frame may be
    pr = PrefillRequest("y", list(range(40)), SamplingParams(max_tokens=4), "tcp://127.0.0.1:1", [1], 1)
    r = httpx.post(prefill.url + "/internal/prefill", content=encode(pr), auth=internal_auth)
    assert r.status_code == 400 and "blocks" in r.json()["error"]["message"]
    for proc in (prefill, decode_):
        h = httpx.get(proc.url + "/health").json()
        assert h["free_blocks"] == h["total_blocks"] and h["running"] == h["waiting"] == 0, h  # nothing taken


def test_a_request_id_in_progress_is_refused(services, prompts) -> None:  # type: ignore[no-untyped-def]
    cluster, _, decode_ = services
    # 4,000 tokens: still generating when it is aborted, even on the tiny model
    req = GenerateRequest("busy-1", prompts[0], SamplingParams(max_tokens=4000), mode="local")

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120, auth=internal_auth) as c:
            url = decode_.url + "/internal/generate"
            async with c.stream("POST", url, content=encode(req)) as first:
                assert first.status_code == 200
                again = await c.post(url, content=encode(req))
                assert again.status_code == 409 and "in progress" in again.json()["error"]["message"]
                abort = AbortRequest("busy-1")
                r = await c.post(decode_.url + "/internal/abort", content=encode(abort))
                assert r.status_code == 200  # answered once the first stream is gone
                async with c.stream("POST", url, content=encode(req)) as retry:  # the id is free again
                    assert retry.status_code == 200

    asyncio.run(main())
    h = cluster.wait_blocks_free(decode_)
    assert h["free_blocks"] == h["total_blocks"], h
