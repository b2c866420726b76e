"""OpenAI request models (validated strictly, unknown fields ignored) and response/chunk builders."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.sampling_params import SamplingParams
from router.errors import APIError, from_validation, invalid


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    # strict: "5" is not a number. extra fields (user, metadata, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="extension; 0 or -1 turns it off")
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # extension
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported; use 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
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

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The services' sampling parameters; stop strings stay at the router (it has the text)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(self.top_k, 0),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

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
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages):
            try:
                out.append({"role": m.role, "content": m.text()})
            except ValueError as e:
                raise invalid(str(e), f"messages.{i}.content") from e
        return out


def parse(model: type[CompletionRequest] | type[ChatCompletionRequest], body: bytes) -> Any:
    """Validate a raw JSON body; any problem is an APIError(400) naming the offending param."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation(list(e.errors())) from None


# --- responses ------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Builder:
    """Builds one request's response objects; `chat` picks chat.completion vs text_completion shapes."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

    def _choice(self, text: str | None, finish_reason: str | None, stream: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        key = "delta" if stream else "message"
        body: dict[str, Any] = {} if stream and text is None else {"content": text or ""}
        if not stream:
            body = {"role": "assistant", **body}
        return {"index": 0, key: body, "logprobs": None, "finish_reason": finish_reason}

    def _head(self, stream: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            **self._head(False),
            "choices": [self._choice(text, finish_reason, False)],
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> str:
        choice = self._choice(text, finish_reason, True)
        if role:
            choice["delta"] = {"role": "assistant", "content": ""}
        return sse({**self._head(True), "choices": [choice]})

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> str:
        return sse({**self._head(True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)})


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def error_event(err: APIError) -> str:
    return sse(err.body())


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
