"""One entry point for every weight format: `load_model(path)` picks the loader from the path (a .gguf
file, a Hugging Face folder, or a hub id found in the local Hugging Face cache)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch

from common.model.llama import LlamaForCausalLM
from common.text.model_info import default_model_path, resolve_model
from common.text.tokenizer import Tokenizer

__all__ = ["default_model_path", "load_model"]
log = logging.getLogger("splitserve.model")


def load_model(
    path: str | None = None, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Load (model, tokenizer) from a .gguf file, an HF folder or a hub id (`org/name`, from the local
    Hugging Face cache only; the model is then named by it); None means the default SmolLM2."""
    source = resolve_model(path)
    path = source.path
    # Imported lazily so that importing this module stays cheap for callers that never load a model.
    load: Callable[[str, torch.dtype], tuple[LlamaForCausalLM, Tokenizer]]
    if os.path.isfile(path) and path.endswith(".gguf"):
        from common.model.gguf_loader import load_gguf

        load = load_gguf
    elif os.path.isdir(path):
        from common.model.safetensors_loader import load_safetensors_folder

        load = load_safetensors_folder
    else:
        raise ValueError(
            f"cannot load model from {path!r}: expected a .gguf file or a Hugging Face model folder"
        )
    log.info("loading model %s ...", path)
    t0 = time.monotonic()
    model, tokenizer = load(path, dtype)
    if source.hub_id is not None:  # not the snapshot folder's name (a commit hash)
        model.config = dataclasses.replace(model.config, model_id=source.hub_id)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info(
        "model loaded: %s, %d layers, %s MB of weights (%s), %.1f s",
        model.config.model_id, model.config.num_layers, f"{weights / 1e6:.{0 if weights >= 1e7 else 2}f}",
        str(dtype).removeprefix("torch."),
        time.monotonic() - t0,
    )  # fmt: skip
    return model, tokenizer
