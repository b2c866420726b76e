"""OpenAI request models (validated strictly, unknown fields ignored; router/parse.py reads a body into
one) and their OpenAPI schema. The response shapes are in router/openai_responses.py."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from common.sampling_params import MAX_LOGPROBS, Guide, SamplingParams
from common.text.grammar import GuideError, validate_guide
from router.errors import invalid
from router.tools import Tool, ToolCall, ToolChoice

MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_CHOICES = 16  # n, best_of
INT32_MAX, INT64_MIN, INT64_MAX = 2**31 - 1, -(2**63), 2**63 - 1  # what the services' messages carry


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """Extension (vLLM's name): exactly one constraint besides response_format."""

    model_config = ConfigDict(extra="ignore", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None


class _Common(BaseModel):
    # strict: "5" is not a number. extra fields (user, metadata, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=INT32_MAX, description="extension; 0 or -1 turns it off")
    min_p: float = Field(0.0, ge=0, le=1, description="extension")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64, description="extension")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(0, ge=0, description="extension")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10, description="extension")
    logit_bias: dict[str, float] | None = Field(None, max_length=300)
    logprobs_mode: Literal["processed", "raw"] = Field("processed", description="extension")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="extension")
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not k.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per output token, None when none are asked for."""
        return None

    def guide(self) -> Guide | None:
        """The structured-output constraint response_format / structured_outputs ask for (400 if both,
        or if structured_outputs names several)."""
        rf, so = self.response_format, self.structured_outputs
        guides: list[tuple[str, Guide]] = []
        if rf is not None and rf.type == "json_object":
            guides.append(("response_format", Guide("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise invalid("response_format json_schema needs json_schema.schema", "response_format")
            guides.append(("response_format", Guide("json_schema", json.dumps(rf.json_schema.json_schema))))
        if so is not None:
            if so.json_ is not None:
                spec = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
                guides.append(("structured_outputs.json", Guide("json_schema", spec)))
            if so.regex is not None:
                guides.append(("structured_outputs.regex", Guide("regex", so.regex)))
            if so.choice is not None:
                guides.append(("structured_outputs.choice", Guide("choice", json.dumps(so.choice))))
            if so.grammar is not None:
                guides.append(("structured_outputs.grammar", Guide("grammar", so.grammar)))
        if len(guides) > 1:
            names = ", ".join(n for n, _ in guides)
            raise invalid(f"only one structured-output constraint per request, got {names}", guides[1][0])
        if not guides:
            return None
        param, guide = guides[0]
        try:
            validate_guide(guide)
        except GuideError as e:
            raise invalid(str(e), param) from e
        return guide

    def sampling(self, max_tokens: int, vocab_size: int, guide: Guide | None = None) -> SamplingParams:
        """The services' sampling parameters; stop strings stay at the router (it has the text)."""
        bias = tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())
        stop_ids = tuple(self.stop_token_ids or ())
        for param, ids in (("logit_bias", [t for t, _ in bias]), ("stop_token_ids", stop_ids)):
            if any(not 0 <= t < vocab_size for t in ids):
                raise invalid(f"{param} token ids must be in [0, {vocab_size})", param)
        if self.min_tokens > max_tokens:
            raise invalid(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(self.top_k, 0),
            min_p=float(self.min_p),
            seed=self.seed,
            stop_token_ids=stop_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logit_bias=bias,
            logprobs=self.num_logprobs,
            logprobs_mode=self.logprobs_mode,
            guide=guide,
        )


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    _many: list[Any] | None = PrivateAttr(None)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if any(not p for p in v):
                raise ValueError("prompts must not be empty")
            return v[0] if len(v) == 1 else v
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _several(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            self._many, self.prompt = p, p[0]
        return self

    @property
    def prompts(self) -> list[Any] | None:
        """The prompts of a request that has several (each is answered as a request of its own)."""
        return self._many

    def one(self, prompt: str | list[int]) -> CompletionRequest:
        """This request with one of its prompts."""
        sub = self.model_copy(update={"prompt": prompt})
        sub._many = None
        return sub

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of

    def text(self) -> str:
        """Content parts of type "text" joined; other part types are refused."""
        if not isinstance(self.content, list):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages):
            try:
                msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            except ValueError as e:
                raise invalid(str(e), f"messages.{i}.content") from e
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out

    @property
    def uses_tools(self) -> bool:
        """Tools offered, or calls and results in the history: the template input needs rendering."""
        return bool(self.tools) or any(m.tool_calls or m.role == "tool" for m in self.messages)


def request_body_schema(model: type[BaseModel], served: list[str]) -> dict[str, Any]:
    """The OpenAPI requestBody of an endpoint that reads `model` itself (so that a strict parse gives
    OpenAI-style errors): its JSON schema with the nested models inlined, since a `#/$defs/...`
    reference would resolve against the whole OpenAPI document, and the model names served here."""
    schema = model.model_json_schema()
    schema["properties"]["model"] = {"type": "string", "enum": sorted(served)}
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"required": True, "content": {"application/json": {"schema": inline(schema)}}}
