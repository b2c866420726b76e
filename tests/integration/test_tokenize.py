"""POST /tokenize and POST /detokenize on a real router app (in process, the real SmolLM2 tokenizer), with
the fake decode/prefill services behind it only to see what the generation endpoints send for the same
input: the ids must be the same ones, the shapes vLLM's, bad input OpenAI-style 400s, keys enforced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.router_fakes import FakeCluster, make_router, model_info

pytestmark = pytest.mark.anyio
TOK = model_info().tokenizer
MSGS = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 12 + 30? Réponds en français 🙂"},
]
TEXTS = [
    "Hello there, how are you?",
    " leading space and trailing  ",
    "héllo wörld, naïve café",
    "日本語のテキストと中文",
    "emoji 🙂👍🏽 and a flag 🇫🇷",
    "tabs\tand\nnew lines\r\n12345",
    "<|im_start|>user\nspecial tokens as text<|im_end|>",
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster(TOK.encode(" fine", add_special_tokens=False))


@pytest.fixture
async def client(cluster: FakeCluster) -> Any:
    async with make_router(cluster) as c:
        yield c


async def tokenize(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    resp = await client.post("/tokenize", json={"model": "default", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def detokenize(client: httpx.AsyncClient, tokens: list[int]) -> str:
    resp = await client.post("/detokenize", json={"model": "default", "tokens": tokens})
    assert resp.status_code == 200, resp.text
    assert set(resp.json()) == {"prompt"}
    return resp.json()["prompt"]


@pytest.mark.parametrize("text", TEXTS)
async def test_tokenize_is_the_tokenizers_encode(client: httpx.AsyncClient, text: str) -> None:
    out = await tokenize(client, prompt=text)
    assert out == {
        "count": len(TOK.encode(text)),
        "max_model_len": model_info().context_length,
        "tokens": TOK.encode(text),
    }
    plain = await tokenize(client, prompt=text, add_special_tokens=False)
    assert plain["tokens"] == TOK.encode(text, add_special_tokens=False)


async def test_model_may_be_left_out_or_named_by_any_alias(client: httpx.AsyncClient) -> None:
    ids = TOK.encode("hi there")
    for model in ["default", model_info().model_id]:
        assert (await tokenize(client, model=model, prompt="hi there"))["tokens"] == ids
    resp = await client.post("/tokenize", json={"prompt": "hi there"})
    assert resp.status_code == 200 and resp.json()["tokens"] == ids
    resp = await client.post("/detokenize", json={"tokens": ids})
    assert resp.status_code == 200 and resp.json() == {"prompt": "hi there"}


async def test_token_strs_are_the_vocabularys_strings(client: httpx.AsyncClient) -> None:
    out = await tokenize(client, prompt="hi there", return_token_strs=True)
    assert out["tokens"] == [6004, 665] and out["token_strs"] == ["hi", "Ġthere"]
    out = await tokenize(client, messages=MSGS, return_token_strs=True)
    assert out["token_strs"] == [TOK.id_to_token(i) for i in out["tokens"]]
    assert out["token_strs"][0] == "<|im_start|>" and len(out["token_strs"]) == out["count"]
    offs: list[dict[str, Any]] = [{}, {"return_token_strs": False}, {"return_token_strs": None}]
    for off in offs:
        assert "token_strs" not in await tokenize(client, prompt="hi", **off)


async def test_chat_tokenize_is_what_a_chat_completion_sends(
    client: httpx.AsyncClient, cluster: FakeCluster
) -> None:
    out = await tokenize(client, messages=MSGS)
    text = TOK.apply_chat_template(MSGS, add_generation_prompt=True)
    assert out["tokens"] == TOK.encode(text, add_special_tokens=False) and out["count"] == len(out["tokens"])
    assert text.endswith("<|im_start|>assistant\n")
    resp = await client.post(
        "/v1/chat/completions", json={"model": "default", "messages": MSGS, "max_tokens": 1}
    )
    assert resp.status_code == 200, resp.text
    assert cluster.generate_calls[-1][1].token_ids == out["tokens"]
    # text content parts are the same message
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MSGS]
    assert (await tokenize(client, messages=parts))["tokens"] == out["tokens"]
    # and the detokenized ids are the rendered template, special tokens included
    assert await detokenize(client, out["tokens"]) == text


async def test_prompt_tokenize_is_what_a_completion_sends(
    client: httpx.AsyncClient, cluster: FakeCluster
) -> None:
    for text in TEXTS[:3]:
        out = await tokenize(client, prompt=text)
        body = {"model": "default", "prompt": text, "max_tokens": 1}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert cluster.generate_calls[-1][1].token_ids == out["tokens"]


async def test_chat_flags(client: httpx.AsyncClient) -> None:
    no_prompt = await tokenize(client, messages=MSGS, add_generation_prompt=False)
    text = TOK.apply_chat_template(MSGS, add_generation_prompt=False)
    assert no_prompt["tokens"] == TOK.encode(text, add_special_tokens=False)
    full = await tokenize(client, messages=MSGS)
    assert full["tokens"][: no_prompt["count"]] == no_prompt["tokens"] and full["count"] > no_prompt["count"]
    special = await tokenize(client, messages=MSGS, add_special_tokens=True)
    assert special["tokens"] == TOK.encode(TOK.apply_chat_template(MSGS), add_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
async def test_detokenize_inverts_tokenize(client: httpx.AsyncClient, text: str) -> None:
    ids = (await tokenize(client, prompt=text))["tokens"]
    assert await detokenize(client, ids) == text


async def test_detokenize_any_id_in_the_vocabulary(client: httpx.AsyncClient) -> None:
    last = TOK.vocab_size - 1
    ids = [0, 1, 2, last]
    assert await detokenize(client, ids) == TOK.decode(ids, skip_special_tokens=False)


TOKENIZE_BAD: list[tuple[dict[str, Any], str | None, str | None]] = [
    ({"model": "gpt-4", "prompt": "hi"}, "model", "model_not_found"),
    ({"model": "gpt-4", "messages": MSGS}, "model", "model_not_found"),
    ({"model": 5, "prompt": "hi"}, "model", None),
    ({"model": "default"}, "prompt", None),
    ({"model": "default", "prompt": ""}, "prompt", None),
    ({"model": "default", "prompt": 5}, "prompt", None),
    ({"model": "default", "prompt": [1, 2]}, "prompt", None),
    ({"model": "default", "prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens", None),
    ({"model": "default", "prompt": "hi", "return_token_strs": 1}, "return_token_strs", None),
    ({"model": "default", "prompt": "hi", "messages": MSGS}, "prompt", None),
    ({"model": "default", "messages": []}, "messages", None),
    ({"model": "default", "messages": "hi"}, "messages", None),
    ({"model": "default", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", None),
    ({"model": "default", "messages": [{"role": "user", "content": 5}]}, "messages.0.content", None),
    (
        {"model": "default", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages.0.content",
        None,
    ),
    ({"model": "default", "messages": MSGS, "add_generation_prompt": 1}, "add_generation_prompt", None),
    ({"model": "default", "messages": MSGS, "continue_final_message": True}, "continue_final_message", None),
    ({"model": "default", "messages": MSGS, "chat_template": "{{ x }}"}, "chat_template", None),
]
DETOKENIZE_BAD: list[tuple[dict[str, Any], str | None, str | None]] = [
    ({"model": "gpt-4", "tokens": [1]}, "model", "model_not_found"),
    ({"model": "default"}, "tokens", None),
    ({"model": "default", "tokens": []}, "tokens", None),
    ({"model": "default", "tokens": [1, -1]}, "tokens", None),
    ({"model": "default", "tokens": [TOK.vocab_size]}, "tokens", None),
    ({"model": "default", "tokens": [10**12]}, "tokens", None),
    ({"model": "default", "tokens": [1, 1.5]}, "tokens.1", None),
    ({"model": "default", "tokens": [True]}, "tokens.0", None),
    ({"model": "default", "tokens": ["1"]}, "tokens.0", None),
    ({"model": "default", "tokens": "1 2"}, "tokens", None),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [("/tokenize", *b) for b in TOKENIZE_BAD] + [("/detokenize", *b) for b in DETOKENIZE_BAD],
)
async def test_bad_requests_are_openai_400s(
    client: httpx.AsyncClient,
    cluster: FakeCluster,
    path: str,
    body: dict[str, Any],
    param: str | None,
    code: str | None,
) -> None:
    resp = await client.post(path, json=body)
    assert resp.status_code == (404 if code == "model_not_found" else 400), resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert (err["param"], err["code"]) == (param, code)
    assert not cluster.generate_calls


async def test_unknown_model_is_refused_as_by_completions(client: httpx.AsyncClient) -> None:
    tok = await client.post("/tokenize", json={"model": "gpt-4", "prompt": "hi"})
    gen = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    assert tok.status_code == gen.status_code == 404 and tok.json() == gen.json()


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
@pytest.mark.parametrize(
    "body", [b"{not json", b"\xff\xfe", DEEP, b'{"messages": ' + DEEP + b"}", b'{"tokens": ' + DEEP + b"}"]
)
async def test_not_json(client: httpx.AsyncClient, path: str, body: bytes) -> None:
    resp = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json", resp.text


async def test_body_size_limit(cluster: FakeCluster) -> None:
    async with make_router(cluster, max_body_bytes=1024) as c:
        assert (await c.post("/tokenize", json={"prompt": "x" * 900})).status_code == 200
        big = await c.post("/tokenize", json={"prompt": "x" * 2000})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        big = await c.post("/detokenize", json={"tokens": [1] * 1000})
        assert big.status_code == 413


async def test_keys_are_required_when_configured(cluster: FakeCluster, tmp_path: Path) -> None:
    good, metrics_only = "tok-test-" + "a" * 32, "tok-test-" + "b" * 32
    keys = tmp_path / "keys"
    keys.write_text(f"{good} name=user scopes=inference\n{metrics_only} name=prom scopes=metrics\n")
    async with make_router(cluster, api_keys_file=str(keys)) as c:
        for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [6004]})]:
            for auth in [None, "Bearer " + "c" * 41, "Basic abc"]:
                resp = await c.post(path, json=body, headers={"Authorization": auth} if auth else {})
                assert resp.status_code == 401, (path, auth, resp.text)
                assert resp.json()["error"]["code"] == "invalid_api_key"
                assert resp.headers["www-authenticate"].startswith("Bearer")
            resp = await c.post(path, json=body, headers={"Authorization": f"Bearer {metrics_only}"})
            assert resp.status_code == 403 and resp.json()["error"]["code"] == "permission_denied"
            resp = await c.post(path, json=body, headers={"Authorization": f"Bearer {good}"})
            assert resp.status_code == 200, resp.text


async def test_openapi_documents_both_bodies(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    served = sorted({"default", model_info().model_id})
    tok = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    shapes = {frozenset(s["required"]): s for s in tok["anyOf"]}
    assert set(shapes) == {frozenset({"prompt"}), frozenset({"messages"})}
    assert all(s["properties"]["model"]["enum"] == served for s in shapes.values())
    assert "$ref" not in str(tok)
    detok = doc["paths"]["/detokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert detok["required"] == ["tokens"] and detok["properties"]["tokens"]["items"]["type"] == "integer"
