"""OpenAI response shapes: a whole completion, a stream's chunks and their SSE framing (the request
models are in router/openai_types.py; what goes into these, usage included, is router/response.py's)."""

from __future__ import annotations

import json
import time
from typing import Any

from router.errors import APIError


class Builder:
    """Builds one request's response objects; `chat` picks chat.completion vs text_completion shapes."""

    def __init__(
        self, request_id: str, model: str, chat: bool, fingerprint: str | None = None, index: int = 0
    ) -> None:
        self.id, self.model, self.chat, self.index = request_id, model, chat, index
        self.fingerprint = fingerprint
        self.created = int(time.time())

    def _choice(
        self,
        text: str | None,
        finish_reason: str | None,
        stream: bool,
        logprobs: Any = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if not self.chat:
            return {
                "index": self.index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        key = "delta" if stream else "message"
        body: dict[str, Any] = {} if stream and text is None else {"content": text or ""}
        if not stream:
            body = {"role": "assistant", **body}
            if tool_calls:
                body["content"] = text or None
        if tool_calls:
            body["tool_calls"] = tool_calls
        lp = {"content": logprobs} if logprobs is not None else None
        return {"index": self.index, key: body, "logprobs": lp, "finish_reason": finish_reason}

    def _head(self, stream: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        head = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        if self.fingerprint is not None:
            head["system_fingerprint"] = self.fingerprint
        return head

    def full(
        self,
        text: str | None,
        finish_reason: str,
        usage: dict[str, Any],
        logprobs: Any = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return {
            **self._head(False),
            "choices": [self._choice(text, finish_reason, False, logprobs, tool_calls)],
            "usage": usage,
        }

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        logprobs: Any = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> str:
        choice = self._choice(text, finish_reason, True, logprobs, tool_calls)
        if role:
            choice["delta"] = {"role": "assistant", "content": ""}
        return sse({**self._head(True), "choices": [choice]})

    def usage_chunk(self, usage: dict[str, Any]) -> str:
        return sse({**self._head(True), "choices": [], "usage": usage})


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def error_event(err: APIError) -> str:
    return sse(err.body())
