"""POST /tokenize and POST /detokenize, in vLLM's request and response shapes.

/tokenize takes a completion prompt `{model, prompt, add_special_tokens=true}` or a chat
`{model, messages, add_generation_prompt=true, add_special_tokens=false}` (rendered through the model's
chat template) and answers `{count, max_model_len, tokens}`, plus `token_strs` (the vocabulary's own
strings for the ids) when `return_token_strs` is true. /detokenize takes `{model, tokens}` and answers
`{prompt}` (special tokens kept, as vLLM does). `model` picks the served model whose tokenizer and
template are used (404 model_not_found for one not served); it may be left out, as vLLM allows: the
first (default) model.

The ids are the ones the generation endpoints would send to the workers for the same input: with the
default flags the prompt goes through `router.parse.tokenize_prompt` itself, and otherwise through the
same template and tokenizer calls with the caller's flags. Nothing is generated, but the work is real:
each call is charged one request to the key's `rpm` (and holds a concurrency slot while it runs) before
its body is parsed, under the `inference` scope (see router/app.py).
"""

from __future__ import annotations

from typing import Any, TypeVar

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import from_json

from router.errors import from_validation, invalid
from router.openai_types import ChatCompletionRequest, ChatMessage, CompletionRequest, request_body_schema
from router.parse import check_length, tokenize_prompt
from router.served_model import ServedModel, ServedModels

M = TypeVar("M", bound=BaseModel)


class _Tokenization(BaseModel):
    # as the completion requests: strict ("5" is not a number), unknown fields accepted and ignored
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    return_token_strs: bool | None = False


class TokenizeCompletionRequest(_Tokenization):
    prompt: str
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("prompt must not be empty")
        return v


class TokenizeChatRequest(_Tokenization):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template places the special tokens itself
    # vLLM's template options: refused when set, since the chat endpoint cannot honour them either
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _no_continue(cls, v: bool) -> bool:
        if v:
            raise ValueError("continue_final_message is not supported")
        return v

    @field_validator("chat_template")
    @classmethod
    def _no_template(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("a custom chat_template is not supported; the model's own is used")
        return v

    @field_validator("chat_template_kwargs", "tools")
    @classmethod
    def _no_extras(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported")
        return v


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int] = Field(min_length=1)


def tokenize_body_schema(served: list[str]) -> dict[str, Any]:
    """The OpenAPI requestBody of /tokenize: either request shape."""
    shapes = [request_body_schema(m, served) for m in (TokenizeCompletionRequest, TokenizeChatRequest)]
    any_of = [s["content"]["application/json"]["schema"] for s in shapes]
    return {"required": True, "content": {"application/json": {"schema": {"anyOf": any_of}}}}


def detokenize_body_schema(served: list[str]) -> dict[str, Any]:
    return request_body_schema(DetokenizeRequest, served)


def tokenize(models: ServedModels, body: bytes) -> dict[str, Any]:
    """POST /tokenize: the raw body in, the JSON answer out; APIError(400) for any bad input."""
    req = _parse_tokenize(body)
    model = models.lookup(req.model)
    ids = _prompt_ids(model, req)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": model.info.context_length, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [model.info.tokenizer.id_to_token(i) for i in ids]
    return out


def detokenize(models: ServedModels, body: bytes) -> dict[str, Any]:
    """POST /detokenize: the raw body in, the JSON answer out; APIError(400) for any bad input."""
    req = _parse(DetokenizeRequest, body)
    model = models.lookup(req.model)
    tok = model.info.tokenizer
    if not all(0 <= i < tok.vocab_size for i in req.tokens):
        raise invalid(f"tokens must be token ids in [0, {tok.vocab_size})", "tokens")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}


# ---- internals -----------------------------------------------------------------------------------


def _parse(model: type[M], body: bytes) -> M:
    """As router.parse.read: any validation problem is a 400 naming the offending param."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation(list(e.errors())) from None


def _parse_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A body with `messages` is a chat request, anything else a completion prompt (whose parse then
    names what is wrong, bad JSON included)."""
    try:
        obj = from_json(body)  # pydantic's parser: depth-limited, as the parse proper
    except ValueError:
        obj = None
    if isinstance(obj, dict) and "messages" in obj:
        if "prompt" in obj:
            raise invalid("give either prompt or messages, not both", "prompt")
        return _parse(TokenizeChatRequest, body)
    return _parse(TokenizeCompletionRequest, body)


def _prompt_ids(model: ServedModel, req: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
    tok = model.info.tokenizer
    if isinstance(req, TokenizeChatRequest):
        chat = ChatCompletionRequest.model_construct(model=req.model or "", messages=req.messages)
        if req.add_generation_prompt and not req.add_special_tokens:
            return tokenize_prompt(model.info, chat, model.tool_format)  # what /v1/chat/completions sends
        messages = chat.template_messages()  # the same messages, the same errors
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except (jinja2.TemplateError, ValueError) as e:
            raise invalid(f"messages cannot be formatted for this model: {e}", "messages") from e
        check_length(model.info, text, "messages")
        return tok.encode(text, add_special_tokens=req.add_special_tokens)
    if req.add_special_tokens:  # exactly what /v1/completions sends for a string prompt
        return tokenize_prompt(
            model.info, CompletionRequest.model_construct(model=req.model or "", prompt=req.prompt)
        )
    check_length(model.info, req.prompt, "prompt")
    return tok.encode(req.prompt, add_special_tokens=False)
