"""The model this router serves, as its endpoints name it: the names a request may ask for, the one its
answers carry, its tokenizer and context length (common/text/model_info.py), the system fingerprint,
and each token's bytes for logprobs."""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass

from common.text.model_info import ModelInfo
from router.config import RouterConfig
from router.errors import invalid
from router.logprobs import TokenTexts


@dataclass(frozen=True)
class ServedModel:
    name: str  # the OpenAI model name answers carry: served_model_name, else the model id
    aliases: frozenset[str]  # what a request's `model` may say
    info: ModelInfo
    fingerprint: str  # system_fingerprint: what answers (model, splitserve version), as OpenAI's does
    token_texts: TokenTexts

    @classmethod
    def of(cls, config: RouterConfig, info: ModelInfo) -> ServedModel:
        name = config.served_model_name or info.model_id
        digest = hashlib.sha256(f"{info.model_id}/{_version()}".encode()).hexdigest()
        aliases = frozenset({name, info.model_id, "default"})
        return cls(name, aliases, info, f"fp_{digest[:10]}", TokenTexts(info.tokenizer))

    def check(self, asked: str) -> None:
        """A 400 (model_not_found) unless `asked` names this model."""
        if asked not in self.aliases:
            raise invalid(
                f"The model `{asked}` does not exist; this server serves `{self.name}`",
                "model", "model_not_found",
            )  # fmt: skip


def _version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:
        return "0"
