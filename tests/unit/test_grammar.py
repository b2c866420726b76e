"""common/text/grammar.py with the real SmolLM2 tokenizer: masks, constrained random walks whose output
must validate, errors, the compile cache, and replay (a matcher rebuilt from the ids so far)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch

from common.sampling_params import Guide
from common.text.grammar import GrammarCompiler, GrammarMatcher, GuideError, guide_grammar, validate_guide
from common.text.model_info import load_model_info
from common.text.tokenizer import Tokenizer
from tests.support.grammar import allocate_bitmask

PAD = 64  # models often pad the embedding past the tokenizer: those ids must never be allowed


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_model_info().tokenizer


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, tok.vocab_size + PAD)


@pytest.fixture(scope="module")
def boost(tok: Tokenizer) -> torch.Tensor:
    """Logit bonus for the tokens that close things (quotes, brackets, commas) and for EOS, so that a
    random walk ends: unbiased, a free string would close once in ~50k tokens."""
    closers = {'"', "}", "]", ",", '"}', '"]', '",', "})", "]}"}
    b = torch.zeros(tok.vocab_size + PAD)
    for i in range(tok.vocab_size):
        if tok.decode([i], skip_special_tokens=False) in closers:
            b[i] = 4.0
    b[list(tok.eos_token_ids)] = 4.0
    return b


def allowed_mask(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """One bool per id from a bitmask row (bit i of word w: id 32*w + i)."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.bool().flatten()[:vocab]


def allowed(m: GrammarMatcher, vocab: int) -> set[int]:
    bm = allocate_bitmask(1, vocab)
    m.fill_bitmask(bm, 0)
    return set(allowed_mask(bm[0], vocab).nonzero().flatten().tolist())


def walk(
    compiler: GrammarCompiler,
    tok: Tokenizer,
    guide: Guide,
    seed: int,
    boost: torch.Tensor | None = None,
    max_steps: int = 400,
) -> tuple[str, list[int]]:
    """Greedy decoding of random logits under the guide's mask: the text (EOS dropped) and the ids."""
    g = torch.Generator().manual_seed(seed)
    m = compiler.matcher(guide)
    bm = allocate_bitmask(1, compiler.vocab_size)
    ids: list[int] = []
    for _ in range(max_steps):
        m.fill_bitmask(bm, 0)
        logits = torch.randn(compiler.vocab_size, generator=g)
        if boost is not None:
            logits += boost
        logits[~allowed_mask(bm[0], compiler.vocab_size)] = float("-inf")
        t = int(logits.argmax())
        assert torch.isfinite(logits[t]), "the mask allowed nothing"
        assert m.accept(t), m.error
        ids.append(t)
        if t in tok.eos_token_ids or m.is_finished:
            break
    else:
        pytest.fail(f"no end after {max_steps} tokens: {tok.decode(ids)!r}")
    return tok.decode([i for i in ids if i not in tok.eos_token_ids]), ids


SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {"type": "integer", "minimum": -5, "maximum": 100},
    {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5},
    {"enum": ["red", "green", "blue"]},
    {"enum": ['say "hi"', "é ü", 3, None, True]},
    {"const": {"k": [1, 2]}},
    {"type": "boolean"},
    {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2},
    {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "integer"}],
        "items": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1}, "email": {"type": "string"}},
                "required": ["id"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
    {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                "required": ["kind", "lives"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                "required": ["kind", "good"],
                "additionalProperties": False,
            },
        ]
    },
    {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    {"type": "string", "format": "date"},
    {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date-time"}, "n": {"type": ["integer", "null"]}},
        "required": ["when", "n"],
    },
]

STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_random_walk_validates(compiler, tok, boost, schema, seed):
    text, _ = walk(compiler, tok, Guide("json_schema", json.dumps(schema)), seed, boost)
    value = json.loads(text)
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(value)
    assert not re.search(r"\s", STRINGS.sub("", text)), f"whitespace outside strings: {text!r}"


@pytest.mark.parametrize("seed", range(4))
def test_json_object(compiler, tok, boost, seed):
    text, _ = walk(compiler, tok, Guide("json_object"), seed, boost)
    assert isinstance(json.loads(text), dict)
    assert not re.search(r"\s", STRINGS.sub("", text))


def test_whitespace_cannot_be_turned_back_on(compiler, tok):
    """A schema's own x-guidance must not re-enable free whitespace (a small model's endless loop)."""
    guide = Guide("json_schema", json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": True}}))
    with pytest.raises(GuideError):
        compiler.matcher(guide, tok.encode('{ "a":1}', add_special_tokens=False))
    assert compiler.matcher(guide, tok.encode('{"a":1}', add_special_tokens=False)).is_finished


@pytest.mark.parametrize("seed", range(6))
def test_regex_and_lark(compiler, tok, seed):
    pattern = r"\d{3}-[a-z]{2,4}"
    text, _ = walk(compiler, tok, Guide("regex", pattern), seed)
    assert re.fullmatch(pattern, text), text
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
    text, _ = walk(compiler, tok, Guide("grammar", lark), seed, max_steps=200)
    assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text), text


def test_choice(compiler, tok):
    choices = ["yes", "no", "maybe so", 'quote " and \\ slash', "naïve"]
    seen = set()
    for seed in range(12):
        text, _ = walk(compiler, tok, Guide("choice", json.dumps(choices)), seed)
        assert text in choices
        seen.add(text)
    assert len(seen) > 1
    for c in choices:  # every choice is reachable, and complete once written
        m = compiler.matcher(Guide("choice", json.dumps(choices)), tok.encode(c, add_special_tokens=False))
        assert m.is_accepting


def test_prefix_choice_allows_eos_or_more(compiler, tok):
    guide = Guide("choice", json.dumps(["yes", "yes sir"]))
    m = compiler.matcher(guide, tok.encode("yes", add_special_tokens=False))
    ok = allowed(m, compiler.vocab_size)
    assert not m.is_finished and m.is_accepting
    assert set(tok.eos_token_ids) <= ok
    assert tok.encode(" sir", add_special_tokens=False)[0] in ok


def test_mask_allows_exactly_the_valid_tokens(compiler, tok):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    guide = Guide("json_schema", json.dumps(schema))
    for prefix_text in ["", '{"name":"', '{"name":"Al']:
        prefix = tok.encode(prefix_text, add_special_tokens=False)
        ok = allowed(compiler.matcher(guide, prefix), compiler.vocab_size)
        assert ok and max(ok) < tok.vocab_size, "a padding id was allowed"
        assert not ok & set(tok.eos_token_ids), "EOS allowed before the object is complete"
        g = torch.Generator().manual_seed(len(prefix))
        refused = [i for i in torch.randperm(tok.vocab_size, generator=g).tolist() if i not in ok][:150]
        for t in sorted(ok)[:: max(1, len(ok) // 150)] + refused:
            if t in ok:
                compiler.matcher(guide, [*prefix, t])
            else:
                with pytest.raises(GuideError, match="refused"):
                    compiler.matcher(guide, [*prefix, t])
        if not prefix_text:
            assert all(tok.decode([t]).startswith("{") for t in ok)


def test_complete_grammar_forces_eos(compiler, tok):
    m = compiler.matcher(
        Guide("json_schema", '{"type":"boolean"}'), tok.encode("true", add_special_tokens=False)
    )
    assert m.is_finished
    assert allowed(m, compiler.vocab_size) == set(tok.eos_token_ids)
    m = compiler.matcher(
        Guide("json_schema", '{"type":"integer"}'), tok.encode("7", add_special_tokens=False)
    )
    assert m.is_accepting and not m.is_finished
    ok = allowed(m, compiler.vocab_size)
    assert set(tok.eos_token_ids) <= ok and tok.encode("8", add_special_tokens=False)[0] in ok
    assert m.accept(tok.eos_token_ids[0]) and m.is_finished


def test_refused_token(compiler, tok):
    m = compiler.matcher(Guide("json_object"))
    assert not m.accept(tok.encode("x", add_special_tokens=False)[0])
    assert not m.is_finished and m.error


@pytest.mark.parametrize(
    ("guide", "words"),
    [
        (Guide("json_schema", "{not json"), "invalid JSON schema: not valid JSON"),
        (Guide("json_schema", '"string"'), "must be a JSON object"),
        (Guide("json_schema", '{"type": "foo"}'), "invalid JSON schema: .*foo"),
        (Guide("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (Guide("json_schema", '{"$ref": "#/$defs/missing"}'), "missing"),
        (Guide("json_schema", '{"type": "string", "pattern": "("}'), "invalid JSON schema: .*unclosed group"),
        (Guide("regex", "a(b"), "invalid regex: .*unclosed group"),
        (Guide("choice", "[]"), "non-empty JSON list of strings"),
        (Guide("choice", '["a", 1]'), "non-empty JSON list of strings"),
        (Guide("choice", "yes"), "invalid choice guide"),
        (Guide("grammar", "start: foo"), "invalid grammar: .*foo"),
        (Guide("grammar", "  "), "invalid grammar: it is empty"),
    ],
)
def test_invalid_guides(compiler, guide, words):
    with pytest.raises(GuideError, match="(?s)" + words) as e:
        validate_guide(guide)
    assert "<state>" not in str(e.value)
    with pytest.raises(GuideError, match="(?s)" + words):
        compiler.matcher(guide)
    assert issubclass(GuideError, ValueError)


def test_valid_guides_pass_validation():
    for g in [
        Guide("json_object"),
        Guide("json_schema", "true"),
        Guide("json_schema", json.dumps(SCHEMAS[0])),
        Guide("regex", r"\w+"),
        Guide("choice", '["a"]'),
        Guide("grammar", 'start: "x"+'),
    ]:
        validate_guide(g)
        assert guide_grammar(g)


def test_cache_compiles_once(tok):
    c = GrammarCompiler(tok, tok.vocab_size, cache_size=2)
    a, b, bad = Guide("json_object"), Guide("regex", "[0-9]+"), Guide("regex", "(")
    c.matcher(a)
    c.matcher(Guide("json_object"))  # an equal guide, another object
    assert c.compiles == 1
    c.matcher(b)
    assert c.compiles == 2
    for _ in range(2):
        with pytest.raises(GuideError):
            c.matcher(bad)
    assert c.compiles == 3  # a failure is cached too
    c.matcher(a)  # evicted by b and bad (LRU of 2)
    assert c.compiles == 4
    # matchers from one compiled guide are independent
    m1, m2 = c.matcher(a), c.matcher(a)
    assert m1.accept(tok.encode("{", add_special_tokens=False)[0])
    assert allowed(m2, c.vocab_size) != allowed(m1, c.vocab_size)


def test_replay_matches_token_by_token(compiler, tok, boost):
    schema = SCHEMAS[14]
    guide = Guide("json_schema", json.dumps(schema))
    _, ids = walk(compiler, tok, guide, seed=3, boost=boost)
    live = compiler.matcher(guide)
    a, b = allocate_bitmask(1, compiler.vocab_size), allocate_bitmask(1, compiler.vocab_size)
    for n, t in enumerate(ids):
        live.fill_bitmask(a, 0)
        compiler.matcher(guide, ids[:n]).fill_bitmask(b, 0)
        assert torch.equal(a, b), f"step {n}"
        assert live.accept(t)
    assert compiler.matcher(guide, ids).is_finished


def test_bitmask_shape_checked(compiler):
    m = compiler.matcher(Guide("json_object"))
    with pytest.raises(ValueError, match="words"):
        m.fill_bitmask(allocate_bitmask(1, compiler.vocab_size - 64), 0)
    with pytest.raises(ValueError, match="int32"):
        m.fill_bitmask(torch.zeros(1, (compiler.vocab_size + 31) // 32), 0)


def test_router_import_needs_no_torch():
    code = (
        "import sys, common.text.grammar as g; g.validate_guide(g.Guide('regex', 'a')); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
