"""SentencePiece-style GGUF vocabularies (`tokenizer.ggml.model` "llama": Llama 2, Mistral, Gemma) rebuilt
by `Tokenizer.from_gguf_metadata`, against transformers' tokenizer loaded from the same GGUF file.

The vocabularies are made here (a few hundred pieces cut from a corpus, with scores, byte pieces,
control and user-defined tokens), written with the gguf package, and read back by both. The real
262k-piece Gemma 3 vocabulary is checked the same way in tests/integration/test_gemma3_gguf.py.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import pytest

from common.text.model_info import read_gguf_header
from common.text.tokenizer import Tokenizer, derive_merges

CORPUS = (
    "Hello world! The quick brown fox jumps over the lazy dog. Hello again, world; the world says hello.\n"
    "def hello(x):\n    return x  # a comment\n\tindented with a tab\n"
    "Ünïcödé café naïve, 日本語のテキスト, numbers 1234567 and 3.14159."
)
STRINGS = [
    "Hello world",
    "hello world, the quick brown fox",
    " leading space",
    "  two leading spaces",
    "trailing spaces  ",
    "multiple    spaces   inside",
    "tabs\tand\nnewlines\n\n\nend\r\n",
    "Ünïcödé 日本語 🙂 👍🏽 (no piece: byte fallback)",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "special in text: <s> </s> <unk> <bos> <eos> <pad>",
    "user-defined <tool> inside<tool>words",
    "code:\n    def hello(x):\n\treturn x ** 2\n",
    "control bytes \x00\x01\x7f",
    "",
    " ",
    "\n",
    "x" * 40,
    "thethethe quickquick",
]


def _pieces(prefix_space: bool, n: int = 300) -> list[str]:
    """The n most frequent substrings (2..6 characters) of the corpus' words, SentencePiece-spelled."""
    counts: Counter[str] = Counter()
    for word in CORPUS.replace("\n", " ").split(" "):
        if not word:
            continue
        w = "\u2581" + word if prefix_space else word
        for i in range(len(w)):
            for j in range(i + 2, min(len(w), i + 6) + 1):
                counts[w[i:j]] += 1
    chars = sorted(set(CORPUS) - set(" \n\t") | {"\u2581"})
    frequent = [p for p, _ in sorted(counts.items(), key=lambda kv: (-kv[1], -len(kv[0]), kv[0]))[:n]]
    # a few characters of the corpus are left out, so some text falls back to bytes
    return [c for c in chars if c not in "語ï"] + frequent


def _write(
    path: Path, arch: str, tokens: list[str], types: list[int], scores: list[float], **ids: int
) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    for k, v in ids.items():
        getattr(w, f"add_{k}_token_id")(v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_vocab(tmp_path: Path) -> Path:
    """Llama 2 / Mistral style: <unk> <s> </s>, 256 byte pieces, scored pieces with "\u2581" prefixes."""
    pieces = _pieces(prefix_space=True)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<tool>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
    # scores: longer pieces first within a few ties, so the merge order is not the file order
    scores = [0.0] * 259 + [-float(i // 3) - 0.5 * (len(p) < 3) for i, p in enumerate(pieces)] + [0.0]
    return _write(tmp_path / "llama.gguf", "llama", tokens, types, scores, bos=1, eos=2, unk=0)


def gemma_vocab(tmp_path: Path) -> Path:
    """Gemma style: <pad> <eos> <bos> <unk>, turn markers, "\\n" runs and space runs (stored as spaces)
    as user-defined tokens, pieces whose scores do not follow their order in the file."""
    pieces = _pieces(prefix_space=True)
    lead = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    runs = ["\n", "\n\n", "\n\n\n", "  ", "   ", "    ", "\t", "\t\t"]
    tokens = lead + runs + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<tool>"]
    types = [3] * len(lead) + [4] * len(runs) + [6] * 256 + [1] * len(pieces) + [4]
    scores = [-1000.0] * (len(lead) + len(runs) + 256) + [float(len(p)) for p in pieces] + [-1000.0]
    return _write(tmp_path / "gemma.gguf", "gemma3", tokens, types, scores, bos=2, eos=1, unk=3, pad=0)


def _transformers(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_matches_transformers(tmp_path: Path, kind: str) -> None:
    path = (llama_vocab if kind == "llama" else gemma_vocab)(tmp_path)
    ours = Tokenizer.from_gguf_metadata(read_gguf_header(str(path)).meta)
    theirs = _transformers(path)
    # the whole tokenizer as `tokenizers` serialises it: vocabulary, derived merges, normalizer,
    # pre-tokenizer, decoder, added tokens (the pair template's type ids aside: we never encode pairs)
    a, b = json.loads(ours.tok.to_str()), json.loads(theirs.backend_tokenizer.to_str())
    assert a["model"]["merges"] and a["model"] == b["model"]
    for part in ("normalizer", "pre_tokenizer", "decoder", "added_tokens"):
        assert a[part] == b[part], part
    assert a["post_processor"]["single"] == b["post_processor"]["single"]
    for s in STRINGS:
        ids = theirs.encode(s)
        assert ours.encode(s) == ids, s
        assert ours.encode(s, add_special_tokens=False) == theirs.encode(s, add_special_tokens=False), s
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), s
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), s
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_ids[0] == theirs.eos_token_id


def test_gemma_details(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf_metadata(read_gguf_header(str(gemma_vocab(tmp_path))).meta)
    ids = tok.encode("a\n\nb  c")
    assert ids[0] == 2 and 8 in ids  # <bos>, then "\n\n" whole (a user-defined token)
    assert tok.eos_token_ids == (1, 6)  # <eos>, and <end_of_turn> ends a turn as llama.cpp says
    assert tok.decode(tok.encode("  two leading spaces")) == "  two leading spaces"  # no prefix space


def test_llama_details(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf_metadata(read_gguf_header(str(llama_vocab(tmp_path))).meta)
    assert tok.encode("Hello")[0] == 1  # <s> added: SentencePiece vocabularies add BOS unless told not to
    assert tok.id_to_token(tok.encode("Hello", add_special_tokens=False)[0]).startswith("\u2581")
    ids = tok.encode("🙂", add_special_tokens=False)  # "▁" prefixed, then byte fallback
    assert tok.id_to_token(ids[0]) == "▁" and ids[1:] == [3 + b for b in "🙂".encode()]
    assert tok.eos_token_ids == (2,)


def test_derive_merges_orders_by_rank_then_length() -> None:
    vocab = {"a": 0, "b": 1, "ab": 2, "abb": 3, "bb": 4}
    # "abb" splits as a+bb and ab+b; best-ranked piece first, ties: longer left part first
    assert derive_merges(vocab, {"ab": 3.0, "bb": 2.0, "abb": 1.0}) == [
        ("a", "b"),
        ("b", "b"),
        ("ab", "b"),
        ("a", "bb"),
    ]


def test_unknown_kinds_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="'t5'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5"})
