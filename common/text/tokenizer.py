"""Tokenizer and chat template: a thin layer over `tokenizers` (BPE) and jinja2 (templates).

Two sources: an HF tokenizer.json (+ tokenizer_config.json), or the vocabulary embedded in a GGUF
file, which we rebuild into the same `tokenizers` object so both paths share one encoder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

# GPT-2's split: contractions, letter runs, digit runs, punctuation runs, whitespace.
_GPT2_RE = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3 / Qwen2: case-insensitive contractions, digits in groups of up to 3 (Qwen2: single digits).
_LLAMA3_RE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# tokenizer.ggml.pre -> regexes applied in order before byte-level BPE (mirrors llama.cpp's table).
# "smollm" (like starcoder) first isolates every digit, then GPT-2's split: the same as the HF
# SmolLM2 tokenizer.json's Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_RE,),
    "gpt-2": (_GPT2_RE,),
    "gpt2": (_GPT2_RE,),
    "smollm": (r"\p{N}", _GPT2_RE),
    "starcoder": (r"\p{N}", _GPT2_RE),
    "refact": (r"\p{N}", _GPT2_RE),
    "llama-bpe": (_LLAMA3_RE,),
    "llama3": (_LLAMA3_RE,),
    "qwen2": (_LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}"),),
}

TOKEN_TYPE_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
TOKEN_TYPE_USER_DEFINED = 4


class Tokenizer:
    """Encode/decode plus chat templating. `eos_token_ids` are every id that ends generation."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # add_special_tokens only controls the post-processor (e.g. a BOS); special-token *text* such
        # as "<|im_start|>" in `text` is always parsed as its single id, as chat templates need.
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int | None) -> str:
        return "" if i is None else (self.tok.id_to_token(i) or "")

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        # Sandboxed: templates come from weight files we did not write. Trim settings match HF's.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text; `variables` are further template variables (e.g. `tools`)."""
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.id_to_token(self.bos_token_id),
            eos_token=self.id_to_token(eos),
            **variables,
        )

    # --- constructors ------------------------------------------------------------------------------
    @classmethod
    def from_hf_files(
        cls,
        tokenizer_json: str,
        tokenizer_config: dict[str, Any],
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
    ) -> Tokenizer:
        tok = tokenizers.Tokenizer.from_file(tokenizer_json)
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):  # multi-template form: [{"name": "default", "template": ...}]
            by_name = {t["name"]: t["template"] for t in template}
            template = by_name.get("default")
        return cls(tok, template, bos_token_id, eos_token_ids)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer embedded in GGUF metadata (tokenizer.ggml.* keys, values decoded)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind == "llama":
            raise NotImplementedError(
                "GGUF with a SentencePiece ('llama') tokenizer is not supported; "
                "use the model's Hugging Face folder (tokenizer.json) instead"
            )
        if kind != "gpt2":
            raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_SPLITS:
            raise NotImplementedError(
                f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(_PRE_SPLITS))}"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        splits: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]
        ]
        # The regexes above already split; ByteLevel only maps bytes to GPT-2's printable alphabet.
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
        tok.decoder = decoders.ByteLevel()
        # Control tokens are matched as whole strings before BPE, so "<|im_end|>" is one id.
        tok.add_tokens(
            [
                AddedToken(t, special=ty == TOKEN_TYPE_CONTROL, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
            ]
        )
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if bos is not None and meta.get("tokenizer.ggml.add_bos_token", False):
            tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
            )
        eos_ids = [
            meta[k]
            for k in (
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id",
            )
            if meta.get(k) is not None
        ]
        eos_ids = list(dict.fromkeys(int(i) for i in eos_ids))  # dedupe, keep order
        return cls(tok, meta.get("tokenizer.chat_template"), bos, eos_ids)
