"""The OpenAI request features across the split, against real services (prefill, decode, router on
127.0.0.1, real Redis, the real model), spoken to with the official `openai` client.

Each feature runs on both paths: prompts of THRESHOLD tokens or more go split (token 0 sampled on the
prefill service, the rest on the decode service), shorter ones local (all on the decode service).
Logprobs are checked against a Hugging Face `transformers` forward pass over the same tokens.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.hf_export import export_hf_folder
from common.sampling_params import SamplingParams
from tests.support.cluster import Cluster

pytestmark = pytest.mark.services
SERVICE_FLAGS = ("--threads", "1", "--kv-cache-mb", "64")
THRESHOLD = 40  # prompts (chat: template included) of this many tokens or more are prefilled remotely
LONG_Q = "Tell me about the old fisherman who lived in the small village by the sea, and what he caught."
SHORT_Q = "Hi!"
PATHS = [pytest.param(LONG_Q, "split", id="split"), pytest.param(SHORT_Q, "local", id="local")]
LONG_P = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every day went out"
    " in his little boat before dawn, and every evening came back with a basket of silver fish for the"
)
SHORT_P = "1, 2, 3,"
PROMPTS = [pytest.param(LONG_P, "split", id="split"), pytest.param(SHORT_P, "local", id="local")]
TOL = 1e-4  # logprobs vs transformers (fp32 both; only the batch shapes differ)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):  # type: ignore[no-untyped-def]
    cluster = Cluster(redis_url, str(tmp_path_factory.mktemp("logs")))
    try:
        cluster.start("prefill", *SERVICE_FLAGS)
        cluster.start("decode", *SERVICE_FLAGS)
        # the path is chosen by prompt length alone: these tests send each prompt down both paths, again
        # and again, and prefix-aware routing would (rightly) prefill a prompt the decode service
        # holds there (tests/integration/test_prefix_routing.py)
        router = cluster.start(
            "router", "--local-prefill-threshold", str(THRESHOLD), "--routing", "least_loaded"
        )
        yield router
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def hf(tiny, tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny
    folder: Path = export_hf_folder(model, tokenizer, tmp_path_factory.mktemp("hf"))
    return AutoModelForCausalLM.from_pretrained(str(folder)).float().eval()


@torch.inference_mode()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """(len(ids), vocab): row i is the distribution of the token after ids[:i + 1]."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def chat_ids(tiny, question: str) -> list[int]:  # type: ignore[no-untyped-def]
    tok = tiny[1]
    return tok.encode(
        tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False
    )


def local_generate(tiny, ids: list[int], params: SamplingParams) -> list[int]:  # type: ignore[no-untyped-def]
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1))
    return engine.generate([ids], params)[0].token_ids


def route_of(raw: Any) -> str:
    return raw.headers["x-splitserve-route"].split(";")[0]


def token_bytes(tiny, ids: list[int]) -> list[bytes]:  # type: ignore[no-untyped-def]
    from router.logprobs import TokenTexts

    texts = TokenTexts(tiny[1])
    return [texts.bytes_of(i) for i in ids]


# ---- logprobs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("question", "route"), PATHS)
def test_chat_logprobs_match_transformers(client, tiny, hf, question, route, stream) -> None:  # type: ignore[no-untyped-def]
    prompt = chat_ids(tiny, question)
    assert (len(prompt) >= THRESHOLD) == (route == "split")
    kwargs: dict[str, Any] = {
        "model": "default", "messages": [{"role": "user", "content": question}],
        "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3,
    }  # fmt: skip
    if stream:
        raw = client.chat.completions.with_raw_response.create(**kwargs, stream=True)
        content = [
            c for chunk in raw.parse() for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content
        ]
    else:
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        content = raw.parse().choices[0].logprobs.content
    assert route_of(raw) == route
    out = local_generate(tiny, prompt, SamplingParams(max_tokens=8))
    assert [bytes(c.bytes) for c in content] == token_bytes(tiny, out)
    ref = hf_logprobs(hf, prompt + out)
    for i, (c, t) in enumerate(zip(content, out, strict=True)):
        row = ref[len(prompt) + i - 1]
        assert abs(c.logprob - row[t].item()) <= TOL, (i, c.logprob, row[t].item())
        assert len(c.top_logprobs) == 3
        top = torch.topk(row, 3).values.tolist()
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(top, abs=TOL)
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=TOL)  # greedy: the top one


@pytest.mark.parametrize(("prompt", "route"), PROMPTS)
def test_echo_scores_the_prompt_on_the_prefilling_service(client, tiny, hf, prompt, route) -> None:  # type: ignore[no-untyped-def]
    ids = tiny[1].encode(prompt)
    raw = client.completions.with_raw_response.create(
        model="default", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    assert route_of(raw) == route
    body = raw.parse()
    choice = body.choices[0]
    assert choice.text == prompt and body.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_logprobs(hf, ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1][ids[i]].item()) <= TOL, i
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(
            torch.topk(ref[i - 1], 2).values.tolist(), abs=TOL
        )
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # echo with a completion: the prompt's scores, then the completion's
    both = client.completions.create(
        model="default", prompt=prompt, max_tokens=4, echo=True, logprobs=0, temperature=0
    ).choices[0]
    assert both.text.startswith(prompt) and len(both.logprobs.tokens) == len(ids) + 4


@pytest.mark.parametrize(("prompt", "route"), PROMPTS)
def test_raw_and_processed_logprobs(client, prompt, route) -> None:  # type: ignore[no-untyped-def]
    def likeliest(mode: str) -> tuple[str, float]:
        r = client.completions.create(
            model="default", prompt=prompt, max_tokens=1, logprobs=1, temperature=0.5, seed=3,
            extra_body={"logprobs_mode": mode},
        )  # fmt: skip
        ((token, logprob),) = r.choices[0].logprobs.top_logprobs[0].items()
        return token, logprob

    # processed: of the distribution sampled from (temperature 0.5 sharpens it): the likeliest token
    # (whichever was sampled) is the same, and its logprob closer to 0 than the raw model's
    (raw_token, raw), (token, processed) = likeliest("raw"), likeliest("processed")
    assert raw_token == token and raw < processed <= 0


# ---- penalties and biases --------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "route"), PROMPTS)
def test_penalties_same_on_both_sides_of_the_split(client, tiny, prompt, route) -> None:  # type: ignore[no-untyped-def]
    """Token 0 (prefill service on the split path) and the rest (decode service) see one penalty state:
    the output equals one engine generating everything with the same parameters."""
    ids = tiny[1].encode(prompt)
    params = SamplingParams(
        max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
        min_tokens=6, logit_bias=((28, 3.0),), seed=11, temperature=0.8, top_p=0.9,
    )  # fmt: skip
    raw = client.completions.with_raw_response.create(
        model="default", prompt=prompt, max_tokens=12, frequency_penalty=0.7, presence_penalty=0.4,
        logit_bias={"28": 3}, seed=11, temperature=0.8, top_p=0.9, logprobs=0,
        extra_body={"repetition_penalty": 1.3, "min_tokens": 6},
    )  # fmt: skip
    assert route_of(raw) == route
    got = raw.parse().choices[0].logprobs.tokens
    want = local_generate(tiny, ids, params)
    assert got == [b.decode("utf-8", errors="replace") for b in token_bytes(tiny, want)]


@pytest.mark.parametrize(("prompt", "route"), PROMPTS)
def test_logit_bias_forces_and_forbids(client, tiny, prompt, route) -> None:  # type: ignore[no-untyped-def]
    forced = tiny[1].encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(
        model="default", prompt=prompt, max_tokens=4, temperature=0, logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].text == tiny[1].decode([forced] * 4)
    ban_id = local_generate(tiny, tiny[1].encode(prompt), SamplingParams(max_tokens=1))[0]  # greedy's pick
    r2 = client.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        logit_bias={str(ban_id): -100},
        logprobs=0,
    )
    assert r2.choices[0].logprobs.tokens[0] != token_bytes(tiny, [ban_id])[0].decode("utf-8", "replace")


# ---- structured outputs --------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("question", "route"), PATHS)
def test_json_schema_output_validates(client, question, route, stream) -> None:  # type: ignore[no-untyped-def]
    kwargs: dict[str, Any] = {
        "model": "default", "messages": [{"role": "user", "content": question + " Answer as JSON."}],
        "max_tokens": 80, "temperature": 0,
        "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}
        },
    }  # fmt: skip
    if stream:
        raw = client.chat.completions.with_raw_response.create(**kwargs, stream=True)
        text = "".join(ch.delta.content or "" for chunk in raw.parse() for ch in chunk.choices)
    else:
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        text = raw.parse().choices[0].message.content
    assert route_of(raw) == route
    jsonschema.validate(json.loads(text), PERSON)


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A bounded schema: every string, array and object short enough to finish within max_tokens."""
    kinds = ["string", "integer", "boolean", "enum", "number"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 10)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "yes", "no", "42"], rng.randint(1, 4))}
    if kind == "array":
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": 1,
            "maxItems": rng.randint(1, 3),
        }
    props = {f"k{i}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 3))}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def test_fifty_generated_schemas_validate(client) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(1234)
    cases = []
    for i in range(50):
        schema = random_schema(rng)
        if schema.get("type") != "object":
            schema = {"type": "object", "properties": {"value": schema}, "required": ["value"],
                      "additionalProperties": False}  # fmt: skip
        question = (LONG_Q if i % 2 else SHORT_Q) + f" Reply with JSON #{i}."
        cases.append((schema, question))

    def run(case: tuple[dict[str, Any], str]) -> tuple[dict[str, Any], str, str]:
        schema, question = case
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": question}], max_tokens=160,
            temperature=0.7, seed=5,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        )  # fmt: skip
        return schema, r.choices[0].message.content or "", r.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, cases))
    for schema, text, finish in results:
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(("prompt", "route"), PROMPTS)
def test_regex_and_choice(client, prompt, route) -> None:  # type: ignore[no-untyped-def]
    import re

    r = client.completions.create(
        model="default", prompt=prompt, max_tokens=20, temperature=0.9, seed=1,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}},
    )  # fmt: skip
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(
        model="default", prompt=prompt, max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe not"]}},
    )  # fmt: skip
    assert r.choices[0].text in ("yes", "no", "maybe not")


# ---- tool calls ----------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("question", "route"), PATHS)
def test_forced_tool_calls(client, question, route, stream) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": question + " What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = {"model": "default", "messages": messages, "tools": [WEATHER, TIME], "tool_choice": choice,
                  "max_tokens": 80, "temperature": 0}  # fmt: skip
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            deltas = [
                tc for c in chunks for ch in c.choices if ch.delta.tool_calls for tc in ch.delta.tool_calls
            ]
            finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason][-1]
            calls = [(d.function.name, d.function.arguments) for d in deltas]
        else:
            msg = client.chat.completions.create(**kwargs).choices[0]
            finish = msg.finish_reason
            calls = [(tc.function.name, tc.function.arguments) for tc in msg.message.tool_calls or []]
        assert finish == "tool_calls" and calls, calls
        for name, arguments in calls:
            assert name in ("get_weather", "get_time")
            schema = (WEATHER if name == "get_weather" else TIME)["function"]["parameters"]
            jsonschema.validate(json.loads(arguments), schema)
        if isinstance(choice, dict):
            assert [n for n, _ in calls] == ["get_weather"]


def test_tool_results_in_history_go_through_the_template(client) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]  # fmt: skip
    r = client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


# ---- small things ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "route"), PROMPTS)
def test_usage_cached_tokens_and_fingerprint(client, prompt, route) -> None:  # type: ignore[no-untyped-def]
    first = client.completions.create(model="default", prompt=prompt * 4, max_tokens=2, temperature=0)
    again = client.completions.create(model="default", prompt=prompt * 4, max_tokens=2, temperature=0)
    assert first.system_fingerprint and first.system_fingerprint == again.system_fingerprint
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # at least one full block the second time
    assert first.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens_details.cached_tokens


def test_models_card_has_max_model_len(stack) -> None:  # type: ignore[no-untyped-def]
    card = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_several_prompts_in_one_request(client, stream) -> None:  # type: ignore[no-untyped-def]
    """Each prompt is a request of its own (here one split, one local), answered in one response."""
    prompts = [LONG_P, SHORT_P, SHORT_P + " 4,"]
    singles = [
        client.completions.create(model="default", prompt=p, max_tokens=6, temperature=0, logprobs=1).choices[
            0
        ]
        for p in prompts
    ]
    if stream:
        chunks = list(
            client.completions.create(
                model="default", prompt=prompts, max_tokens=6, temperature=0, logprobs=1, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        texts = ["", "", ""]
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] += ch.text
        assert texts == [s.text for s in singles]
        assert chunks[-1].usage.completion_tokens == 18
    else:
        raw = client.completions.with_raw_response.create(
            model="default", prompt=prompts, max_tokens=6, temperature=0, logprobs=1
        )
        routes = [r.split(";")[0] for r in raw.headers["x-splitserve-route"].split(",")]
        assert routes == ["split", "local", "local"]
        body = raw.parse()
        assert [c.index for c in body.choices] == [0, 1, 2]
        assert [c.text for c in body.choices] == [s.text for s in singles]
        assert [c.logprobs.tokens for c in body.choices] == [s.logprobs.tokens for s in singles]
        assert body.usage.completion_tokens == 18


@pytest.mark.parametrize(("question", "route"), PATHS)
def test_n_choices_reproduce_single_requests_with_derived_seeds(client, question, route) -> None:  # type: ignore[no-untyped-def]
    """n=4 with seed s: choice j is what one request with seed s + j generates (docs/openai_api.md)."""
    kwargs: dict[str, Any] = {
        "model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": 8,
        "temperature": 1.0, "top_p": 0.95,
    }  # fmt: skip
    raw = client.chat.completions.with_raw_response.create(**kwargs, n=4, seed=100)
    # choice 0 as any request; the others on the decode service that holds the prompt: its full blocks
    # come from that service's prefix cache (shared, not computed or sent again)
    routes = raw.headers["x-splitserve-route"].split(",")
    assert routes[0].split(";")[0] == route and routes[1:] == ["local; reason=shared_prefix"] * 3
    body = raw.parse()
    n_prompt = body.usage.prompt_tokens // 4
    # each later choice reuses the prompt's full blocks but the one holding its last token (computed again)
    assert body.usage.prompt_tokens_details.cached_tokens >= 3 * ((n_prompt - 1) // 16 * 16)
    choices = body.choices
    assert [c.index for c in choices] == [0, 1, 2, 3]
    singles = [
        client.chat.completions.create(**kwargs, seed=100 + j).choices[0].message.content for j in range(4)
    ]
    assert [c.message.content for c in choices] == singles
    assert len(set(singles)) > 1  # the seeds differ, so (almost surely) do the samples


def test_best_of_returns_the_likeliest_candidates(client) -> None:  # type: ignore[no-untyped-def]
    kwargs: dict[str, Any] = {"model": "default", "prompt": SHORT_P, "max_tokens": 6, "temperature": 1.0}
    r = client.completions.create(**kwargs, n=2, best_of=5, seed=7)
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)
    cands = [client.completions.create(**kwargs, seed=7 + j, logprobs=0).choices[0] for j in range(5)]

    def mean_lp(c: Any) -> float:
        return sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)

    chosen = [next(c for c in cands if c.text == got.text) for got in r.choices]  # each is a candidate
    rest = [c for c in cands if c not in chosen]
    # best first, and better than every other (to within what two batch shapes change in a logprob)
    assert mean_lp(chosen[0]) >= mean_lp(chosen[1]) - 1e-3
    assert min(map(mean_lp, chosen)) >= max(map(mean_lp, rest)) - 1e-3
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in cands)  # every candidate counts
