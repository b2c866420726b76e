"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain torch.

Selective batching: `forward` takes the flattened tokens of every sequence in the step, (T,), and runs
every op except attention on the (T, hidden) matrix; attention alone reads each sequence's own paged KV
(`paged_attention`: the decode rows in one call, each prefill chunk on its own). `dense_forward` is an
independent one-sequence reference with no cache.

Weights are loaded from HF-named tensors (both loaders produce those names); q/k/v and gate/up are
fused into one matmul each at load time, which saves two GEMM launches per layer on small batches.

Tensor parallelism (Megatron-style): built with a `TPRank`, the model holds only its rank's shard,
sliced at load (common/parallel/partition.py says which): fused q/k/v and gate/up are column-parallel
(its query/KV heads, its slice of the intermediate dim), o_proj and down_proj row-parallel with one
all-reduce after each; the embedding and lm_head are vocabulary-parallel (rows of its vocab slice; the
embedding masks ids outside it and all-reduces, the logits are gathered to rank 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.kv.kv_cache import PagedKVCache
from common.model.attention import AttentionMetadata, paged_attention
from common.model.config import ModelConfig, rope_inv_freq
from common.parallel.collective import TPRank

# attn_fn(q (T, nh, hd), k (T, nkv, hd), v (T, nkv, hd), layer) -> (T, nh, hd)
AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

# Up to this many rows, an fp32 matmul on the CPU runs as weight @ x.T (see `linear`).
FEW_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, x (T, in) @ weight (out, in).T -> (T, out), contiguous.

    For 1..FEW_ROWS rows of fp32 on the CPU (a decode step's batch), computed as weight @ x.T and
    transposed back: with the weight as the tall left operand MKL's sgemm splits the work over the
    weight's rows and streams it on every thread, where F.linear's x @ weight.T leaves threads idle
    over a handful of token rows. Measured on SmolLM2-135M, 2 threads: a decode step at batch 4, 8 and
    16 takes 24-35 % less time. The column count is rounded (`_columns`): one row is sent as two (the
    row twice), since a one-column product goes to MKL's sgemv, which streams the weight at about half
    the bandwidth of a two-column sgemm; and 7..32 rows are padded with zero rows to 16, 24 or 32
    columns, since MKL's sgemm is much slower for some column counts than for the next multiple of 8
    (on a 2-core AMD EPYC all 30 layers' matmuls took ~60 ms at 16 columns and 89-109 ms at 13-15; a
    batch-15 decode step went from 203 to 138 ms). A product this narrow waits mostly on memory, so
    the extra columns cost little where a count is not slow. Prefill chunks keep F.linear. The sums
    run in another order, so results differ from F.linear in the last bits.
    """
    rows = x.shape[0] if x.dim() == 2 else 0
    if 0 < rows <= FEW_ROWS and x.dtype == torch.float32 and x.device.type == "cpu":
        cols = _columns(rows)
        if cols == 2 * rows:
            x = torch.cat((x, x))
        elif cols != rows:
            x = torch.cat((x, x.new_zeros(cols - rows, x.shape[1])))
        y = torch.mm(weight, x.t())[:, :rows].t().contiguous()
        return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)


def _columns(rows: int) -> int:
    """How many columns `linear` sends MKL for `rows` token rows (1..FEW_ROWS): 1 as 2, 2-6 as they
    are, 7-16 as 16, 17-32 up to the next multiple of 8."""
    if rows == 1:
        return 2
    if rows <= 6:
        return rows
    return 16 if rows <= 16 else -(-rows // 8) * 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, dim)
        if x.dtype == torch.float32:  # one fused op (the same arithmetic as below, without 6 launches)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Reduce in at least fp32 even for bf16 weights: the mean of squares loses precision otherwise.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # HF convention: the head dim is two halves [x1, x2] -> [-x2, x1] (not interleaved pairs).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, hd); cos, sin: (T, hd)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TPRank | None = None) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        h, hd = cfg.hidden_size, cfg.head_dim
        # this rank's heads and MLP width (all of them without tensor parallelism)
        self.num_heads = len(tp.layout.q_heads) if tp else cfg.num_heads
        self.num_kv_heads = len(tp.layout.kv_heads) if tp else cfg.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        inter = len(tp.layout.intermediate) if tp else cfg.intermediate_size
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, h, bias=False, dtype=dtype)
        self.post_attn_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, h, bias=False, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attn_fn: AttnFn
    ) -> torch.Tensor:  # x: (T, hidden)
        hd = self.cfg.head_dim
        T = x.shape[0]
        qkv = linear(self.input_norm(x), self.qkv_proj.weight, self.qkv_proj.bias)  # (T, q_size + 2 kv_size)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k rotated in one call: the same position per row for every head of both
        qk = apply_rope(qk.view(T, self.num_heads + self.num_kv_heads, hd), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (T, nh, hd), (T, nkv, hd)
        v = v.view(T, self.num_kv_heads, hd)  # (T, nkv, hd)
        attn = attn_fn(q, k, v, layer)  # (T, nh, hd)
        # with TP: this rank's heads' share of the sum
        out = linear(attn.reshape(T, self.q_size), self.o_proj.weight)
        x = x + (out if self.tp is None else self.tp.comm.all_reduce(out))
        gate_up = linear(self.post_attn_norm(x), self.gate_up_proj.weight)
        gate, up = gate_up.chunk(2, dim=-1)  # (T, inter) each
        out = linear(F.silu(gate) * up, self.down_proj.weight)
        return x + (out if self.tp is None else self.tp.comm.all_reduce(out))


class LlamaForCausalLM(nn.Module):
    inv_freq: torch.Tensor  # (hd/2,) fp32 RoPE frequencies, a non-persistent buffer

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TPRank | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp  # None: the whole model; else this rank's shard
        self.scale = config.head_dim**-0.5
        vocab = len(tp.layout.vocab) if tp else config.vocab_size
        # The weight is made here, not by nn.Embedding: its init (normal_) on the meta device, where
        # `empty` builds, imports torch._dynamo, ~3 s of every engine process's start. Initialised (as
        # nn.Embedding would) only when it holds memory.
        embed = torch.empty(vocab, config.hidden_size, dtype=dtype)
        if embed.device.type != "meta":
            nn.init.normal_(embed)
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size, _weight=embed, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Tied models reuse the embedding matrix as the output projection (no second copy).
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False, dtype=dtype)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # (hd/2,) fp32
        self.requires_grad_(False)

    # --- forward paths -----------------------------------------------------------------------------
    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin each (T, hd) in the model dtype; computed once, shared by layers."""
        freqs = positions.to(torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) long, all sequences of the step back to back
        positions: torch.Tensor,  # (T,) long, each token's position within its own sequence
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # (T, hidden), final-normed
        """on_layer_done(i) runs as soon as layer i's K/V are in the cache (before that layer's MLP),
        so a caller can start shipping layer i while the rest of the step computes."""

        def attn_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            out = paged_attention(q, k, v, layer, kv_cache, meta, self.scale)
            if on_layer_done is not None:
                if q.is_cuda:
                    # the layer's K/V writes are queued on the stream; the callback hands their memory
                    # to a transport (NIXL, NCCL) that must see them finished
                    torch.cuda.current_stream(q.device).synchronize()
                on_layer_done(layer)
            return out

        cos, sin = self.rope_cos_sin(positions)
        x = self.embed(input_ids)  # (T, hidden)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, attn_fn)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        if self.tp is None:
            return self.embed_tokens(input_ids)
        # vocabulary-parallel: rows of ids outside this rank's slice are zero here, found on another rank
        vocab = self.tp.layout.vocab
        mine = (input_ids >= vocab.start) & (input_ids < vocab.stop)
        local = torch.where(mine, input_ids - vocab.start, 0)
        x = self.embed_tokens(local).masked_fill_(~mine.unsqueeze(1), 0)
        return self.tp.comm.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, vocab) fp32
        """With tensor parallelism every rank must call this for the same rows; rank 0 gets the whole
        vocabulary, the others their slice's logits."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight).float()
        return logits if self.tp is None else self.tp.comm.gather(logits)

    def dense_forward(self, input_ids: torch.Tensor, seq_lens: list[int] | None = None) -> torch.Tensor:
        """Reference forward with no KV cache: plain causal attention. Used by tests.

        input_ids (T,) holds one sequence, or several back to back with `seq_lens`; then attention is
        block-diagonal causal (each sequence sees only itself) and positions restart per sequence.
        Same rows as the paged step, so the matmuls sum in the same order and fp32 results agree.
        """
        first = self.layers[0]
        assert isinstance(first, DecoderLayer)
        rep = first.num_heads // first.num_kv_heads  # this rank's heads under tensor parallelism
        T = input_ids.shape[0]
        seq_lens = [T] if seq_lens is None else seq_lens
        assert sum(seq_lens) == T, "seq_lens must add up to the number of tokens"
        seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))  # (T,)
        positions = torch.cat([torch.arange(n) for n in seq_lens]).to(input_ids.device)  # (T,)
        idx = torch.arange(T)
        mask = (seq_of[:, None] == seq_of[None, :]) & (idx[None, :] <= idx[:, None])  # (T, T)

        def attn_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, T, hd)
            k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)  # (nh, T, hd)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            return out.transpose(0, 1)  # (T, nh, hd)

        cos, sin = self.rope_cos_sin(positions)
        x = self.embed(input_ids)  # (T, hidden)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, attn_fn)
        return self.compute_logits(self.norm(x))

    # --- weights -----------------------------------------------------------------------------------
    @classmethod
    def empty(
        cls, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TPRank | None = None
    ) -> LlamaForCausalLM:
        """The model with uninitialised weights (no random init: parameters start on the meta device)."""
        with torch.device("meta"):
            model = cls(config, dtype, tp)
        # Each parameter gets CPU memory with torch.empty, not `to_empty`: that one's empty_like on
        # meta tensors runs torch's Python references, importing sympy (~1 s of every start). The
        # inv_freq buffer is already on the CPU (rope_inv_freq).
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False))
        return model.eval()

    @classmethod
    def from_hf_weights(
        cls,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        tp: TPRank | None = None,
    ) -> LlamaForCausalLM:
        """Build and load the weights (with `tp`: only that rank's shard of them)."""
        model = cls.empty(config, dtype, tp)
        model.load_hf_weights(tensors)
        return model

    def shard(self, tp: TPRank) -> LlamaForCausalLM:
        """A new model holding `tp`'s shard of this (whole) model's weights; this one is left as it is."""
        if self.tp is not None:
            raise ValueError("this model is a tensor-parallel shard already")
        return LlamaForCausalLM.from_hf_weights(self.config, self.hf_state_dict(), self.dtype, tp)

    @torch.no_grad()
    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors ("model.layers.0.self_attn.q_proj.weight", ...) in, fusing q/k/v and
        gate/up. Every parameter must be covered exactly once; missing or unknown names raise."""
        todo = dict(tensors)
        hd = self.config.head_dim
        # this rank's heads, MLP and vocabulary slices; None (no tensor parallelism): all of them
        lay = self.tp.layout if self.tp is not None else None
        q_heads, kv_heads = (lay.q_heads, lay.kv_heads) if lay else (None, None)
        inter, vocab = (lay.intermediate, lay.vocab) if lay else (None, None)

        def take(name: str) -> torch.Tensor:
            if name not in todo:
                raise KeyError(f"weight {name!r} missing from checkpoint")
            return todo.pop(name)

        def rows(t: torch.Tensor, r: range | None, unit: int = 1) -> torch.Tensor:  # rows of the slice
            return t if r is None else t[r.start * unit : r.stop * unit]

        def cols(t: torch.Tensor, r: range | None, unit: int = 1) -> torch.Tensor:  # columns of the slice
            return t if r is None else t[:, r.start * unit : r.stop * unit]

        self.embed_tokens.weight.copy_(rows(take("model.embed_tokens.weight"), vocab))
        self.norm.weight.copy_(take("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(rows(take("lm_head.weight"), vocab))
        else:
            todo.pop("lm_head.weight", None)  # some tied checkpoints still store a copy
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            layer.input_norm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attn_norm.weight.copy_(take(p + "post_attention_layernorm.weight"))
            heads = {"q": q_heads, "k": kv_heads, "v": kv_heads}
            qkv = [rows(take(p + f"self_attn.{n}_proj.weight"), heads[n], hd) for n in "qkv"]
            layer.qkv_proj.weight.copy_(torch.cat(qkv, dim=0))
            if layer.qkv_proj.bias is not None:
                bias = [rows(take(p + f"self_attn.{n}_proj.bias"), heads[n], hd) for n in "qkv"]
                layer.qkv_proj.bias.copy_(torch.cat(bias))
            layer.o_proj.weight.copy_(cols(take(p + "self_attn.o_proj.weight"), q_heads, hd))
            gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
            layer.gate_up_proj.weight.copy_(torch.cat([rows(gate, inter), rows(up, inter)], dim=0))
            layer.down_proj.weight.copy_(cols(take(p + "mlp.down_proj.weight"), inter))
        # Rotary inv_freq buffers from old HF checkpoints are derived, not weights.
        unknown = [n for n in todo if not n.endswith("rotary_emb.inv_freq")]
        if unknown:
            raise KeyError(
                f"unexpected weights in checkpoint: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
            )

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The inverse of load_hf_weights: HF-named, un-fused tensors (for export and comparisons)."""
        if self.tp is not None:
            raise ValueError("a tensor-parallel shard holds part of each weight: it has no HF state dict")
        cfg = self.config
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight}
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_norm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attn_norm.weight
            split = [cfg.q_size, cfg.kv_size, cfg.kv_size]
            for n, w in zip("qkv", layer.qkv_proj.weight.split(split), strict=True):
                out[p + f"self_attn.{n}_proj.weight"] = w
            if layer.qkv_proj.bias is not None:
                for n, b in zip("qkv", layer.qkv_proj.bias.split(split), strict=True):
                    out[p + f"self_attn.{n}_proj.bias"] = b
            out[p + "self_attn.o_proj.weight"] = layer.o_proj.weight
            gate, up = layer.gate_up_proj.weight.chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = layer.down_proj.weight
        return {k: v.detach().contiguous() for k, v in out.items()}
