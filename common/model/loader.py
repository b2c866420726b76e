"""One entry point for every weight format: `load_model(path)` picks the loader from the path."""

from __future__ import annotations

import os

import torch

from common.model.llama import LlamaForCausalLM
from common.text.model_info import default_model_path
from common.text.tokenizer import Tokenizer

__all__ = ["default_model_path", "load_model"]


def load_model(
    path: str | None = None, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Load (model, tokenizer) from a .gguf file or an HF folder; None means the default SmolLM2."""
    path = default_model_path() if path is None else path
    # Imported lazily so that importing this module stays cheap for callers that never load a model.
    if os.path.isfile(path) and path.endswith(".gguf"):
        from common.model.gguf_loader import load_gguf

        return load_gguf(path, dtype)
    if os.path.isdir(path):
        from common.model.safetensors_loader import load_safetensors_folder

        return load_safetensors_folder(path, dtype)
    raise ValueError(f"cannot load model from {path!r}: expected a .gguf file or a Hugging Face model folder")
