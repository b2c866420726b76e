"""Tokenizer and chat template: a thin layer over `tokenizers` (BPE) and jinja2 (templates).

Two sources: an HF tokenizer.json (+ tokenizer_config.json), or the vocabulary embedded in a GGUF
file, which we rebuild into the same `tokenizers` object so both paths share one encoder. A GGUF holds
one of two kinds (`tokenizer.ggml.model`):

* "gpt2": byte-level BPE with merges (Llama 3, Qwen2, SmolLM2), split first by the regexes that
  `tokenizer.ggml.pre` names;
* "llama": SentencePiece (Llama 2, Mistral, Gemma), rebuilt as transformers 5 rebuilds it from the same
  GGUF (our reference): a BPE over "▁"-for-space pieces with byte fallback, its merges derived from
  the vocabulary (pieces ranked by score; Gemma's by their order in the file, and Gemma's runs of spaces
  respelled as runs of "▁"), Llama's "▁" prefix on the text (Gemma has none).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

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
SPIECE_SPACE = "\u2581"  # SentencePiece's "▁": a space inside a piece
# GGUF architectures whose SentencePiece vocabulary is Gemma's (no prefix space, spaces normalised)
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
# Control tokens that end a turn although the GGUF names no eot id: generation stops on them, as in
# llama.cpp (and as Gemma's generation_config.json says: eos and <end_of_turn>)
_EOT_TOKENS = {"gemma": "<end_of_turn>", "gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>"}


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

    @cached_property
    def fingerprint(self) -> str:
        """What a token id means here, as 20 hex characters: SHA-256 over every id and its token string.
        A service registers it; a router routes only to services whose ids mean what its own tokenizer's
        do (router/workers.py): the same text, other ids, would be another model's prompt. Chat template
        and EOS ids are left out on purpose: the router renders (and may override the template), and EOS
        sets may be widened per service without changing what an id means."""
        h = hashlib.sha256()
        for token, i in sorted(self.tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]):
            h.update(f"{i}\t{token}\n".encode())
        return h.hexdigest()[:20]

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
        if kind in ("gpt2", "llama") and not meta.get("tokenizer.ggml.tokens"):
            raise ValueError("the GGUF holds no vocabulary (tokenizer.ggml.tokens)")
        if kind == "gpt2":
            tok = _byte_level_bpe(meta)
        elif kind == "llama":
            tok = _sentencepiece_bpe(meta)
        else:
            raise NotImplementedError(
                f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE and 'llama' SentencePiece)"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        bos = meta.get("tokenizer.ggml.bos_token_id")
        # llama.cpp (and transformers) add a BOS to SentencePiece vocabularies that do not say otherwise
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        head = [tokens[bos]] if bos is not None and add_bos else []
        tail = (
            [tokens[eos_id]] if eos_id is not None and meta.get("tokenizer.ggml.add_eos_token", False) else []
        )
        if head or tail:
            tok.post_processor = processors.TemplateProcessing(
                single=" ".join([*head, "$A", *tail]),
                pair=" ".join([*head, "$A", *tail, *head, "$B", *tail]),
                special_tokens=[
                    (tokens[i], i)
                    for i in dict.fromkeys(
                        i for i, used in ((bos, head), (eos_id, tail)) if used and i is not None
                    )
                ],
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
        eot = _EOT_TOKENS.get(meta.get("general.architecture", ""))
        types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        if eot is not None and eot in tokens and types[tokens.index(eot)] == TOKEN_TYPE_CONTROL:
            eos_ids.append(tokens.index(eot))
        eos_ids = list(dict.fromkeys(int(i) for i in eos_ids))  # dedupe, keep order
        return cls(tok, meta.get("tokenizer.chat_template"), bos, eos_ids)


def _byte_level_bpe(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """A "gpt2" GGUF vocabulary: byte-level BPE with its merges, split by `tokenizer.ggml.pre`."""
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
    return tok


def _sentencepiece_bpe(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """A "llama" (SentencePiece) GGUF vocabulary as transformers 5 builds it from the same file
    (integrations/gguf/gguf_tokenizer_mapping.py: LlamaTokenizer / GemmaTokenizer over derived merges):
    BPE with byte fallback over pieces that spell a space "▁"."""
    arch = meta.get("general.architecture", "llama")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    gemma = arch in _GEMMA_ARCHS
    spelled = tokens
    if gemma:
        # Gemma's runs of spaces are stored as spaces; its pieces spell them "▁"
        spelled = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        # Gemma's scores do not follow its merge order, the order of the pieces in the file does
        ranks: dict[str, float] = (
            {t: -i for i, t in enumerate(spelled)}
            if gemma
            else dict(zip(tokens, meta["tokenizer.ggml.scores"], strict=True))
        )
        merges = derive_merges(vocab, ranks)
    unk = "<unk>" if gemma else None  # as GemmaTokenizer and LlamaTokenizer build their BPE
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = tokenizers.Tokenizer(bpe)
    to_text: list[decoders.Decoder] = [
        decoders.Replace(SPIECE_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if gemma:  # no prefix space; every space becomes "▁"
        tok.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        # transformers' LlamaTokenizer prefixes "▁" to the text's first piece whatever
        # tokenizer.ggml.add_space_prefix says, and strips that space when decoding
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPIECE_SPACE, prepend_scheme="first", split=False
        )
        to_text.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(to_text)
    # Control tokens are special, whole in the text, and so are bos/eos/unk/pad whatever their type
    # (transformers makes them its special tokens); user-defined ones (Gemma's "\n\n") are whole too.
    named = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")} - {None}
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
            if ty == TOKEN_TYPE_CONTROL or i in named
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == TOKEN_TYPE_USER_DEFINED and t in vocab
        ]
    )
    return tok


def derive_merges(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary without any (SentencePiece's): every split of a piece into two
    pieces of the vocabulary, best-ranked piece first, as transformers' `generate_merges` orders them
    (ties: the longer left part first, then the longer right part, then the order of the pieces)."""
    merges: list[tuple[str, str, float]] = []
    for piece, rank in ranks.items():
        local = [
            (piece[:i], piece[i:], rank)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]
