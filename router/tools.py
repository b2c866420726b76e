"""OpenAI tool calling: the request models, the checks, how tools reach the prompt, the guide that
constrains a forced call, and the parsing of the generated text back into `tool_calls`.

Three modes, from `tool_choice` (`tool_mode`):
- "auto" (the default when tools are given): free text; the model calls a function the way its family
  does (router/tool_formats.py: `hermes` `<tool_call>` blocks, `llama3_json`, `mistral` `[TOOL_CALLS]`),
  found afterwards by `parse_tool_calls`. Nothing is constrained: a text answer must stay possible.
- "required": the output is constrained to a JSON array of one or more calls
  `[{"name": <a declared name>, "arguments": <that function's parameters>}, ...]`.
- "named" (`{"type": "function", "function": {"name": ...}}`): constrained to one call object
  `{"name": <that name>, "arguments": ...}`.
The constrained forms are bare JSON, not tagged: the guide already says where the call is, and JSON
schema is the one guide kind that makes the arguments valid against the function's parameters.
The name is generated first, so the arguments are generated knowing which function they are for.

Prompts: a chat template that knows about tools (it mentions `tools`) gets them natively, as the
`tools` template variable, with the history's tool calls and results in the OpenAI shapes it expects.
Any other template (SmolLM2's) gets a system message describing the functions and the model's call
format (hermes unless --tool-call-parser says otherwise); past calls become that text in the assistant
turn, and tool results become a user turn of `<tool_response>` blocks, which every template accepts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from typing import Any, Literal, NamedTuple

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.sampling_params import Guide
from common.text.grammar import GuideError, validate_guide
from router.errors import invalid
from router.tool_formats import FORMATS, ToolFormat, as_call

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)  # a JSON schema; {} means no parameters
    strict: bool | None = None  # accepted; forced calls always follow the schema, auto calls never do

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError("function names must be 1 to 64 of a-z, A-Z, 0-9, underscores and dashes")
        return v


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ToolMode = Literal["auto", "required", "named"]


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call in an assistant message of the history (and the shape of the calls we return)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def tool_mode(tools: Sequence[Tool] | None, tool_choice: ToolChoice | None) -> ToolMode | None:
    """How the output is generated and parsed; None: no tool calls (no tools, or tool_choice "none")."""
    if not tools or tool_choice == "none":
        return None
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice == "required":
        return "required"
    return "named"


# --- checks ---------------------------------------------------------------------------------------


def _object_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema: arguments are always a JSON object; no parameters means exactly {}."""
    if not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if "type" not in parameters:
        return {**parameters, "type": "object"}
    return parameters


def check_tools(
    tools: Sequence[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool = True
) -> None:
    """Reject what OpenAI would (400, naming the parameter): tool_choice without tools, a named
    choice that is not declared, duplicate names, parameters that are not a JSON schema of an object,
    and a schema the constrained modes cannot compile."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise invalid("tool_choice is only allowed when tools are specified", "tool_choice")
        return
    seen: set[str] = set()
    for i, t in enumerate(tools):
        f, param = t.function, f"tools.{i}.function"
        if f.name in seen:
            raise invalid(f"{param}.name: duplicate function name {f.name!r}", f"{param}.name")
        seen.add(f.name)
        try:
            Draft202012Validator.check_schema(f.parameters)
        except SchemaError as e:
            where = "/".join(str(p) for p in e.path)
            raise invalid(
                f"{param}.parameters is not a valid JSON schema: {e.message}"
                + (f" (at {where})" if where else ""),
                f"{param}.parameters",
            ) from None
        kind = f.parameters.get("type", "object")
        if kind != "object":
            raise invalid(
                f"{param}.parameters must describe a JSON object (type 'object'), not {kind!r}",
                f"{param}.parameters",
            )
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in seen:
        raise invalid(
            f"tool_choice names function {tool_choice.function.name!r}, which is not in tools", "tool_choice"
        )
    guide = tool_guide(tools, tool_choice, parallel_tool_calls)
    if guide is not None:
        try:
            validate_guide(guide)
        except GuideError as e:
            raise invalid(f"tools: a function's parameters cannot be enforced: {e}", "tools") from None


# --- the guide ------------------------------------------------------------------------------------

_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: left as they are
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebase(schema: Any, base: str) -> Any:
    """A copy of `schema` with its local `$ref`s ("#/$defs/X", "#") re-pointed under `base`, where the
    schema is moved to. Walks schemas only: a property named "enum" is still a schema, a const is not."""
    if isinstance(schema, list):
        return [_rebase(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        elif k in _DATA_KEYS:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _rebase(s, base) for name, s in v.items()}
        else:
            out[k] = _rebase(v, base)
    return out


def _call_schema(i: int, f: FunctionDef, defs: dict[str, Any]) -> dict[str, Any]:
    args = _object_schema(f.parameters)
    key = f"tool{i}"
    moved = _rebase(args, f"#/$defs/{key}")
    if moved != args:
        # Embedded in a larger schema, "#/..." would resolve against the wrong root: move the
        # parameters under the root's $defs and re-point their references there.
        defs[key] = moved
        args = {"$ref": f"#/$defs/{key}"}
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": args},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_guide(
    tools: Sequence[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool = True
) -> Guide | None:
    """The json_schema guide of a forced call; None when the output is free ("none", "auto").
    "required": `[{"name", "arguments"}, ...]`, at least one call (one at most without
    parallel_tool_calls); named: one `{"name", "arguments"}` object."""
    mode = tool_mode(tools, tool_choice)
    if mode is None or mode == "auto":
        return None
    assert tools
    defs: dict[str, Any] = {}
    schema: dict[str, Any]
    if isinstance(tool_choice, NamedToolChoice):
        want = tool_choice.function.name
        found = [i for i, t in enumerate(tools) if t.function.name == want]
        if not found:  # check_tools reports this first, naming the parameter
            raise invalid(f"tool_choice names function {want!r}, which is not in tools", "tool_choice")
        schema = _call_schema(found[0], tools[found[0]].function, defs)
    else:
        calls = [_call_schema(i, t.function, defs) for i, t in enumerate(tools)]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return Guide("json_schema", json.dumps(schema, ensure_ascii=False))


# --- prompts --------------------------------------------------------------------------------------


class ChatInput(NamedTuple):
    """What goes through the chat template: the messages, and extra template variables (`tools`)."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]


_TOOLS_VAR = re.compile(r"\btools\b")


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads a `tools` variable)."""
    return bool(template and _TOOLS_VAR.search(template))


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _as_dict(v: Any) -> dict[str, Any]:
    return v.model_dump() if isinstance(v, BaseModel) else dict(v)


def _json_or_text(arguments: str) -> Any:
    """Arguments as a JSON value when they parse (templates and the prompt text want the object)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _calls_text(calls: list[dict[str, Any]], fmt: ToolFormat) -> str:
    pairs = [(c["function"]["name"], _json_or_text(c["function"].get("arguments") or "{}")) for c in calls]
    return fmt.calls_text(pairs)


def tools_prompt(
    tools: Sequence[Tool], tool_choice: ToolChoice | None = None, tool_format: str = "hermes"
) -> str:
    """The system text that describes the functions, and how `tool_format` writes a call, to a template
    that does not take tools."""
    lines = ["You can call the following functions:"]
    for t in tools:
        f = t.function
        spec: dict[str, Any] = {"name": f.name}
        if f.description:
            spec["description"] = f.description
        spec["parameters"] = _object_schema(f.parameters)
        lines.append(json.dumps(spec, ensure_ascii=False))
    lines += ["", *FORMATS[tool_format].instructions()]
    if isinstance(tool_choice, NamedToolChoice):
        lines.append(f"Now call the function {tool_choice.function.name}.")
    elif tool_choice == "required":
        lines.append("Now call one or more of the functions.")
    else:
        lines.append("If no function is needed, answer normally.")
    return "\n".join(lines)


def render_messages(
    messages: list[dict[str, Any]],
    tools: Sequence[Tool] | None,
    tokenizer_template: str | None,
    tool_choice: ToolChoice | None = None,
    tool_format: str = "hermes",
) -> ChatInput:
    """A history with tools, assistant `tool_calls` and `tool` results, made renderable by the model's
    chat template (see the module docstring); `tool_format`: how the model writes calls, where the
    template does not say it itself. With tool_choice "none" the tools are left out of the prompt (no
    call can be made); the history's calls and results are still rendered."""
    offered = list(tools or ()) if tool_choice != "none" else []
    if template_takes_tools(tokenizer_template):
        return _native(messages, offered)
    return _as_text(messages, offered, tool_choice, FORMATS[tool_format])


def _native(messages: list[dict[str, Any]], tools: list[Tool]) -> ChatInput:
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in map(_as_dict, m["tool_calls"]):
                f = c["function"]
                names[c.get("id", "")] = f["name"]
                # HF templates write the arguments with `tojson`: they expect the object, not its text
                args = _json_or_text(f.get("arguments") or "{}")
                calls.append(
                    {
                        "id": c.get("id"),
                        "type": "function",
                        "function": {"name": f["name"], "arguments": args},
                    }
                )
            m["tool_calls"] = calls
            m["content"] = _text(m.get("content"))
        elif m.get("role") == "tool":
            m["content"] = _text(m.get("content"))
            name = names.get(m.get("tool_call_id") or "")
            if name and "name" not in m:
                m["name"] = name
        out.append(m)
    kwargs = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
    return ChatInput(out, kwargs)


def _as_text(
    messages: list[dict[str, Any]], tools: list[Tool], tool_choice: ToolChoice | None, fmt: ToolFormat
) -> ChatInput:
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # consecutive tool results: one user turn, as templates alternate roles

    def flush() -> None:
        if pending:
            out.append({"role": "user", "content": "\n".join(pending)})
            pending.clear()

    for m in messages:
        role = m.get("role")
        if role == "tool":
            name = names.get(m.get("tool_call_id") or "") or m.get("name")
            head = f'<tool_response name="{name}">' if name else "<tool_response>"
            pending.append(f"{head}\n{_text(m.get('content'))}\n</tool_response>")
            continue
        flush()
        if role == "assistant" and m.get("tool_calls"):
            calls = [_as_dict(c) for c in m["tool_calls"]]
            for c in calls:
                names[c.get("id", "")] = c["function"]["name"]
            parts = [_text(m.get("content")).strip(), _calls_text(calls, fmt)]
            out.append({"role": "assistant", "content": "\n".join(p for p in parts if p)})
        else:
            out.append({"role": role, "content": _text(m.get("content"))})
    flush()
    if tools:
        prompt = tools_prompt(tools, tool_choice, fmt.name)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return ChatInput(out, {})


# --- parsing --------------------------------------------------------------------------------------


def parse_tool_calls(
    text: str, mode: str, names: Collection[str] | None = None, tool_format: str = "hermes"
) -> tuple[str | None, list[dict[str, Any]]]:
    """The message content and the OpenAI `tool_calls` in generated text. mode "required": a JSON array
    of calls; "named": one call object; "auto": calls as `tool_format` writes them (the content is the
    text around them; router/tool_formats.py). `names`: if given, a call to any other function is not a
    call. Text that is not the expected JSON (a length cut) comes back as content, with no calls."""
    if mode in ("required", "named"):
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        items = value if mode == "required" and isinstance(value, list) else [value]
        found = [c for c in (as_call(v, names) for v in items) if c is not None]
        if not found or len(found) != len(items):
            return text, []
        return None, found
    if mode != "auto":
        raise ValueError(f"unknown tool mode {mode!r}")
    return FORMATS[tool_format].parse(text, names)
