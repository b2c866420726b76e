"""router/tools.py: request models, checks, the guide of forced calls (driven through the real grammar
compiler), prompts through the real SmolLM2 chat template and a tools-aware one, and parsing into
`tool_calls` that the official openai types accept."""

from __future__ import annotations

import json
import re

import jinja2
import jsonschema
import openai.types.chat
import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from common.text.grammar import GrammarCompiler, validate_guide
from common.text.model_info import load_model_info
from common.text.tokenizer import Tokenizer
from router.errors import APIError
from router.tools import (
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolChoice,
    check_tools,
    parse_tool_calls,
    render_messages,
    template_takes_tools,
    tool_guide,
    tool_mode,
)
from tests.support.grammar import allocate_bitmask

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: arguments must be {}
TREE = {  # local $refs, which must survive being embedded in the call schema
    "type": "function",
    "function": {
        "name": "plant",
        "parameters": {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                    "required": ["v"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"root": {"$ref": "#/$defs/node"}},
            "required": ["root"],
            "additionalProperties": False,
        },
    },
}
CHOICE = TypeAdapter(ToolChoice)
PARIS = '{"city": "Paris", "unit": "C"}'
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def fn(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def tools(*defs: dict) -> list[Tool]:
    return [Tool.model_validate(d) for d in defs]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_model_info().tokenizer


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, tok.vocab_size)


# --- models and checks ----------------------------------------------------------------------------


def test_models_parse_strictly():
    t = Tool.model_validate({**WEATHER, "extra": 1})
    assert t.function.name == "get_weather" and t.function.strict is None
    assert Tool.model_validate(NOW).function.parameters == {}
    for bad in [
        {"type": "retrieval", "function": {"name": "x"}},
        {"type": "function", "function": {"name": "has space"}},
        {"type": "function", "function": {"name": "x" * 65}},
        {"type": "function", "function": {"name": "x", "parameters": "{}"}},
        {"type": "function", "function": {"name": "x", "strict": "yes"}},
    ]:
        with pytest.raises(ValidationError):
            Tool.model_validate(bad)
    assert CHOICE.validate_python("required") == "required"
    named = CHOICE.validate_python({"type": "function", "function": {"name": "add"}})
    assert isinstance(named, NamedToolChoice) and named.function.name == "add"
    for bad in ["sometimes", {"type": "function"}, {"type": "function", "function": {}}]:
        with pytest.raises(ValidationError):
            CHOICE.validate_python(bad)
    call = ToolCall.model_validate(
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    )
    assert call.function.arguments == "{}"


def test_tool_mode():
    ts = tools(ADD)
    assert tool_mode(None, None) is None and tool_mode([], "auto") is None
    assert tool_mode(ts, "none") is None
    assert tool_mode(ts, None) == "auto" and tool_mode(ts, "auto") == "auto"
    assert tool_mode(ts, "required") == "required"
    assert tool_mode(ts, CHOICE.validate_python({"type": "function", "function": {"name": "add"}})) == "named"


@pytest.mark.parametrize(
    ("defs", "choice", "param", "words"),
    [
        ((), "required", "tool_choice", "only allowed when tools are specified"),
        ((), {"type": "function", "function": {"name": "add"}}, "tool_choice", "only allowed when tools"),
        ((ADD, ADD), None, "tools.1.function.name", "duplicate function name 'add'"),
        ((ADD,), {"type": "function", "function": {"name": "sub"}}, "tool_choice", "'sub', which is not in"),
        (
            (fn("f", {"type": "object", "properties": 3}),),
            None,
            "tools.0.function.parameters",
            "not a valid JSON schema",
        ),
        (
            (fn("f", {"type": "objekt"}),),
            "auto",
            "tools.0.function.parameters",
            "not a valid JSON schema",
        ),
        (
            (fn("f", {"type": "string"}),),
            None,
            "tools.0.function.parameters",
            "must describe a JSON object",
        ),
        (
            (fn("f", {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}),),
            "required",
            "tools",
            "cannot be enforced: .*uniqueItems",
        ),
    ],
)
def test_check_tools_rejects(defs, choice, param, words):
    ts = tools(*defs) if defs else None
    with pytest.raises(APIError) as e:
        check_tools(ts, None if choice is None else CHOICE.validate_python(choice))
    assert e.value.status == 400 and e.value.param == param
    assert re.search(words, e.value.message), e.value.message


def test_check_tools_accepts():
    check_tools(None, None)
    check_tools(None, "none")
    check_tools(tools(WEATHER, ADD, NOW, TREE), "required")
    check_tools(
        tools(WEATHER, ADD), CHOICE.validate_python({"type": "function", "function": {"name": "add"}})
    )
    # a keyword llguidance cannot enforce is fine while nothing is enforced
    loose = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "not": {"required": ["x"]}}},
    }
    check_tools(tools(loose), "auto")


# --- the guide, driven through the real grammar compiler --------------------------------------------


def generate(compiler: GrammarCompiler, tok: Tokenizer, guide, seed: int) -> str:
    """Random logits under the guide's mask, closers favoured so that strings end."""
    g = torch.Generator().manual_seed(seed)
    closers = torch.zeros(compiler.vocab_size)
    for s in ['"', "}", "]", ",", '"}', "}]", "]}", "}}"]:
        closers[tok.encode(s, add_special_tokens=False)[0]] = 4.0
    closers[list(tok.eos_token_ids)] = 4.0
    m, bm, ids = compiler.matcher(guide), allocate_bitmask(1, compiler.vocab_size), []
    for _ in range(400):
        m.fill_bitmask(bm, 0)
        logits = torch.randn(compiler.vocab_size, generator=g) + closers
        bits = (bm[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        logits[~bits.bool().flatten()[: compiler.vocab_size]] = float("-inf")
        t = int(logits.argmax())
        assert m.accept(t)
        ids.append(t)
        if m.is_finished or t in tok.eos_token_ids:
            return tok.decode(ids)
    pytest.fail(f"no end: {tok.decode(ids)!r}")


def test_no_guide_when_output_is_free():
    ts = tools(ADD)
    assert tool_guide(ts, None) is None and tool_guide(ts, "auto") is None and tool_guide(ts, "none") is None
    assert tool_guide(None, "required") is None


def test_required_guide_shape():
    guide = tool_guide(tools(WEATHER, ADD), "required")
    assert guide is not None and guide.kind == "json_schema"
    schema = json.loads(guide.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["get_weather", "add"]
    assert schema["items"]["anyOf"][0]["required"] == ["name", "arguments"]
    assert json.loads(tool_guide(tools(ADD), "required", parallel_tool_calls=False).spec)["maxItems"] == 1
    validate_guide(guide)


@pytest.mark.parametrize("seed", range(6))
def test_required_calls_validate(compiler, tok, seed):
    ts = tools(WEATHER, ADD, NOW, TREE)
    text = generate(compiler, tok, tool_guide(ts, "required"), seed)
    content, calls = parse_tool_calls(text, "required")
    assert content is None and calls, text
    params = {t.function.name: t.function.parameters for t in ts}
    for c in calls:
        args = json.loads(c["function"]["arguments"])
        if c["function"]["name"] == "now":
            assert args == {}
        else:
            jsonschema.Draft202012Validator(params[c["function"]["name"]]).validate(args)


@pytest.mark.parametrize("name", ["get_weather", "add", "now", "plant"])
def test_named_call_validates(compiler, tok, name):
    ts = tools(WEATHER, ADD, NOW, TREE)
    choice = CHOICE.validate_python({"type": "function", "function": {"name": name}})
    guide = tool_guide(ts, choice)
    assert json.loads(guide.spec)["type"] == "object"
    for seed in range(2):
        text = generate(compiler, tok, guide, seed)
        content, calls = parse_tool_calls(text, "named", names=[name])
        assert content is None and len(calls) == 1 and calls[0]["function"]["name"] == name
        params = next(t.function.parameters for t in ts if t.function.name == name)
        jsonschema.Draft202012Validator(params or {"maxProperties": 0}).validate(
            json.loads(calls[0]["function"]["arguments"])
        )


def test_refs_rebased_under_defs():
    schema = json.loads(tool_guide(tools(ADD, TREE), "required").spec)
    plant = schema["items"]["anyOf"][1]["properties"]["arguments"]
    assert plant == {"$ref": "#/$defs/tool1"}
    moved = schema["$defs"]["tool1"]
    assert moved["properties"]["root"]["$ref"] == "#/$defs/tool1/$defs/node"
    assert moved["$defs"]["node"]["properties"]["kids"]["items"]["$ref"] == "#/$defs/tool1/$defs/node"


# --- prompts --------------------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome? Also 2+3."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
            {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "18C, sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "5"},
]


def test_render_through_smollm2_template(tok):
    assert not template_takes_tools(tok.chat_template)
    msgs, kwargs = render_messages(HISTORY, tools(WEATHER, ADD), tok.chat_template)
    assert kwargs == {}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou can call the following functions:\n")
    assert '{"name": "get_weather", "description": "Current weather in a city", "parameters": {' in prompt
    assert "<tool_call>{" in prompt and "If no function is needed, answer normally." in prompt
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "C"}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>\n'
    ) in prompt
    assert (
        '<|im_start|>user\n<tool_response name="get_weather">\n18C, sunny\n</tool_response>\n'
        '<tool_response name="add">\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    ) in prompt
    assert "SmolLM" not in prompt  # our system turn replaces the template's default one
    # the prompt tokenizes with the chat's special tokens intact
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids.count(tok.encode("<|im_start|>", add_special_tokens=False)[0]) == 5


def test_render_merges_system_and_modes(tok):
    history = [{"role": "system", "content": "Be brief."}, *HISTORY[:1]]
    msgs, _ = render_messages(history, tools(ADD), tok.chat_template, "required")
    assert len(msgs) == 2 and msgs[0]["content"].startswith(
        "Be brief.\n\nYou can call the following functions:"
    )
    assert msgs[0]["content"].endswith("Now call one or more of the functions.")
    named = CHOICE.validate_python({"type": "function", "function": {"name": "add"}})
    msgs, _ = render_messages(history, tools(ADD), tok.chat_template, named)
    assert msgs[0]["content"].endswith("Now call the function add.")
    # "none": no functions offered, but the history still renders
    msgs, _ = render_messages(HISTORY, tools(ADD), tok.chat_template, "none")
    assert msgs[0]["role"] == "user" and "<tool_call>" in msgs[1]["content"]
    assert "You can call" not in tok.apply_chat_template(msgs)
    # no tools at all: plain messages pass through
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render_messages(plain, None, tok.chat_template).messages == plain
    # content kept beside calls
    said = [{**HISTORY[1], "content": "Let me check."}]
    assert render_messages(said, None, None).messages[0]["content"].startswith("Let me check.\n<tool_call>")


# A template that renders tools itself, written for this test in the style of tool-aware HF templates.
NATIVE = """{%- if tools %}<tools>{% for t in tools %}
{{- t.function.name }}:{{ t.function.parameters | tojson }};{% endfor %}</tools>
{% endif %}
{%- for m in messages %}[{{ m.role }}]
{%- if m.tool_calls %}{% for c in m.tool_calls %}
 call {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}
{%- elif m.role == 'tool' %} {{ m.name }}({{ m.tool_call_id }}) -> {{ m.content }}
{%- else %} {{ m.content }}{% endif %}
{% endfor %}"""


def test_render_native_template():
    assert template_takes_tools(NATIVE)
    msgs, kwargs = render_messages(HISTORY, tools(WEATHER, ADD), NATIVE)
    assert [t["function"]["name"] for t in kwargs["tools"]] == ["get_weather", "add"]
    assert kwargs["tools"][0] == WEATHER
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v: json.dumps(v)
    out = env.from_string(NATIVE).render(messages=msgs, **kwargs)
    assert out.startswith('<tools>get_weather:{"type": "object"')
    assert 'call get_weather {"city": "Paris", "unit": "C"} call add {"a": 2, "b": 3}' in out  # objects
    assert "[tool] get_weather(call_a) -> 18C, sunny" in out and "[tool] add(call_b) -> 5" in out
    assert msgs[1]["content"] == ""  # None would break templates that concatenate
    assert render_messages(HISTORY, tools(ADD), NATIVE, "none").template_kwargs == {}


# --- parsing --------------------------------------------------------------------------------------


def test_parse_auto():
    text = (
        'Checking both.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
        "</tool_call>\n"
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, "auto")
    assert content == "Checking both."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert all(CALL_ID.fullmatch(c["id"]) and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_parse_auto_edge_cases():
    plain = "  No tools needed here.  "
    assert parse_tool_calls(plain, "auto") == (plain, [])  # untouched, whitespace included
    broken = 'a <tool_call>{"name": "add", "arguments": {"a": 1</tool_call> b'
    assert parse_tool_calls(broken, "auto") == (broken, [])
    mixed = '<tool_call>not json</tool_call> then <tool_call>{"name": "now"}</tool_call>'
    content, calls = parse_tool_calls(mixed, "auto")
    assert content == "<tool_call>not json</tool_call> then" and calls[0]["function"]["arguments"] == "{}"
    unclosed = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
    content, calls = parse_tool_calls(unclosed, "auto")
    assert content == "Sure." and calls[0]["function"]["arguments"] == '{"a":1,"b":2}'
    only = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    content, calls = parse_tool_calls(only, "auto")
    assert content is None and calls[0]["function"]["arguments"] == '{"a": 1}'  # a string: as written
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_tool_calls(unknown, "auto", names={"add"}) == (unknown, [])
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>', "auto")[1] == []


def test_parse_constrained():
    content, calls = parse_tool_calls(
        '[{"name":"add","arguments":{"a":1,"b":2}},{"name":"now","arguments":{}}]', "required"
    )
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"a":1,"b":2}', "{}"]
    content, calls = parse_tool_calls(
        '{"name":"get_weather","arguments":{"city":"Oslo","unit":"C"}}', "named"
    )
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    cut = '[{"name":"add","arguments":{"a":1'  # max_tokens reached mid-call
    assert parse_tool_calls(cut, "required") == (cut, [])
    assert parse_tool_calls("[]", "required") == ("[]", [])
    with pytest.raises(ValueError, match="unknown tool mode"):
        parse_tool_calls("x", "sometimes")


def test_openai_client_types_accept_the_response():
    content, calls = parse_tool_calls(
        'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}'
        "</tool_call>",
        "auto",
    )
    response = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": calls},
                "logprobs": None,
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    parsed = openai.types.chat.ChatCompletion.model_validate(response)
    msg = parsed.choices[0].message
    assert msg.content == "Let me look." and msg.tool_calls and msg.tool_calls[0].type == "function"
    fn = msg.tool_calls[0].function  # type: ignore[union-attr]
    assert fn.name == "get_weather" and json.loads(fn.arguments) == {"city": "Zürich", "unit": "C"}
    # and the calls come back in as history
    _, none = parse_tool_calls('[{"name":"now","arguments":{}}]', "required")
    again = [ToolCall.model_validate(c) for c in calls + none]
    assert (
        render_messages([{"role": "assistant", "content": None, "tool_calls": again}], None, None)
        .messages[0]["content"]
        .count("<tool_call>")
        == 2
    )


def test_refs_under_property_named_like_a_keyword():
    """A parameter called "default" is a schema whose $ref must move; a const's data must not."""
    params = {
        "$defs": {"n": {"type": "integer"}},
        "type": "object",
        "properties": {"default": {"$ref": "#/$defs/n"}, "k": {"const": {"$ref": "#/keep"}}},
    }
    schema = json.loads(tool_guide(tools(fn("f", params)), "required").spec)
    moved = schema["$defs"]["tool0"]
    assert moved["properties"]["default"]["$ref"] == "#/$defs/tool0/$defs/n"
    assert moved["properties"]["k"]["const"] == {"$ref": "#/keep"}
