"""How a model family writes its tool calls, and finding them again in what it generated ("auto" tool
mode; router/tools.py keeps the request models, the prompts and the constrained modes).

Three formats, named as vLLM's `--tool-call-parser` names them:
- `hermes` (Hermes, Qwen 2/2.5/3, SmolLM and any model without a format of its own):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text around them.
- `llama3_json` (Llama 3.1/3.2/3.3): the turn is a JSON object `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`; several calls are separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (tokenizers before v11), or
  `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later; `[CALL_ID]id` may sit before `[ARGS]`).

Each model's format is detected from the chat template the router renders with (`detect`), unless
`--tool-call-parser` names one. The markers `<|python_tag|>`, `[TOOL_CALLS]`, `[ARGS]` are special tokens
in their own vocabularies, and the router's detokenizer drops special tokens: so each parser also finds
the calls with the markers gone (a bare JSON object or array of calls; a declared name then `{`).
What is not a call (bad JSON, a name that was not offered, a cut-off block) stays in the content as it
was written; the content is the text around the calls, stripped, None when nothing is left.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

Call = dict[str, Any]  # one OpenAI tool_call: {"id", "type": "function", "function": {"name", "arguments"}}
Names = Collection[str] | None  # the functions offered; None: any name is a call
Parsed = tuple[str | None, list[Call]]  # (content, calls)


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def as_call(obj: Any, names: Names) -> Call | None:
    """The OpenAI tool_call for one generated {"name", "arguments" (or "parameters")} object; None if it
    is not one (not an object, no name, a name not offered)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    # a model may write the arguments as a JSON string itself; it is passed on as written
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def _decode(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at text[pos] and where it ends; None if none does."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def _content(*parts: str) -> str | None:
    text = "".join(parts).strip()
    return text or None


# --- hermes ---------------------------------------------------------------------------------------

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, names: Names) -> Parsed:
    """`<tool_call>` blocks; a block that is not a call stays in the content, as does an unclosed one
    that does not parse (an unclosed one that does is a call: the model stopped at the end token)."""
    calls: list[Call] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, start)
        body_end, after = (len(text), len(text)) if end < 0 else (end, end + len(_CLOSE))
        try:
            call = as_call(json.loads(text[start + len(_OPEN) : body_end]), names)
        except ValueError:
            call = None
        if call is None:  # not a call: the block stays in the content as it was written
            kept.append(text[pos:after])
        else:
            kept.append(text[pos:start])
            calls.append(call)
        pos = after
    if not calls:
        return text, []
    return _content(*kept, text[pos:]), calls


def hermes_text(calls: list[tuple[str, Any]]) -> str:
    return "\n".join(
        f"<tool_call>{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}</tool_call>"
        for n, a in calls
    )


# --- llama3_json ----------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


def _llama_run(text: str, pos: int, names: Names) -> tuple[list[Call], int]:
    """Call objects from `pos`, separated by `;` (and whitespace); the calls and where they end."""
    calls: list[Call] = []
    end = pos
    while True:
        at = _SPACE.match(text, end).end()  # type: ignore[union-attr]
        if calls:
            if not text.startswith(";", at):
                return calls, end
            at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
        got = _decode(text, at)
        call = as_call(got[0], names) if got is not None else None
        if got is None or call is None:
            return calls, end
        calls.append(call)
        end = got[1]


def _objects(text: str, start: int) -> Iterator[int]:
    """The positions of the top-level `{` in text[start:] that begin a JSON value (a value's own nested
    objects are skipped), and of each `{` that does not."""
    pos = start
    while (p := text.find("{", pos)) >= 0:
        yield p
        got = _decode(text, p)
        pos = got[1] if got is not None else p + 1


def parse_llama3_json(text: str, names: Names) -> Parsed:
    """`{"name", "parameters"}` objects separated by `;`, after `<|python_tag|>` when it is there,
    else the first run of call objects in the text."""
    tag = text.find(PYTHON_TAG)
    if tag >= 0:
        calls, end = _llama_run(text, tag + len(PYTHON_TAG), names)
        if calls:
            return _content(text[:tag], text[end:]), calls
    for p in _objects(text, 0):
        calls, end = _llama_run(text, p, names)
        if calls:
            return _content(text[:p], text[end:]), calls
    return text, []


def llama3_text(calls: list[tuple[str, Any]]) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


# --- mistral --------------------------------------------------------------------------------------

TOOL_CALLS = "[TOOL_CALLS]"
_NAMED = re.compile(r"([a-zA-Z0-9_-]{1,64})(?:\[CALL_ID\][^\[{]*)?(?:\[ARGS\])?\s*(?=\{)")


def _mistral_item(text: str, at: int, names: Names) -> tuple[list[Call], int] | None:
    """One item at text[at]: a JSON array of calls (all of them calls), or `name[ARGS]{...}`."""
    if text.startswith("[", at) and not text.startswith(TOOL_CALLS, at):
        got = _decode(text, at)
        if got is None or not isinstance(got[0], list) or not got[0]:
            return None
        calls = [as_call(v, names) for v in got[0]]
        if any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None], got[1]
    m = _NAMED.match(text, at)
    if m is None:
        return None
    got = _decode(text, m.end())
    if got is None or not isinstance(got[0], dict):
        return None
    call = as_call({"name": m.group(1), "arguments": got[0]}, names)
    return ([call], got[1]) if call is not None else None


def _mistral_run(text: str, pos: int, names: Names) -> tuple[list[Call], int]:
    """Items from `pos`, each after `[TOOL_CALLS]`, whitespace or nothing (v11 calls may follow each
    other directly: `a[ARGS]{..}b[ARGS]{..}`); the calls and where they end."""
    calls: list[Call] = []
    end = pos
    while True:
        at = _SPACE.match(text, end).end()  # type: ignore[union-attr]
        if text.startswith(TOOL_CALLS, at):
            at = _SPACE.match(text, at + len(TOOL_CALLS)).end()  # type: ignore[union-attr]
        item = _mistral_item(text, at, names)
        if item is None:
            return calls, end
        calls += item[0]
        end = item[1]


def _mistral_starts(text: str, names: Names) -> list[int]:
    """Where a run of calls may begin: each `[TOOL_CALLS]`, else (the marker dropped as a special
    token) each `[` and each offered name followed by `{` or `[ARGS]`."""
    marks = [m.start() for m in re.finditer(re.escape(TOOL_CALLS), text)]
    if marks:
        return marks
    starts = [i for i, ch in enumerate(text) if ch == "["]
    if names:
        alt = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
        starts += [
            m.start() for m in re.finditer(rf"(?<![\w-])(?:{alt})(?=\[CALL_ID\]|\[ARGS\]|\s*\{{)", text)
        ]
    return sorted(starts)


def parse_mistral(text: str, names: Names) -> Parsed:
    """`[TOOL_CALLS]` followed by a JSON array of calls or by `name[ARGS]{...}` (repeated)."""
    for p in _mistral_starts(text, names):
        calls, end = _mistral_run(text, p, names)
        if calls:
            return _content(text[:p], text[end:]), calls
    return text, []


def mistral_text(calls: list[tuple[str, Any]]) -> str:
    body = [{"name": n, "arguments": a} for n, a in calls]
    return TOOL_CALLS + json.dumps(body, ensure_ascii=False)


# --- the formats ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    """One family's way of writing tool calls."""

    name: str
    parse: Callable[[str, Names], Parsed]  # generated text -> (content, calls)
    calls_text: Callable[
        [list[tuple[str, Any]]], str
    ]  # past calls (name, arguments) as the model writes them
    how: str  # for the system message of a template without tools: how to write a call
    example: str  # ... and one call, as it is written

    def instructions(self) -> list[str]:
        return [self.how, self.example, "The results come back in <tool_response></tool_response> blocks."]


FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat(
            "hermes",
            parse_hermes,
            hermes_text,
            "To call a function, reply with a <tool_call></tool_call> block holding a JSON object with "
            "the function's name and its arguments, one block per call:",
            '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>',
        ),
        ToolFormat(
            "llama3_json",
            parse_llama3_json,
            llama3_text,
            "To call a function, reply with only a JSON object holding the function's name and its "
            "arguments as parameters; separate several calls with `;`:",
            '{"name": "<function name>", "parameters": {<arguments as JSON>}}',
        ),
        ToolFormat(
            "mistral",
            parse_mistral,
            mistral_text,
            "To call functions, reply with [TOOL_CALLS] followed by a JSON array of the calls, each "
            "with the function's name and its arguments:",
            '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments as JSON>}}]',
        ),
    )
}
AUTO = "auto"  # --tool-call-parser auto: detected from the chat template
PARSER_NAMES = (AUTO, *FORMATS)


def detect(template: str | None) -> str:
    """The tool-call format a chat template teaches its model: `<tool_call>` -> hermes, `[TOOL_CALLS]` ->
    mistral, `<|python_tag|>` or an `ipython` role -> llama3_json; hermes otherwise (and without a
    template), the format the system-message fallback describes."""
    if not template or _OPEN in template:
        return "hermes"
    if TOOL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def resolve(name: str | None, template: str | None) -> str:
    """The format of a model: `name` (from --tool-call-parser), or detected when it is None or auto.
    ValueError for a name that is not a format."""
    if name is None or name == AUTO:
        return detect(template)
    if name not in FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}: choose one of {', '.join(PARSER_NAMES)}")
    return name
