"""The models this router serves, as its endpoints name them: for each, the names a request may ask
for, the one its answers carry, its tokenizer and context length (common/text/model_info.py), the
system fingerprint, each token's bytes for logprobs, and how it writes tool calls (router/tool_formats.py:
`tool_call_parser` in the same place as its --model, one value for all, else detected from the chat
template the router renders with).

A router serves the models it is configured with (`model`, repeated, each named by the
`served_model_name` in the same place, else by its model id): it renders each one's prompts, so it
needs each one's tokenizer and chat template here. A request names one by its `model`; a name no
model has is a 404 `model_not_found`, as OpenAI answers it (router/workers.py sends each model's
requests to that model's services only)."""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from common.text.model_info import ModelInfo
from router.config import RouterConfig
from router.errors import APIError
from router.logprobs import TokenTexts
from router.tool_formats import AUTO, resolve

DEFAULT_ALIAS = "default"  # what a request may say for the first model configured


@dataclass(frozen=True)
class ServedModel:
    name: str  # the OpenAI model name answers carry: served_model_name, else the model id
    aliases: frozenset[str]  # what a request's `model` may say
    info: ModelInfo
    fingerprint: str  # system_fingerprint: what answers (model, splitserve version), as OpenAI's does
    token_texts: TokenTexts
    tool_format: str  # how it writes tool calls: a name of router/tool_formats.py's FORMATS

    @classmethod
    def of(cls, config: RouterConfig, info: ModelInfo) -> ServedModel:
        """The first model of `config`, loaded as `info` (a router serving one model)."""
        return ServedModels.of(config, [info]).default

    @classmethod
    def make(
        cls, name: str, info: ModelInfo, aliases: frozenset[str], tool_call_parser: str | None = None
    ) -> ServedModel:
        """`tool_call_parser`: a format's name; None or auto: detected from the model's chat template."""
        digest = hashlib.sha256(f"{info.model_id}/{_version()}".encode()).hexdigest()
        tool_format = resolve(tool_call_parser, info.tokenizer.chat_template)
        return cls(name, aliases | {name}, info, f"fp_{digest[:10]}", TokenTexts(info.tokenizer), tool_format)

    def check(self, asked: str) -> None:
        """A 404 (model_not_found) unless `asked` names this model."""
        if asked not in self.aliases:
            raise not_found(asked, [self.name])


@dataclass(frozen=True)
class ServedModels:
    """Every model of one router, in the order configured (the first is `default`)."""

    models: tuple[ServedModel, ...]

    @classmethod
    def of(cls, config: RouterConfig, infos: Sequence[ModelInfo]) -> ServedModels:
        """`infos`: the models of `config.model`, loaded, in its order (one, the default model's, when
        it names none). Each is named by `served_model_name` in the same place, else by its model id.
        A request may also say a model's id (unless two models share it) and `default` (the first).
        ValueError for names given twice or more names than models."""
        names = list(config.served_model_name)
        if len(names) > len(infos):
            raise ValueError(
                f"{len(names)} served model names for {len(infos)} models: give one per --model, in order"
            )
        names += [info.model_id for info in infos[len(names) :]]
        twice = sorted(n for n, k in Counter(names).items() if k > 1)
        if twice:
            raise ValueError(
                f"two models are served as {', '.join(map(repr, twice))}: give each --model its own "
                "--served-model-name"
            )
        parsers = list(config.tool_call_parser) or [AUTO]  # one value: every model's
        if len(parsers) not in (1, len(infos)):
            raise ValueError(
                f"{len(parsers)} tool call parsers for {len(infos)} models: give one for every model, or "
                "one per --model, in order"
            )
        parsers = parsers * len(infos) if len(parsers) == 1 else parsers
        ids = Counter(info.model_id for info in infos)
        models = []
        for i, (name, info) in enumerate(zip(names, infos, strict=True)):
            aliases = {info.model_id} if ids[info.model_id] == 1 and info.model_id not in names else set()
            if i == 0:
                aliases.add(DEFAULT_ALIAS)
            models.append(ServedModel.make(name, info, frozenset(aliases), parsers[i]))
        return cls(tuple(models))

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def lookup(self, asked: str | None) -> ServedModel:
        """The model a request's `model` names (None: the default, where an endpoint lets it be left
        out); APIError 404 model_not_found for any other name."""
        if asked is None:
            return self.default
        for m in self.models:
            if asked in m.aliases:
                return m
        raise not_found(asked, self.names)

    def aliases(self) -> list[str]:
        """Every name a request may say, sorted (the OpenAPI schema's enum)."""
        return sorted({a for m in self.models for a in m.aliases})


def not_found(asked: str, served: list[str]) -> APIError:
    """OpenAI's answer for a model it does not have: 404, invalid_request_error, model_not_found."""
    listed = ", ".join(f"`{n}`" for n in served)
    return APIError(
        404,
        f"The model `{asked}` does not exist; this server serves {listed} (GET /v1/models)",
        "model", "model_not_found",
    )  # fmt: skip


def _version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:
        return "0"
