"""Tool-call formats per model (router/tool_formats.py): each family's parser, detection from chat
templates, the --tool-call-parser setting, and the router's own response path (router/response.py) parsing
a model's output in that model's format, streamed and not."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import jinja2
import pytest
from pydantic import ValidationError

from common.text.detokenizer import IncrementalDetokenizer
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.openai_responses import Builder
from router.outcome import Run
from router.output import Output
from router.parse import parse, read
from router.response import full, stream
from router.served_model import ServedModel, ServedModels
from router.tool_formats import FORMATS, detect, parse_hermes, parse_llama3_json, parse_mistral, resolve
from router.tools import Tool, parse_tool_calls, render_messages
from tests.support.router_fakes import model_info

NAMES = {"get_weather", "add"}
PARIS = {"city": "Paris"}


def calls_of(found: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(name, arguments object) of each call, after checking the OpenAI shape."""
    out = []
    for c in found:
        assert c["type"] == "function" and c["id"].startswith("call_")
        out.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
    return out


# --- hermes ---------------------------------------------------------------------------------------


def test_hermes():
    text = 'Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\nDone.'
    content, found = parse_hermes(text, NAMES)
    assert content == "Sure.\n\nDone." and calls_of(found) == [("get_weather", PARIS)]
    two = (
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    )
    content, found = parse_hermes(two, NAMES)
    assert content is None and calls_of(found) == [("add", {"a": 1}), ("add", {"a": 2})]
    undeclared = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert parse_hermes(undeclared, NAMES) == (undeclared, [])
    cut = '<tool_call>{"name": "add", "argum'
    assert parse_hermes(cut, NAMES) == (cut, [])


# --- llama3_json ----------------------------------------------------------------------------------


def test_llama3_json_one_call_with_and_without_the_tag():
    for text in (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '  {"name": "get_weather", "arguments": {"city": "Paris"}}\n',
    ):
        content, found = parse_llama3_json(text, NAMES)
        assert content is None and calls_of(found) == [("get_weather", PARIS)], text


def test_llama3_json_several_calls_separated_by_semicolons():
    text = (
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
        '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    )
    content, found = parse_llama3_json(text, NAMES)
    assert content is None and calls_of(found) == [("add", {"a": 1, "b": 2}), ("get_weather", PARIS)]
    # a trailing separator with nothing after it stays as text
    content, found = parse_llama3_json('{"name": "add", "parameters": {}};', NAMES)
    assert content == ";" and calls_of(found) == [("add", {})]


def test_llama3_json_text_around_calls_is_content():
    text = 'Let me look.\n{"name": "get_weather", "parameters": {"city": "Paris"}}\nOne moment.'
    content, found = parse_llama3_json(text, NAMES)
    assert content == "Let me look.\n\nOne moment." and calls_of(found) == [("get_weather", PARIS)]
    before_tag = 'Checking. <|python_tag|>{"name": "add", "parameters": {"a": 1}}'
    content, found = parse_llama3_json(before_tag, NAMES)
    assert content == "Checking." and calls_of(found) == [("add", {"a": 1})]


def test_llama3_json_what_is_not_a_call_stays_text():
    for text in (
        "The answer is 4.",
        '{"name": "rm", "parameters": {"path": "/"}}',  # not offered
        '{"city": "Paris"}',  # no name
        '{"name": "add", "parameters": {"a": 1',  # cut off
        '<|python_tag|>{"name": "add", "param',
        'Here is JSON: {"x": {"name": "add", "parameters": {}}}',  # a call's shape nested in a value
    ):
        assert parse_llama3_json(text, NAMES) == (text, []), text
    # the first call object after a value that is not one
    text = 'Example {"a": 1} then {"name": "add", "parameters": {"a": 2}}'
    content, found = parse_llama3_json(text, NAMES)
    assert content == 'Example {"a": 1} then' and calls_of(found) == [("add", {"a": 2})]
    # without names, any named object is a call
    assert calls_of(parse_llama3_json('{"name": "rm", "parameters": {}}', None)[1]) == [("rm", {})]


# --- mistral --------------------------------------------------------------------------------------


def test_mistral_json_array():
    text = (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "add", "arguments": {"a": 1}}]'
    )
    content, found = parse_mistral(text, NAMES)
    assert content is None and calls_of(found) == [("get_weather", PARIS), ("add", {"a": 1})]
    text = 'I will check.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}] after'
    content, found = parse_mistral(text, NAMES)
    assert content == "I will check. after" and calls_of(found) == [("add", {"a": 1})]


def test_mistral_v11_name_args():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
    content, found = parse_mistral(text, NAMES)
    assert content is None and calls_of(found) == [("get_weather", PARIS), ("add", {"a": 1, "b": 2})]
    with_id = 'Ok. [TOOL_CALLS]add[CALL_ID]abc123XYZ[ARGS]{"a": 3}'
    content, found = parse_mistral(with_id, NAMES)
    assert content == "Ok." and calls_of(found) == [("add", {"a": 3})]


def test_mistral_markers_dropped_by_the_detokenizer():
    # [TOOL_CALLS] and [ARGS] are special tokens: the router's text may come without them
    content, found = parse_mistral('[{"name": "add", "arguments": {"a": 1}}]', NAMES)
    assert content is None and calls_of(found) == [("add", {"a": 1})]
    content, found = parse_mistral('get_weather{"city": "Paris"}add{"a": 2}', NAMES)
    assert content is None and calls_of(found) == [("get_weather", PARIS), ("add", {"a": 2})]


def test_mistral_what_is_not_a_call_stays_text():
    for text in (
        "Plain [answer] with {braces}.",
        '[TOOL_CALLS][{"name": "rm", "arguments": {}}]',  # not offered
        '[TOOL_CALLS][{"name": "add", "arguments": {}}, {"name": "rm", "arguments": {}}]',  # one is not
        '[TOOL_CALLS][{"name": "add", "argu',  # cut off
        "[TOOL_CALLS]add[ARGS]{",
        "[TOOL_CALLS][]",
        'add is a word; {"a": 1} is not a call to it',  # a name only counts right before its arguments
    ):
        assert parse_mistral(text, NAMES) == (text, []), text


def test_auto_mode_dispatches_on_the_format():
    hermes = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    llama = '{"name": "add", "parameters": {"a": 1}}'
    mistral = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'
    assert calls_of(parse_tool_calls(hermes, "auto", NAMES)[1]) == [("add", {"a": 1})]
    assert parse_tool_calls(llama, "auto", NAMES) == (llama, [])  # hermes (the default) does not see it
    assert calls_of(parse_tool_calls(llama, "auto", NAMES, "llama3_json")[1]) == [("add", {"a": 1})]
    assert calls_of(parse_tool_calls(mistral, "auto", NAMES, "mistral")[1]) == [("add", {"a": 1})]
    assert parse_tool_calls(hermes, "auto", NAMES, "mistral") == (hermes, [])


# --- detection ------------------------------------------------------------------------------------

# Small templates in the style of each family's tool section (the real ones are much longer).
QWEN = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA31 = """{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>
Environment: ipython
{%- for t in tools %}{{ t | tojson }}{% endfor %}<|eot_id|>{% endif %}
{%- for m in messages %}{%- if m.role == 'ipython' or m.role == 'tool' %}
<|start_header_id|>ipython<|end_header_id|>
{{ m.content }}<|eot_id|>{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>
<|python_tag|>{% for c in m.tool_calls %}{"name": "{{ c.function.name }}",
"parameters": {{ c.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>
{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"""
MISTRAL = """{{- bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST]{{ m.content }}[/INST]{%- elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{{ eos_token }}
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"""
PLAIN = """{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}"""


@pytest.mark.parametrize(
    ("template", "fmt"),
    [(QWEN, "hermes"), (LLAMA31, "llama3_json"), (MISTRAL, "mistral"), (PLAIN, "hermes"), (None, "hermes")],
)
def test_detect_from_templates(template: str | None, fmt: str) -> None:
    if template is not None:
        jinja2.Environment().parse(template)  # each is a template a model could have
    assert detect(template) == fmt


def test_detect_the_real_smollm2_template():
    assert detect(model_info().tokenizer.chat_template) == "hermes"  # no tool support: the fallback's


def test_resolve_and_its_errors():
    assert resolve(None, MISTRAL) == "mistral" and resolve("auto", LLAMA31) == "llama3_json"
    assert resolve("hermes", MISTRAL) == "hermes"  # the flag overrides the template
    with pytest.raises(ValueError, match="unknown tool call parser 'pythonic'"):
        resolve("pythonic", None)


# --- the setting ----------------------------------------------------------------------------------


def test_config_takes_known_parsers_only():
    assert RouterConfig(tool_call_parser=["mistral"]).tool_call_parser == ["mistral"]
    with pytest.raises(ValidationError, match="unknown tool call parser 'jsonish'"):
        RouterConfig(tool_call_parser=["jsonish"])
    with pytest.raises(ValidationError, match="3 tool call parsers for 2 models"):
        RouterConfig(model=["a", "b"], tool_call_parser=["hermes", "mistral", "hermes"])


def test_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_ROUTER_TOOL_CALL_PARSER", "llama3_json,auto")
    monkeypatch.setenv("SPLITSERVE_ROUTER_MODEL", "a,b")
    assert RouterConfig().tool_call_parser == ["llama3_json", "auto"]


def test_served_models_take_one_parser_each_or_one_for_all():
    info = model_info()  # SmolLM2: detected hermes
    assert ServedModel.of(RouterConfig(), info).tool_format == "hermes"
    assert ServedModel.of(RouterConfig(tool_call_parser=["mistral"]), info).tool_format == "mistral"
    both = RouterConfig(model=["a", "b"], served_model_name=["x", "y"], tool_call_parser=["llama3_json"])
    assert [m.tool_format for m in ServedModels.of(both, [info, info]).models] == ["llama3_json"] * 2
    each = RouterConfig(model=["a", "b"], served_model_name=["x", "y"], tool_call_parser=["auto", "mistral"])
    assert [m.tool_format for m in ServedModels.of(each, [info, info]).models] == ["hermes", "mistral"]


# --- prompts --------------------------------------------------------------------------------------

ADD = Tool.model_validate(
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"properties": {"a": {"type": "integer"}}}},
    }
)
HISTORY = [
    {"role": "user", "content": "1+1?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "2"},
]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_fallback_prompt_describes_the_models_format(fmt: str) -> None:
    msgs, kwargs = render_messages(HISTORY, [ADD], None, None, fmt)
    assert kwargs == {} and msgs[0]["role"] == "system"
    assert FORMATS[fmt].example in msgs[0]["content"]
    past = msgs[2]["content"]  # the assistant's earlier call, as this format writes it
    content, found = FORMATS[fmt].parse(past, {"add"})
    assert content is None and calls_of(found) == [("add", {"a": 1})], past
    assert msgs[3] == {"role": "user", "content": '<tool_response name="add">\n2\n</tool_response>'}


def test_a_native_template_renders_the_calls_itself():
    msgs, kwargs = render_messages(HISTORY, [ADD], MISTRAL, None, "mistral")
    assert kwargs["tools"][0]["function"]["name"] == "add" and msgs[1]["tool_calls"][0]["function"][
        "arguments"
    ] == {"a": 1}


# --- the router's response path -------------------------------------------------------------------


def served_as(parser: str) -> ServedModel:
    return ServedModel.of(RouterConfig(tool_call_parser=[parser]), model_info())


def job_for(served: ServedModel, output: str) -> tuple[Any, list[int]]:
    """A chat request offering `add` and `get_weather`, parsed by the router's own phase, and the token
    ids of `output` as the services would return them."""
    fn = {"type": "function", "function": {"name": "add", "parameters": {}}}
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "tools": [fn]}
    parsed = parse(read(json.dumps(body).encode(), True), {}, None, served, RouterConfig())
    assert parsed.tool_mode == "auto" and parsed.tool_format == served.tool_format
    tok = served.info.tokenizer
    ids = tok.encode(output, add_special_tokens=False)
    out = Output(parsed.prompt_ids, parsed.sampling)
    out.ids = list(ids)
    frames = [ids[i : i + 3] for i in range(0, len(ids), 3)]

    async def next_frame() -> list[int] | None:
        return frames.pop(0) if frames else None

    trip = SimpleNamespace(output=out, next=next_frame, route=None)  # no placement: path "none"
    job = SimpleNamespace(
        parsed=parsed,
        run=Run("chat"),
        trip=trip,
        builder=Builder("req-1", served.name, True, served.fingerprint),
        detok=IncrementalDetokenizer(tok),
    )
    return job, ids


OUTPUTS = {
    "hermes": 'Adding.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
    "llama3_json": 'Adding. {"name": "add", "parameters": {"a": 1}}',
    "mistral": 'Adding.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]',
}


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_full_response_parses_in_the_models_format(parser: str) -> None:
    served = served_as(parser)
    for fmt, text in OUTPUTS.items():
        job, _ = job_for(served, text)
        job.run.finish_reason, job.run.output_tokens = "stop", len(job.trip.output.ids)
        message = full(job, served.token_texts, text)["choices"][0]
        if fmt == parser:
            assert message["finish_reason"] == "tool_calls" and message["message"]["content"] == "Adding."
            assert calls_of(message["message"]["tool_calls"]) == [("add", {"a": 1})]
        elif parser != "llama3_json":  # (which finds a bare call object wherever it is)
            # another family's syntax is text to this model
            assert message["finish_reason"] == "stop" and message["message"]["content"] == text
            assert not message["message"].get("tool_calls")


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_streamed_response_parses_in_the_models_format(parser: str) -> None:
    served = served_as(parser)
    job, _ = job_for(served, OUTPUTS[parser])

    async def end(error: BaseException | None) -> None:
        assert error is None

    async def events() -> list[str]:
        return [e async for e in stream(job, served.token_texts, RouterMetrics(), False, end)]

    chunks = [json.loads(e.removeprefix("data: ")) for e in asyncio.run(events()) if "[DONE]" not in e]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Adding."
    calls = [c for d in deltas for c in d.get("tool_calls") or ()]
    assert [c["index"] for c in calls] == [0] and calls_of(calls) == [("add", {"a": 1})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
