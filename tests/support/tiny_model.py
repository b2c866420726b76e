"""A tiny random-weight Llama with SmolLM2's tokenizer, made once per machine (38 MB, a few seconds).

Tests of protocol, routing, faults, auth and scheduling run real services on it: the services load it in
well under a second where the real SmolLM2 takes 10+ s, and each step is milliseconds. Tests whose point
is the text or parity with transformers load the real model (`real_model_path()`, the `smollm` fixture).

The weights are seeded, so every run and every pytest-xdist worker makes the same bytes, and greedy
output is deterministic: a split run must reproduce the one-process run token for token, as with the
real model. The output is gibberish, but varied gibberish (the weights are scaled so that greedy decoding
does not settle on one repeated token), so a token lost or repeated by a migration changes the text.
Nearly all of the 38 MB is the 49,152-token vocabulary's embedding and output projection.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import torch

from common.model.config import ModelConfig
from common.model.hf_export import export_hf_folder
from common.model.llama import LlamaForCausalLM
from common.text.model_info import default_model_path, load_model_info

# SmolLM2's head ratio (9 query heads : 3 KV heads is 3:1; here 6:3 = 2:1 keeps 3 KV heads, so the tensor
# parallel tests' head splits over 1, 2 or 3 ranks and their refusals read the same as on the real model).
SHAPE = {
    "hidden_size": 96,  # transformers wants num_heads * head_dim
    "intermediate_size": 128,
    "num_layers": 4,
    "num_heads": 6,
    "num_kv_heads": 3,
    "head_dim": 16,
}
SEED = 1234
VERSION = 1  # bump when the recipe changes: the folder name carries it, so no stale copy is reused
NAME = f"tiny-random-llama-v{VERSION}"


def real_model_path() -> str:
    """The real SmolLM2-135M-Instruct GGUF (tests whose point is the text or parity)."""
    return default_model_path()


def build(out: Path) -> Path:
    """Write the tiny model's HF folder (config.json, model.safetensors, tokenizer files) to `out`."""
    tokenizer = load_model_info(real_model_path()).tokenizer  # GGUF metadata only: no weights read
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        **SHAPE,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        model_id=NAME,
        weights_hash="",  # the loader hashes the files it reads
    )
    gen = torch.Generator().manual_seed(SEED)
    model = LlamaForCausalLM.empty(config)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() == 1:
            p.zero_()
        else:
            # Fan-in scaling keeps activations O(1). The output projection is wider (logits ~ N(0, 4^2)),
            # so a distribution has a clear favourite and a tail, like a trained model's: greedy
            # decoding is stable against rounding, and temperature and top-k visibly reshape it. Untied:
            # with the embedding as output projection, greedy decoding repeats the last token forever.
            fan_in = p.shape[1] ** -0.5
            std = 1.0 if "embed" in name else 4 * fan_in if "lm_head" in name else fan_in
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return export_hf_folder(model, tokenizer, out)


def tiny_model_path() -> str:
    """The tiny model's folder, built on first use and shared by every test process of this machine.

    It lives under the temp dir keyed by the recipe's version; a lock makes concurrent first uses
    (pytest-xdist workers) build it once, and the folder appears whole (written aside, then renamed).
    """
    root = Path(os.environ.get("SPLITSERVE_TEST_CACHE") or tempfile.gettempdir()) / "splitserve-tests"
    root.mkdir(parents=True, exist_ok=True)
    folder = root / NAME
    with open(root / f"{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "model.safetensors").exists():
            scratch = Path(tempfile.mkdtemp(dir=root, prefix=f".{NAME}-"))
            build(scratch)
            os.replace(scratch, folder)
    return str(folder)
