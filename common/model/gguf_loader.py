"""Load a llama.cpp GGUF file: map its metadata to a ModelConfig, and dequantize each tensor straight into
the model's parameters, undoing llama.cpp's layout choices on the way.

Families: llama (and Mistral, which llama.cpp converts as llama), qwen2, gemma2 and gemma3 (the text
model). Tensor types: whatever gguf.quants.dequantize reads, i.e. F32, F16, BF16, Q4_0/Q4_1/Q5_0/Q5_1,
Q8_0, the K-quants (Q2_K..Q6_K) and most IQ types.

Memory: the model is built empty first, and every tensor is read from the file and dequantized a slice
of rows at a time into the parameter that holds it (`_DEST` gives its HF name, `hf_state_dict` maps
that name to the parameter's rows), so the peak while loading is the final weights plus one slice and
the header; no float copy of the whole checkpoint ever exists, and the file is read with pread, not
mapped, so its pages do not stay resident either.

What llama.cpp's converter (convert_hf_to_gguf.py) changed, and we undo or re-derive:

* llama/mistral: Q and K rows permuted per head for its interleaved RoPE (`unpermute_qk`); qwen2 and
  gemma run NEOX-style RoPE there and are stored as HF has them;
* gemma: every RMSNorm weight is stored as 1 + w (llama.cpp's norm multiplies by the weight); ours
  scales by (1 + w) as transformers does, so 1 is subtracted back (exact in fp32);
* gemma2/3 hyper-parameters llama.cpp hard-codes rather than storing (llama-model.cpp): the
  sliding-window pattern (gemma2: every other layer from the first; gemma3: 5 sliding, 1 full), the
  gemma3 sliding layers' RoPE base (10000), the attention scale (1/sqrt(head_dim), or
  1/sqrt(hidden/heads) for the 27B models: 46 layers in gemma2, 62 in gemma3), gemma2's soft-caps
  when the file lacks them (50 and 30).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from common.model.config import ModelConfig, weights_hash
from common.model.llama import LlamaForCausalLM
from common.runtime.logs import progress
from common.text.model_info import GGUFTensorInfo, read_gguf_header
from common.text.tokenizer import Tokenizer

log = logging.getLogger("splitserve.model")

# GGUF architecture -> whether its converter permuted Q/K rows for llama.cpp's interleaved RoPE (which we
# undo). Qwen2 and Gemma are converted without it (llama.cpp runs them in NEOX/half-split mode).
_PERMUTED_QK = {"llama": True, "mistral": True, "qwen2": False, "gemma2": False, "gemma3": False}
_GEMMA = ("gemma2", "gemma3")

# GGUF per-layer tensor name -> HF name suffix (within model.layers.N.)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# gemma2/3: four norms per layer, the MLP's input norm is ffn_norm; gemma3 adds q/k norms
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Values dequantized at once: bounds the float32 scratch (16 MB, and gguf's own temporaries)
_CHUNK_ELEMENTS = 1 << 22


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's permute, which regroups each head's rows from HF's half-split
    rotary layout [x0..x(d/2-1), x(d/2)..] into llama.cpp's interleaved pairs. w: (n_head*hd, ...)."""
    rows = w.shape[0]
    # permute did reshape(n_head, 2, hd/2, rest).swapaxes(1, 2); reading it back as (n_head, hd/2, 2)
    # and swapping again restores the original order.
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(arch: str, gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, None for one that is not a weight (rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None
    names = _GEMMA_LAYER_NAMES if arch in _GEMMA else _LAYER_NAMES
    blk, idx, suffix = (gguf_name.split(".", 2) + ["", ""])[:3]
    if blk != "blk" or not idx.isdigit() or suffix not in names:
        raise ValueError(f"unexpected tensor {gguf_name!r} for a GGUF {arch} model")
    return f"model.layers.{idx}.{names[suffix]}"


def _key(meta: dict[str, Any], arch: str, k: str, default: Any = None) -> Any:
    return meta.get(f"{arch}.{k}", default)


def _gemma_options(
    meta: dict[str, Any], arch: str, n_layers: int, hidden: int, n_head: int, head_dim: int
) -> dict[str, Any]:
    """The ModelConfig fields of gemma2/3 from GGUF metadata plus what llama.cpp hard-codes."""
    window = _key(meta, arch, "attention.sliding_window")
    if arch == "gemma2":
        window = 4096 if window is None else window
        pattern: Any = _key(meta, arch, "attention.sliding_window_pattern", 2)
        big = n_layers == 46  # Gemma 2 27B
    else:
        pattern = _key(meta, arch, "attention.sliding_window_pattern", 6)
        big = n_layers == 62  # Gemma 3 27B
    if window is None:
        raise ValueError(f"GGUF {arch}: {arch}.attention.sliding_window missing")
    if isinstance(pattern, list):  # per layer: true where the layer slides (newer converters)
        slides = [bool(p) for p in pattern]
        if len(slides) != n_layers:
            raise ValueError(
                f"GGUF {arch}: sliding_window_pattern has {len(slides)} entries for {n_layers} layers"
            )
    else:  # llama.cpp's set_swa_pattern(n): the last layer of every n is global
        n = int(pattern)
        slides = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    layer_types = tuple("sliding_attention" if s else "full_attention" for s in slides)
    opts: dict[str, Any] = dict(
        architecture="gemma2" if arch == "gemma2" else "gemma3_text",
        sliding_window=int(window) if any(slides) else None,
        layer_types=None if all(slides) else layer_types,
        norm_offset=True,
        sandwich_norm=True,
        hidden_act="gelu_pytorch_tanh",
        embedding_scale=hidden**0.5,
        query_pre_attn_scalar=float(hidden // n_head if big else head_dim),
    )
    final_cap = _key(meta, arch, "final_logit_softcapping", 30.0 if arch == "gemma2" else None)
    attn_cap = _key(meta, arch, "attn_logit_softcapping", 50.0 if arch == "gemma2" else None)
    if arch == "gemma3":
        if attn_cap is not None:  # neither llama.cpp's gemma3 nor transformers' applies it
            raise ValueError(
                f"GGUF gemma3: gemma3.attn_logit_softcapping={attn_cap}: not applied by gemma3, refused"
            )
        opts["qk_norm"] = True
        # the sliding layers' RoPE: llama.cpp hard-codes base 10000, scale 1 (newer files may say it)
        local = float(_key(meta, arch, "rope.freq_base_swa", 10000.0))
        theta = float(_key(meta, arch, "rope.freq_base", 10000.0))
        opts["rope_local_theta"] = local if local != theta else None
    opts["final_logit_softcapping"] = None if final_cap is None else float(final_cap)
    opts["attn_logit_softcapping"] = None if attn_cap is None else float(attn_cap)
    return opts


def config_from_gguf(
    meta: dict[str, Any], tensors: list[GGUFTensorInfo], path: str, rope_freqs: torch.Tensor | None = None
) -> ModelConfig:
    """The ModelConfig of a GGUF file from its metadata and tensor table (no tensor data read)."""
    arch = meta["general.architecture"]

    def key(k: str, default: Any = None) -> Any:
        return _key(meta, arch, k, default)

    names = {t.name for t in tensors}
    n_head = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    n_layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // n_head)))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{path}: key_length {head_dim} != value_length {key('attention.value_length')}")
    scaling: dict[str, Any] | None = None
    kind = key("rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise ValueError(f"{path}: GGUF rope scaling type {kind!r} is not supported (only linear)")
    if rope_freqs is not None:  # Llama 3.1 style: explicit per-frequency divisors
        scaling = {"rope_type": "freq_factors", "factors": tuple(rope_freqs.tolist())}
    opts = _gemma_options(meta, arch, n_layers, hidden, n_head, head_dim) if arch in _GEMMA else {}
    return ModelConfig(
        vocab_size=int(key("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=n_layers,
        num_heads=n_head,
        num_kv_heads=int(key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        # GGUF stores eps as float32; round-trip through float32 text so 1e-5 stays 1e-5.
        rms_norm_eps=float(f"{float(key('attention.layer_norm_rms_epsilon')):.7g}"),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(),  # set by the caller from the tokenizer
        model_id=os.path.basename(path),
        weights_hash="",  # set by the caller
        attention_bias="blk.0.attn_q.bias" in names,
        **opts,
    )


def _row_chunks(t: GGUFTensorInfo, unit: int) -> Iterator[tuple[int, int, int, int]]:
    """(first row, row count, byte offset, byte count) of slices of tensor `t`, each a multiple of
    `unit` rows (a head, where rows are un-permuted per head) and about _CHUNK_ELEMENTS values."""
    cols = t.shape[0]
    rows = math.prod(t.shape[1:])
    block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    if cols % block:
        raise ValueError(f"tensor {t.name}: rows of {cols} values are not whole {block}-value blocks")
    row_bytes = cols // block * type_bytes
    step = max(unit, _CHUNK_ELEMENTS // max(cols, 1) // unit * unit)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        yield r0, n, t.offset + r0 * row_bytes, n * row_bytes


def _read_into(
    fd: int, t: GGUFTensorInfo, dst: torch.Tensor, unpermute_heads: int = 0, minus: float = 0.0
) -> None:
    """Dequantize tensor `t` from the file into `dst` (its torch shape: rows of shape[0] values), a
    slice of rows at a time; `minus` is subtracted in float32 first (gemma's 1 + w norms).
    `unpermute_heads`: undo llama.cpp's Q/K permutation (that many heads of rows; a bias: of values)."""
    cols = t.shape[0]
    rows = math.prod(t.shape[1:])
    if dst.numel() != rows * cols:
        raise ValueError(f"tensor {t.name} has {rows}x{cols} values, the model expects {tuple(dst.shape)}")
    flat = dst.view(rows, cols)
    vector = len(t.shape) == 1  # a norm or a bias: one row, un-permuted along it
    head_rows = rows // unpermute_heads if unpermute_heads and not vector else 1
    qtype = GGMLQuantizationType(t.ggml_type)
    for r0, n, offset, nbytes in _row_chunks(t, head_rows):
        raw = bytearray(os.pread(fd, nbytes, offset))  # writable: F32 data is dequantized as a view
        if len(raw) != nbytes:
            raise ValueError(f"tensor {t.name}: the file ends inside it (truncated GGUF?)")
        data = np.frombuffer(raw, dtype=np.uint8).reshape(n, nbytes // n)
        values = torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32))
        values = values.reshape(n, cols)
        if minus:
            values -= minus
        if unpermute_heads:
            values = (
                unpermute_qk(values[0], unpermute_heads)[None]
                if vector
                else unpermute_qk(values, n // head_rows)
            )
        flat[r0 : r0 + n].copy_(values)


def load_gguf(path: str, dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, Tokenizer]:
    t0 = time.monotonic()
    header = read_gguf_header(path)
    meta = header.meta
    arch = meta.get("general.architecture")
    if arch not in _PERMUTED_QK:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported ({', '.join(_PERMUTED_QK)}; "
            "other families load from their Hugging Face folder)"
        )
    by_name = {t.name: t for t in header.tensors}
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    log.info("%s: header and tokenizer read, %d tensors, %.1f s", os.path.basename(path), len(header.tensors),
             time.monotonic() - t0)  # fmt: skip
    with open(path, "rb") as f:
        fd = f.fileno()
        rope_freqs = None
        if "rope_freqs.weight" in by_name:
            t = by_name["rope_freqs.weight"]
            rope_freqs = torch.empty(math.prod(t.shape), dtype=torch.float32)
            _read_into(fd, t, rope_freqs)
        config = config_from_gguf(meta, header.tensors, path, rope_freqs)
        config = dataclasses.replace(
            config, eos_token_ids=tokenizer.eos_token_ids, weights_hash=weights_hash([path])
        )
        model = LlamaForCausalLM.empty(config, dtype)
        # HF name -> the rows of a parameter it fills (q/k/v of the fused qkv_proj, ...): views, so each
        # tensor lands in place. Every one must be written exactly once.
        dests = model.hf_state_dict()
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        todo = set(dests)
        n_head, n_kv = config.num_heads, config.num_kv_heads
        for t in progress(header.tensors, f"dequantizing {os.path.basename(path)}", logger=log):
            name = _hf_name(arch, t.name)
            if name is None:
                continue
            if name not in dests:
                raise ValueError(f"{path}: tensor {t.name!r} ({name}) has no place in the model")
            if name not in todo:
                raise ValueError(f"{path}: tensor {t.name!r} appears twice")
            dst = dests[name]
            if dst.untyped_storage().data_ptr() not in storages:  # hf_state_dict made a copy
                raise RuntimeError(f"internal: {name} is not a view of a parameter")
            heads = 0
            if _PERMUTED_QK[arch] and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                heads = n_head
            elif _PERMUTED_QK[arch] and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                heads = n_kv
            # gemma's norms are stored as 1 + w (subtracted in float32, before any cast to dtype)
            _read_into(
                fd, t, dst, heads, minus=1.0 if arch in _GEMMA and t.name.endswith("norm.weight") else 0.0
            )
            todo.discard(name)
    if todo:
        missing = sorted(todo)
        raise ValueError(f"{path}: weights missing from the GGUF: {missing[:5]}{' ...' * (len(missing) > 5)}")
    return model, tokenizer
