"""Phase 1 of a generation request: its body and headers in, a `Parsed` request out, or a 400 that
names the offending param (OpenAI's error body). Validates, renders the chat template, tokenizes, works
out max_tokens and the sampling parameters the services get. Nothing here waits or calls a service."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
from pydantic import ValidationError

from common.sampling_params import Guide, SamplingParams
from common.text.model_info import ModelInfo
from common.text.tokenizer import Tokenizer
from router.auth.keys import ApiKey
from router.config import RouterConfig
from router.errors import from_validation, invalid
from router.openai_types import ChatCompletionRequest, CompletionRequest
from router.served_model import ServedModel
from router.slo import Targets, parse_target
from router.tool_formats import detect
from router.tools import check_tools, render_messages, tool_guide, tool_mode

OpenAIRequest = CompletionRequest | ChatCompletionRequest


@dataclass(frozen=True)
class Parsed:
    """One request, valid: what every later phase reads of it."""

    req: OpenAIRequest  # the body, validated
    prompt_ids: list[int]  # what the services get: the prompt, or the messages through the template
    sampling: SamplingParams  # max_tokens at least 1 (see score_only)
    tenant: str  # whose request, for the services' fair share ("" without a key or header)
    priority: int  # its class inside the tenant (lower first)
    targets: Targets  # its latency targets, if any (router/slo.py)
    echo: str | None = None  # completions with echo: the prompt's text, returned before the completion
    score_only: bool = False  # completions, max_tokens 0 with echo: the one token generated is dropped
    tool_mode: str | None = None  # "auto" | "required" | "named": the output is parsed for tool calls
    tool_names: list[str] | None = None  # the functions offered: a call to another is not a call
    model: str = ""  # the served model's name (router/served_model.py): whose services run it
    tool_format: str = "hermes"  # how the model writes tool calls (router/tool_formats.py)

    @property
    def chat(self) -> bool:
        return isinstance(self.req, ChatCompletionRequest)


def read(body: bytes, chat: bool) -> OpenAIRequest:
    """The raw JSON body as the endpoint's request model; any problem is an APIError(400) naming the
    offending param."""
    model: type[OpenAIRequest] = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation(list(e.errors())) from None


def endpoint(chat: bool) -> str:
    """The `endpoint` label of the request metrics."""
    return "chat" if chat else "completions"


def parse(
    req: OpenAIRequest,
    headers: Mapping[str, str],
    key: ApiKey | None,
    model: ServedModel,
    config: RouterConfig,
) -> Parsed:
    """Check `req` (its body) and `headers` for `key` (None while auth is off) and work out what the
    services are sent, for `model` (the one `req.model` names: else 404); APIError(400) for anything
    that cannot be served."""
    model.check(req.model)
    _check_stops(req.stop_list, config.max_stop_chars)
    tenant, priority, targets = _tenant(headers, key), _priority(headers), _targets(headers, key)
    guide, mode, names = _guide(req)
    prompt_ids = tokenize_prompt(model.info, req, model.tool_format)
    max_tokens = _max_tokens(req, len(prompt_ids), model.info.context_length, config.default_max_tokens)
    sampling = req.sampling(max(max_tokens, 1), model.info.tokenizer.vocab_size, guide)
    echo = None
    if isinstance(req, CompletionRequest) and req.echo:
        tok = model.info.tokenizer
        echo = req.prompt if isinstance(req.prompt, str) else tok.decode(req.prompt)  # type: ignore[arg-type]
        if req.logprobs is not None:  # scored by the service that prefills the prompt
            sampling = sampling.replace(prompt_logprobs=req.logprobs)
    score_only = max_tokens == 0
    return Parsed(
        req, prompt_ids, sampling, tenant, priority, targets, echo, score_only, mode, names, model.name,
        model.tool_format,
    )  # fmt: skip


@functools.cache
def max_token_chars(tok: Tokenizer) -> int:
    """The most characters one token of `tok` stands for (special tokens' text included): a text of n
    characters has at least n / this many tokens (byte-level BPE: a token's characters are its bytes)."""
    return max(1, max(len(tok.id_to_token(i)) for i in range(tok.vocab_size)))


def check_length(info: ModelInfo, text: str, param: str) -> None:
    """400 context_length_exceeded, before tokenizing, for a text that cannot fit the context however it
    tokenizes: an 8 MiB body costs a length check, not seconds of tokenizer time on the router."""
    fewest = len(text) // max_token_chars(info.tokenizer)
    if fewest >= info.context_length:
        raise invalid(
            f"This model's maximum context length is {info.context_length} tokens; this input has at least "
            f"{fewest} tokens ({len(text)} characters).", param, "context_length_exceeded",
        )  # fmt: skip


def tokenize_prompt(info: ModelInfo, req: OpenAIRequest, tool_format: str | None = None) -> list[int]:
    """The prompt's token ids as the services get them (POST /tokenize gives the same, router/tokenize.py).
    `tool_format`: the model's (ServedModel.tool_format); None: detected from its chat template."""
    tok = info.tokenizer
    if isinstance(req, ChatCompletionRequest):
        messages, kwargs = req.template_messages(), dict[str, Any]()
        if req.uses_tools:
            fmt = tool_format or detect(tok.chat_template)
            messages, kwargs = render_messages(messages, req.tools, tok.chat_template, req.tool_choice, fmt)
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        except (jinja2.TemplateError, ValueError) as e:
            raise invalid(f"messages cannot be formatted for this model: {e}", "messages") from e
        check_length(info, text, "messages")
        return tok.encode(text, add_special_tokens=False)  # the template places special tokens
    if isinstance(req.prompt, str):
        check_length(info, req.prompt, "prompt")
        return tok.encode(req.prompt)
    ids = list(req.prompt)
    if not all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids):
        raise invalid(f"prompt token ids must be in [0, {tok.vocab_size})", "prompt")
    return ids  # type: ignore[return-value]


def _check_stops(stops: tuple[str, ...], limit: int) -> None:
    if any(len(s) > limit for s in stops):
        raise invalid(f"stop sequences may be at most {limit} characters long", "stop")


def _guide(req: OpenAIRequest) -> tuple[Guide | None, str | None, list[str] | None]:
    """The request's structured-output constraint: response_format / structured_outputs, or the
    tool-call guide that tool_choice "required" or a named function sets (not both); with the tool
    mode and the functions offered."""
    guide = req.guide()
    if not isinstance(req, ChatCompletionRequest):
        return guide, None, None
    check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    mode = tool_mode(req.tools, req.tool_choice)
    names = [t.function.name for t in req.tools or ()] if mode is not None else None
    calls = tool_guide(req.tools, req.tool_choice, req.parallel_tool_calls)
    if calls is not None and guide is not None:
        raise invalid("response_format cannot be combined with a forced tool call", "response_format")
    return calls or guide, mode, names


def _max_tokens(req: OpenAIRequest, n_prompt: int, ctx: int, default: int) -> int:
    prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    asked = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        asked = req.max_completion_tokens
    if n_prompt >= ctx:
        raise invalid(
            f"This model's maximum context length is {ctx} tokens, but the prompt has {n_prompt} tokens "
            "and no room is left for the completion.", prompt_param, "context_length_exceeded",
        )  # fmt: skip
    if asked is None:
        return min(default, ctx - n_prompt)
    if asked == 0 and not (isinstance(req, CompletionRequest) and req.echo):
        raise invalid("max_tokens may be 0 only with echo (to score the prompt)", "max_tokens")
    if n_prompt + asked > ctx:
        raise invalid(
            f"This model's maximum context length is {ctx} tokens, but {n_prompt + asked} were requested "
            f"({n_prompt} in the prompt + {asked} max_tokens). Reduce the prompt or max_tokens.",
            "max_tokens", "context_length_exceeded",
        )  # fmt: skip
    return asked


# ---- headers -------------------------------------------------------------------------------------

_TENANT_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,64}")


def _tenant(headers: Mapping[str, str], key: ApiKey | None) -> str:
    """Whose request, for the services' fair share: the API key's tenant; without a key (auth off), the
    `x-splitserve-tenant` header, or "" (everyone without one shares a tenant). A key's tenant always
    wins: a header cannot move a request into another tenant's share."""
    if key is not None:
        return key.tenant
    name = headers.get("x-splitserve-tenant")
    if name is None:
        return ""
    if not _TENANT_NAME.fullmatch(name):
        raise invalid(
            "x-splitserve-tenant must be 1-64 characters of letters, digits and . _ : @ -",
            "x-splitserve-tenant",
        )
    return name


def _targets(headers: Mapping[str, str], key: ApiKey | None) -> Targets:
    """The request's latency targets: its headers', else its API key's defaults (router/slo.py)."""
    ttft = parse_target(headers.get("x-splitserve-ttft-slo-ms"), "x-splitserve-ttft-slo-ms")
    tpot = parse_target(headers.get("x-splitserve-tpot-slo-ms"), "x-splitserve-tpot-slo-ms")
    if key is not None:
        ttft = ttft if ttft is not None else key.limits.ttft_slo_ms
        tpot = tpot if tpot is not None else key.limits.tpot_slo_ms
    return Targets(ttft, tpot)


def _priority(headers: Mapping[str, str]) -> int:
    """The request's class inside its tenant (`x-splitserve-priority`, lower runs first; default 0)."""
    value = headers.get("x-splitserve-priority")
    if value is None:
        return 0
    try:
        priority = int(value)
    except ValueError:
        priority = None
    if priority is None or not -100 <= priority <= 100:
        raise invalid("x-splitserve-priority must be an integer from -100 to 100", "x-splitserve-priority")
    return priority
