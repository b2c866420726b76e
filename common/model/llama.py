"""The decoder-only transformer of every family we serve, in plain torch: one definition, the families'
quirks switched on by ModelConfig's options (common/model/config.py; docs/models.md lists them):

* llama, mistral, qwen2: the base (pre-norm, SiLU-gated MLP, RoPE, grouped-query attention; qwen2 with
  q/k/v biases; mistral with a sliding window on every layer);
* qwen3: an RMSNorm over each head's q and k before RoPE (`qk_norm`);
* phi3: as llama; its fused qkv_proj and gate_up_proj are split into q/k/v and gate/up at load;
* gemma2, gemma3: (1 + w) RMSNorms (`norm_offset`), norms on the attention and MLP outputs and before the
  MLP (`sandwich_norm`), embeddings scaled by sqrt(hidden), the attention scale from
  query_pre_attn_scalar, GELU (tanh) gating, sliding and full layers interleaved (`layer_types`, each
  kind with its own RoPE base in gemma3), soft-capped attention scores (gemma2) and logits;
* mixtral, qwen3_moe: a mixture of experts in place of the MLP (router softmax -> top-k, tokens sorted by
  expert so each expert runs one matmul over all its tokens of the step);
* deepseek_v2, deepseek_v3: multi-head latent attention (common/model/mla.py: the compressed latent is
  what the paged cache holds) in place of q/k/v, and DeepSeek's MoE (the same experts, plus shared
  experts every token goes through, routed weights scaled; V2's softmax routing, greedy or limited to
  the best groups, V3's sigmoid routing with its correction bias and groups) after the first dense
  layers.

Selective batching: `forward` takes the flattened tokens of every sequence in the step, (T,), and runs
every op except attention on the (T, hidden) matrix; attention alone reads each sequence's own paged KV
(`paged_attention`: the decode rows in one call, each prefill chunk on its own). `dense_forward` is an
independent one-sequence reference with no cache.

Weights are loaded from HF-named tensors (both loaders produce those names); q/k/v and gate/up are
fused into one matmul each at load time, which saves two GEMM launches per layer on small batches.
Families that store other names (phi3's fused projections, mixtral's w1/w2/w3 experts) are renamed to
these first (`canonical_hf_names`).

Tensor parallelism (Megatron-style): built with a `TPRank`, the model holds only its rank's shard,
sliced at load (common/parallel/partition.py says which): fused q/k/v and gate/up are column-parallel
(its query/KV heads, its slice of the intermediate dim), o_proj and down_proj row-parallel with one
all-reduce after each; the embedding and lm_head are vocabulary-parallel (rows of its vocab slice; the
embedding masks ids outside it and all-reduces, the logits are gathered to rank 0). The per-head and
elementwise options (q/k norms, windows, soft-caps, sandwich norms, embedding scale) need nothing more.
A mixture of experts shards each expert as the dense MLP: every rank holds every expert's slice of
moe_intermediate_size (column-parallel gate/up, row-parallel down) and the full router, so each rank
routes the same tokens to the same experts and one all-reduce sums the experts' partial outputs
(DeepSeek's shared experts are split as the dense MLP). MLA splits the query heads (their rows of the
query and kv_b projections, their columns of o_proj) and keeps the whole latent projection on every
rank: every rank caches the same latent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.kv.kv_cache import PagedKVCache
from common.model.attention import AttentionMetadata, attend, paged_attention
from common.model.config import ModelConfig, rope_attention_scaling, rope_inv_freq
from common.model.mla import MLAttention, mla_paged_attention
from common.parallel.collective import TPRank
from common.parallel.partition import even_split

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
    """RMSNorm over the last dim; with `offset` (gemma) it scales by (1 + weight), computed in fp32 and
    cast back, as transformers' GemmaRMSNorm (whose weight starts at 0)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, offset: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        init = torch.zeros(dim, dtype=dtype) if offset else torch.ones(dim, dtype=dtype)
        self.weight = nn.Parameter(init, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim)
        if self.offset:
            xf = x.to(torch.promote_types(x.dtype, torch.float32))
            w = 1.0 + self.weight.to(xf.dtype)
            return F.rms_norm(xf, self.weight.shape, w, self.eps).to(x.dtype)
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


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated MLP's activation by its HF name (ModelConfig.hidden_act)."""
    if name == "silu":
        return F.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"activation {name!r} is not implemented")


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (gemma's soft-capping); x itself when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class MoE(nn.Module):
    """A mixture of gated-MLP experts (mixtral, qwen3_moe): the router's softmax picks each token's top k
    experts, whose outputs are summed with those probabilities (renormalised to sum 1 with
    norm_topk_prob).

    Batched dispatch: the step's (token, expert) pairs are sorted by expert, so each expert hit runs one
    matmul over all of its tokens (a loop over experts, never over tokens), and the weighted results are
    summed back into their tokens with one index_add.

    DeepSeek (`ModelConfig.router`, `select`): the routers of transformers' DeepseekV2/V3 (V2: softmax,
    top-k over all experts or over the topk_group groups holding the best; V3: sigmoid, the choice made
    on scores + e_score_correction_bias within the topk_group groups whose two best sum highest, the
    weights the plain scores, renormalised), the weights times routed_scaling_factor; and shared
    experts, one gated MLP every token goes through, added to the routed experts' sum.

    With tensor parallelism, `inter` is this rank's slice of every expert (`tp_slice`; the shared
    experts' `shared_tp_slice`): the output is the rank's partial sum, which the layer all-reduces as
    after the dense MLP."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TPRank | None = None) -> None:
        super().__init__()
        self.inter_slice = MoE.tp_slice(cfg, tp)
        e, h = cfg.num_experts, cfg.hidden_size
        inter = cfg.moe_intermediate_size if self.inter_slice is None else len(self.inter_slice)
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.act = activation(cfg.hidden_act)
        self.router = nn.Parameter(torch.empty(e, h, dtype=dtype), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * inter, h, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, inter, dtype=dtype), requires_grad=False)
        # DeepSeek: the router kind, its groups, the routed weights' scale, the shared experts
        self.kind, self.scale = cfg.router, cfg.routed_scaling_factor
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        # noaux_tc's e_score_correction_bias: added to the scores for the choice only (fp32, as HF's)
        self.bias: nn.Parameter | None = None
        if cfg.router == "noaux_tc":
            self.bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
        self.shared_slice = MoE.shared_tp_slice(cfg, tp)
        self.shared_gate_up: nn.Parameter | None = None
        self.shared_down: nn.Parameter | None = None
        if cfg.n_shared_experts:
            si = cfg.n_shared_experts * cfg.moe_intermediate_size
            si = si if self.shared_slice is None else len(self.shared_slice)
            self.shared_gate_up = nn.Parameter(torch.empty(2 * si, h, dtype=dtype), requires_grad=False)
            self.shared_down = nn.Parameter(torch.empty(h, si, dtype=dtype), requires_grad=False)

    @staticmethod
    def tp_slice(cfg: ModelConfig, tp: TPRank | None) -> range | None:
        """This rank's slice of each expert's intermediate dim (None: all of it, no TP)."""
        if tp is None:
            return None
        return even_split(cfg.moe_intermediate_size, tp.layout.size, "moe_intermediate_size")[tp.layout.rank]

    @staticmethod
    def shared_tp_slice(cfg: ModelConfig, tp: TPRank | None) -> range | None:
        """This rank's slice of the shared experts' intermediate dim (None: all of it, no TP)."""
        if tp is None or not cfg.n_shared_experts:
            return None
        si = cfg.n_shared_experts * cfg.moe_intermediate_size
        return even_split(si, tp.layout.size, "n_shared_experts * moe_intermediate_size")[tp.layout.rank]

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, (T, k) each, as transformers' routers pick them."""
        if self.kind == "softmax":
            probs = torch.softmax(linear(x, self.router), dim=-1, dtype=torch.float32)  # (T, E)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k) each
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights * self.scale if self.scale != 1.0 else weights, experts
        logits = linear(x.float(), self.router.float())  # (T, E): DeepSeek routes in fp32
        groups = (logits.shape[0], self.n_group, logits.shape[1] // self.n_group)
        if self.kind == "group_limited_greedy":  # deepseek_v2: softmax; the groups of the best experts
            scores = logits.softmax(dim=-1)
            group_scores = scores.view(groups).amax(dim=-1)  # (T, n_group)
            masked = 0.0
            choice = scores
        else:  # noaux_tc (deepseek_v3): sigmoid; the bias steers the choice, not the weights
            assert self.bias is not None
            scores = logits.sigmoid()
            choice = scores + self.bias
            group_scores = choice.view(groups).topk(2, dim=-1)[0].sum(dim=-1)
            masked = float("-inf")
        top_groups = torch.topk(group_scores, self.topk_group, dim=-1)[1]  # (T, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        keep = keep.unsqueeze(-1).expand(groups).reshape(choice.shape)
        experts = torch.topk(choice.masked_fill(~keep, masked), self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.normalize and self.kind == "noaux_tc":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden)
        weights, experts = self.select(x)
        flat = experts.flatten()  # (T * k,): pair j is token j // k's choice j % k
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k  # the pairs' tokens, grouped by expert
        counts = torch.bincount(flat, minlength=self.router.shape[0]).tolist()
        xs = x[token]  # (T * k, hidden)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = linear(xs[start : start + n], self.gate_up[e]).chunk(2, dim=-1)
                ys[start : start + n] = linear(self.act(gate) * up, self.down[e])
                start += n
        ys *= weights.flatten()[order].to(ys.dtype).unsqueeze(1)
        out = torch.zeros_like(x).index_add_(0, token, ys)
        if self.shared_gate_up is not None and self.shared_down is not None:
            gate, up = linear(x, self.shared_gate_up).chunk(2, dim=-1)
            out += linear(self.act(gate) * up, self.shared_down)
        return out


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, tp: TPRank | None = None, index: int = 0
    ) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        h, hd = cfg.hidden_size, cfg.head_dim
        # this rank's heads and MLP width (all of them without tensor parallelism)
        self.num_heads = len(tp.layout.q_heads) if tp else cfg.num_heads
        self.num_kv_heads = len(tp.layout.kv_heads) if tp else cfg.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        inter = len(tp.layout.intermediate) if tp else cfg.intermediate_size
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        self.input_norm = RMSNorm(h, eps, dtype, off)
        # the attention: latent (MLA, deepseek) or multi-head/grouped-query
        self.mla: MLAttention | None = None
        if cfg.is_mla:
            self.mla = MLAttention(cfg, dtype, tp)
        else:
            bias = cfg.attention_bias
            self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=bias, dtype=dtype)
            self.o_proj = nn.Linear(self.q_size, h, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(hd, eps, dtype, off) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, eps, dtype, off) if cfg.qk_norm else None
        # HF's post_attention_layernorm: the MLP's input norm, or (sandwich) the attention output's norm
        self.post_attn_norm = RMSNorm(h, eps, dtype, off)
        self.pre_ffn_norm = RMSNorm(h, eps, dtype, off) if cfg.sandwich_norm else None
        self.post_ffn_norm = RMSNorm(h, eps, dtype, off) if cfg.sandwich_norm else None
        self.act = activation(cfg.hidden_act)
        self.moe = MoE(cfg, dtype, tp) if cfg.is_moe(index) else None
        if self.moe is None:
            self.gate_up_proj = nn.Linear(h, 2 * inter, bias=False, dtype=dtype)
            self.down_proj = nn.Linear(inter, h, bias=False, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attn_fn: AttnFn
    ) -> torch.Tensor:  # x: (T, hidden)
        if self.mla is not None:
            out = self._reduce(self.mla(self.input_norm(x), cos, sin, layer, attn_fn))
        else:
            out = self._attention(x, cos, sin, layer, attn_fn)
        if self.pre_ffn_norm is not None:  # gemma's sandwich: normed attention output, normed MLP input
            x = x + self.post_attn_norm(out)
            h = self.pre_ffn_norm(x)
        else:
            x = x + out
            h = self.post_attn_norm(x)
        if self.moe is not None:
            out = self._reduce(self.moe(h))
        else:
            gate, up = linear(h, self.gate_up_proj.weight).chunk(2, dim=-1)  # (T, inter) each
            out = self._reduce(linear(self.act(gate) * up, self.down_proj.weight))
        if self.post_ffn_norm is not None:
            out = self.post_ffn_norm(out)
        return x + out

    def _attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attn_fn: AttnFn
    ) -> torch.Tensor:  # x: (T, hidden) -> (T, hidden), the attention's output (summed over ranks)
        hd = self.cfg.head_dim
        T = x.shape[0]
        qkv = linear(self.input_norm(x), self.qkv_proj.weight, self.qkv_proj.bias)  # (T, q_size + 2 kv_size)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(T, self.num_heads + self.num_kv_heads, hd)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before RoPE
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k rotated in one call: the same position per row for every head of both
        qk = apply_rope(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (T, nh, hd), (T, nkv, hd)
        v = v.view(T, self.num_kv_heads, hd)  # (T, nkv, hd)
        attn = attn_fn(q, k, v, layer)  # (T, nh, hd)
        # with TP: this rank's heads' share of the sum
        return self._reduce(linear(attn.reshape(T, self.q_size), self.o_proj.weight))

    def norms(self) -> dict[RMSNorm, str]:
        """This layer's norms and their HF names (within the layer)."""
        names: dict[RMSNorm, str] = {
            self.input_norm: "input_layernorm.weight",
            self.post_attn_norm: "post_attention_layernorm.weight",
        }
        if self.q_norm is not None and self.k_norm is not None:
            names[self.q_norm], names[self.k_norm] = "self_attn.q_norm.weight", "self_attn.k_norm.weight"
        if self.mla is not None:
            names[self.mla.kv_a_norm] = "self_attn.kv_a_layernorm.weight"
            if self.mla.q_a_norm is not None:
                names[self.mla.q_a_norm] = "self_attn.q_a_layernorm.weight"
        if self.pre_ffn_norm is not None and self.post_ffn_norm is not None:
            names[self.pre_ffn_norm] = "pre_feedforward_layernorm.weight"
            names[self.post_ffn_norm] = "post_feedforward_layernorm.weight"
        return names

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        """A row-parallel product's partial sums, summed over the ranks (as it is without TP)."""
        return out if self.tp is None else self.tp.comm.all_reduce(out)


class LlamaForCausalLM(nn.Module):
    """The decoder-only model of every supported family (the name is the first family's)."""

    inv_freq: torch.Tensor  # (hd/2,) fp32 RoPE frequencies, a non-persistent buffer
    inv_freq_local: torch.Tensor | None  # the sliding layers' own, where they differ (gemma3)

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TPRank | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp  # None: the whole model; else this rank's shard
        self.scale = config.attn_scale
        self.windows = [config.window(i) for i in range(config.num_layers)]
        # the embedding scale rounded to the model dtype first, as transformers does (gemma)
        self.embed_scale: float | None = None
        if config.embedding_scale is not None:
            self.embed_scale = torch.tensor(config.embedding_scale, device="cpu").to(dtype).item()
        vocab = len(tp.layout.vocab) if tp else config.vocab_size
        # The weight is made here, not by nn.Embedding: its init (normal_) on the meta device, where
        # `empty` builds, imports torch._dynamo, ~3 s of every engine process's start. Initialised (as
        # nn.Embedding would) only when it holds memory.
        embed = torch.empty(vocab, config.hidden_size, dtype=dtype)
        if embed.device.type != "meta":
            nn.init.normal_(embed)
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size, _weight=embed, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, tp, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, config.norm_offset)
        # Tied models reuse the embedding matrix as the output projection (no second copy).
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False, dtype=dtype)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # (hd/2,) fp32
        local = rope_inv_freq(config, local=True) if config.rope_local_theta is not None else None
        self.register_buffer("inv_freq_local", local, persistent=False)
        self.rope_scale = (rope_attention_scaling(config), rope_attention_scaling(config, local=True))  # YaRN
        self.requires_grad_(False)

    # --- forward paths -----------------------------------------------------------------------------
    def rope_cos_sin(self, positions: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin each (T, hd) in the model dtype; computed once, shared by layers.
        `local`: with the sliding layers' frequencies (where the model has its own for them)."""
        inv = self.inv_freq_local if local and self.inv_freq_local is not None else self.inv_freq
        local = inv is self.inv_freq_local
        freqs = positions.to(torch.float32).unsqueeze(1) * inv.unsqueeze(0)  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        scale = self.rope_scale[int(local)]
        if scale != 1.0:
            return (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_fn: AttnFn) -> torch.Tensor:
        """Embedding and every layer (attention by attn_fn); (T,) ids -> (T, hidden), not final-normed."""
        rope = self.rope_cos_sin(positions)
        local = rope if self.inv_freq_local is None else self.rope_cos_sin(positions, local=True)
        x = self.embed(input_ids)  # (T, hidden)
        for i, layer in enumerate(self.layers):
            cos, sin = local if self.config.is_sliding(i) else rope
            x = layer(x, cos, sin, i, attn_fn)
        return x

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
        cap = self.config.attn_logit_softcapping

        def attn_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            kv_cache.before_layer(layer)  # a tier hit's blocks of this layer in (common/kv/layer_loads.py)
            if self.config.is_mla:  # k: the latents (T, 1, rank + rope), v: a view of their first `rank`
                out = mla_paged_attention(q, k[:, 0], v.shape[-1], layer, kv_cache, meta, self.scale)
            else:
                out = paged_attention(q, k, v, layer, kv_cache, meta, self.scale, self.windows[layer], cap)
            if on_layer_done is not None:
                if q.is_cuda:
                    # the layer's K/V writes are queued on the stream; the callback hands their memory
                    # to a transport (NIXL, NCCL) that must see them finished
                    torch.cuda.current_stream(q.device).synchronize()
                on_layer_done(layer)
            return out

        return self.norm(self.run_layers(input_ids, positions, attn_fn))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        if self.tp is None:
            x = self.embed_tokens(input_ids)
        else:
            # vocabulary-parallel: rows of ids outside this rank's slice are zero here, found on another rank
            vocab = self.tp.layout.vocab
            mine = (input_ids >= vocab.start) & (input_ids < vocab.stop)
            local = torch.where(mine, input_ids - vocab.start, 0)
            x = self.tp.comm.all_reduce(self.embed_tokens(local).masked_fill_(~mine.unsqueeze(1), 0))
        return x if self.embed_scale is None else x * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, vocab) fp32
        """With tensor parallelism every rank must call this for the same rows; rank 0 gets the whole
        vocabulary, the others their slice's logits."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = softcap(linear(hidden, weight), self.config.final_logit_softcapping).float()
        return logits if self.tp is None else self.tp.comm.gather(logits)

    def dense_attention(self, seq_lens: list[int], device: torch.device | None = None) -> AttnFn:
        """Attention with no KV cache over sequences of `seq_lens` tokens back to back: block-diagonal
        causal (each sequence sees only itself), each layer's window and soft-cap applied."""
        T = sum(seq_lens)
        seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))  # (T,)
        pos = torch.cat([torch.arange(n) for n in seq_lens])  # (T,)
        idx = torch.arange(T)
        causal = (seq_of[:, None] == seq_of[None, :]) & (idx[None, :] <= idx[:, None])  # (T, T)
        masks: dict[int | None, torch.Tensor] = {}
        for w in set(self.windows):
            mask = causal if w is None else causal & (pos[None, :] > pos[:, None] - w)
            masks[w] = mask.to(device)
        cap = self.config.attn_logit_softcapping

        def attn_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, T, hd)
            out = attend(q, k, v, masks[self.windows[layer]], self.scale, cap)
            return out.transpose(0, 1)  # (T, nh, hd)

        return attn_fn

    def dense_forward(self, input_ids: torch.Tensor, seq_lens: list[int] | None = None) -> torch.Tensor:
        """Reference forward with no KV cache: plain causal attention. Used by tests.

        input_ids (T,) holds one sequence, or several back to back with `seq_lens`; then attention is
        block-diagonal causal (each sequence sees only itself) and positions restart per sequence.
        Same rows as the paged step, so the matmuls sum in the same order and fp32 results agree.
        """
        T = input_ids.shape[0]
        seq_lens = [T] if seq_lens is None else seq_lens
        assert sum(seq_lens) == T, "seq_lens must add up to the number of tokens"
        positions = torch.cat([torch.arange(n) for n in seq_lens]).to(input_ids.device)  # (T,)
        attn_fn = self.dense_attention(seq_lens, input_ids.device)
        return self.compute_logits(self.norm(self.run_layers(input_ids, positions, attn_fn)))

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
        # inv_freq buffers are already on the CPU (rope_inv_freq).
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
        return type(self).from_hf_weights(self.config, self.hf_state_dict(), self.dtype, tp)

    @torch.no_grad()
    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors ("model.layers.0.self_attn.q_proj.weight", ...) in, fusing q/k/v and
        gate/up. Every parameter must be covered exactly once; missing or unknown names raise."""
        cfg = self.config
        todo = canonical_hf_names(tensors, cfg)
        hd = cfg.head_dim
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

        def copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
            if dst.shape != src.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src)

        self.embed_tokens.weight.copy_(rows(take("model.embed_tokens.weight"), vocab))
        self.norm.weight.copy_(take("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(rows(take("lm_head.weight"), vocab))
        else:
            todo.pop("lm_head.weight", None)  # some tied checkpoints still store a copy
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            for norm, name in layer.norms().items():
                copy(norm.weight, take(p + name), p + name)
            if layer.mla is not None:  # this rank's query heads' rows and columns, the whole latent's
                a, qk, kv = layer.mla, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, p + "self_attn."
                for dst, name, unit in ((a.q_proj, "q_proj", qk), (a.q_b_proj, "q_b_proj", qk)):
                    if dst is not None:
                        copy(dst, rows(take(kv + name + ".weight"), q_heads, unit), kv + name + ".weight")
                if a.q_a_proj is not None:
                    copy(a.q_a_proj, take(kv + "q_a_proj.weight"), kv + "q_a_proj.weight")
                name = kv + "kv_a_proj_with_mqa.weight"
                copy(a.kv_a_proj, take(name), name)
                unit = cfg.qk_nope_head_dim + cfg.v_head_dim
                for dst, name, r in ((a.kv_b_proj, "kv_b_proj", rows), (a.o_proj, "o_proj", cols)):
                    size = unit if name == "kv_b_proj" else cfg.v_head_dim  # kv_b: rows; o: columns
                    copy(dst, r(take(kv + name + ".weight"), q_heads, size), kv + name + ".weight")
            else:
                heads = {"q": q_heads, "k": kv_heads, "v": kv_heads}
                qkv = [rows(take(p + f"self_attn.{n}_proj.weight"), heads[n], hd) for n in "qkv"]
                copy(layer.qkv_proj.weight, torch.cat(qkv, dim=0), p + "self_attn.qkv_proj.weight")
                if layer.qkv_proj.bias is not None:
                    bias = [rows(take(p + f"self_attn.{n}_proj.bias"), heads[n], hd) for n in "qkv"]
                    layer.qkv_proj.bias.copy_(torch.cat(bias))
                layer.o_proj.weight.copy_(cols(take(p + "self_attn.o_proj.weight"), q_heads, hd))
            if layer.moe is not None:
                copy(layer.moe.router, take(p + "mlp.gate.weight"), p + "mlp.gate.weight")
                if layer.moe.bias is not None:
                    name = p + "mlp.gate.e_score_correction_bias"
                    copy(layer.moe.bias, take(name), name)
                shared_gate_up, shared_down = layer.moe.shared_gate_up, layer.moe.shared_down
                if shared_gate_up is not None and shared_down is not None:
                    sh, ss = p + "mlp.shared_experts.", layer.moe.shared_slice
                    halves = [rows(take(sh + f"{n}_proj.weight"), ss) for n in ("gate", "up")]
                    copy(shared_gate_up, torch.cat(halves), sh + "gate_up_proj.weight")
                    copy(shared_down, cols(take(sh + "down_proj.weight"), ss), sh + "down_proj.weight")
                gu, s = take(p + "mlp.experts.gate_up_proj"), layer.moe.inter_slice  # (E, 2 * inter, h)
                if s is not None:  # this rank's rows of the gate half and of the up half
                    half = gu.shape[1] // 2
                    gu = torch.cat((gu[:, s.start : s.stop], gu[:, half + s.start : half + s.stop]), dim=1)
                copy(layer.moe.gate_up, gu, p + "mlp.experts.gate_up_proj")
                down = take(p + "mlp.experts.down_proj")  # (E, h, inter): this rank's columns
                copy(
                    layer.moe.down,
                    down if s is None else down[:, :, s.start : s.stop],
                    p + "mlp.experts.down_proj",
                )
                continue
            gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
            gate_up = torch.cat([rows(gate, inter), rows(up, inter)], dim=0)
            copy(layer.gate_up_proj.weight, gate_up, p + "mlp.gate_up_proj.weight")
            layer.down_proj.weight.copy_(cols(take(p + "mlp.down_proj.weight"), inter))
        # Rotary inv_freq buffers from old HF checkpoints are derived, not weights.
        unknown = [n for n in todo if not n.endswith("rotary_emb.inv_freq")]
        if unknown:
            raise KeyError(
                f"unexpected weights in checkpoint: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
            )

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The inverse of load_hf_weights: HF-named, un-fused tensors (for export and comparisons), in
        the canonical names (`canonical_hf_names`): q/k/v and gate/up apart, experts stacked."""
        if self.tp is not None:
            raise ValueError("a tensor-parallel shard holds part of each weight: it has no HF state dict")
        cfg = self.config
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight}
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            for norm, name in layer.norms().items():
                out[p + name] = norm.weight
            if layer.mla is not None:
                a, kv = layer.mla, p + "self_attn."
                for name, w in (("q_proj", a.q_proj), ("q_a_proj", a.q_a_proj), ("q_b_proj", a.q_b_proj)):
                    if w is not None:
                        out[kv + name + ".weight"] = w
                out[kv + "kv_a_proj_with_mqa.weight"] = a.kv_a_proj
                out[kv + "kv_b_proj.weight"] = a.kv_b_proj
                out[kv + "o_proj.weight"] = a.o_proj
            else:
                split = [cfg.q_size, cfg.kv_size, cfg.kv_size]
                for n, w in zip("qkv", layer.qkv_proj.weight.split(split), strict=True):
                    out[p + f"self_attn.{n}_proj.weight"] = w
                if layer.qkv_proj.bias is not None:
                    for n, b in zip("qkv", layer.qkv_proj.bias.split(split), strict=True):
                        out[p + f"self_attn.{n}_proj.bias"] = b
                out[p + "self_attn.o_proj.weight"] = layer.o_proj.weight
            if layer.moe is not None:
                out[p + "mlp.gate.weight"] = layer.moe.router
                if layer.moe.bias is not None:
                    out[p + "mlp.gate.e_score_correction_bias"] = layer.moe.bias
                if layer.moe.shared_gate_up is not None and layer.moe.shared_down is not None:
                    sh, shared = p + "mlp.shared_experts.", layer.moe.shared_gate_up
                    out[sh + "gate_proj.weight"], out[sh + "up_proj.weight"] = shared.chunk(2)
                    out[sh + "down_proj.weight"] = layer.moe.shared_down
                out[p + "mlp.experts.gate_up_proj"] = layer.moe.gate_up
                out[p + "mlp.experts.down_proj"] = layer.moe.down
                continue
            gate, up = layer.gate_up_proj.weight.chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = layer.down_proj.weight
        return {k: v.detach().contiguous() for k, v in out.items()}


def canonical_hf_names(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A copy of `tensors` with the families' own layouts renamed to the one `load_hf_weights` reads:

    * phi3's fused `self_attn.qkv_proj` and `mlp.gate_up_proj` split into q/k/v_proj and gate/up_proj;
    * mixtral's `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down),
      and qwen3_moe's `mlp.experts.{e}.gate_proj/up_proj/down_proj`, stacked into
      `mlp.experts.gate_up_proj` (E, 2 * inter, hidden) and `mlp.experts.down_proj` (E, hidden, inter),
      as transformers 5 holds them (which is also accepted as it is), with the router as `mlp.gate`.
    """
    out = dict(tensors)
    if cfg.architecture == "deepseek_v3":  # the multi-token-prediction layers after the last (unused)
        extra = tuple(f"model.layers.{i}." for i in range(cfg.num_layers, cfg.num_layers + 8))
        for name in [n for n in out if n.startswith(extra)]:
            del out[name]
    for name in [n for n in out if n.endswith("self_attn.qkv_proj.weight")]:
        p = name.removesuffix("qkv_proj.weight")
        q, k, v = out.pop(name).split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        out[p + "q_proj.weight"], out[p + "k_proj.weight"], out[p + "v_proj.weight"] = q, k, v
    for name in [n for n in out if n.endswith("mlp.gate_up_proj.weight")]:
        p = name.removesuffix("gate_up_proj.weight")
        out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = out.pop(name).chunk(2)
    for name in [n for n in out if ".block_sparse_moe." in n]:
        new = name.replace(".block_sparse_moe.", ".mlp.")
        for old, hf in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
            if ".experts." in new:
                new = new.replace(old, hf)
        out[new] = out.pop(name)
    if cfg.num_experts:
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}.mlp.experts."
            per = [f"{p}{e}.{n}_proj.weight" for e in range(cfg.num_experts) for n in ("gate", "up", "down")]
            if not any(n in out for n in per):
                continue
            missing = [n for n in per if n not in out]
            if missing:
                raise KeyError(f"expert weights missing from checkpoint: {missing[:3]}")
            gate_up, down = [], []
            for e in range(cfg.num_experts):
                gate, up = out.pop(f"{p}{e}.gate_proj.weight"), out.pop(f"{p}{e}.up_proj.weight")
                gate_up.append(torch.cat([gate, up]))
                down.append(out.pop(f"{p}{e}.down_proj.weight"))
            out[p + "gate_up_proj"], out[p + "down_proj"] = torch.stack(gate_up), torch.stack(down)
    return out
