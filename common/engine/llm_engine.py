"""The engine: one step = schedule() -> model_runner.run() -> postprocess().

Its boundary (common/engine/api.py): commands in (`handle`), one `StepResult` out per `step()`. It
works in token ids only; text (detokenization, stop strings) belongs to whoever shows it: the router,
or `generate()` here for offline use.

Faults are per request where they can be: when a step raises, the step's sequences are run again
without keeping anything, halves at a time (bisection), to find the ones that raise on their own. Those
end with finish_reason "error: <why>" (`fault`) and the rest of the step runs; the engine goes on. A
fault no request explains raises out of step() as before (the service exits: docs/architecture.md, "An
engine that fails"): a device error or out-of-memory, a step that fails only as a whole, one where every
sequence fails alone, tensor parallelism (the worker ranks are mid-step), and more than MAX_FAULTS
failed requests within FAULT_WINDOW_S (the engine, not the requests, is what fails).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.config import EngineConfig
from common.engine.api import (
    AddRequest,
    Admission,
    Command,
    EngineLoad,
    Finish,
    KVArrived,
    RemoteKV,
    StepResult,
    TokenOutput,
)
from common.engine.device import CPU_KV_CACHE_MB, Placement, graph_batch_sizes, kv_blocks_for_gpu
from common.engine.kv_connector import KVConnector
from common.engine.model_runner import ModelRunner
from common.engine.sampler import Sampled
from common.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from common.engine.sequence import Sequence
from common.engine.speed import StepSpeed
from common.engine.static_batching import StaticBatchScheduler
from common.kv import quant
from common.kv.block_manager import BlockManager
from common.kv.kv_cache import FP8, KVCacheSpec, KVScales, PagedKVCache
from common.kv.layer_groups import GroupedBlockManager
from common.kv.offload import KVOffload
from common.model.calibration import calibration_ids, kv_stats
from common.model.config import ModelConfig
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.parallel.partition import kv_head_ranges, shard_layouts
from common.prefix_hash import cache_root
from common.protocol import KVCompat
from common.sampling_params import SamplingParams
from common.text.detokenizer import IncrementalDetokenizer
from common.text.grammar import GrammarCompiler
from common.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported lazily: only an engine with tensor parallelism needs torch.distributed
    from common.engine.tp_workers import TPWorkers

log = logging.getLogger("splitserve.engine")

FAULT = "error"  # finish_reason "error: <why>": the engine failed on this request (see the module doc)
MAX_FAULTS, FAULT_WINDOW_S = 8, 60.0
# what a fault of the device itself says (the CUDA context may be gone: nothing on it can be trusted)
_DEVICE_FAULTS = ("CUDA", "cuda", "cuBLAS", "cuDNN", "cudnn", "device-side", "HIP", "NCCL", "out of memory")


def fault(finish_reason: str | None) -> str | None:
    """Why the engine failed the request, if this finish_reason says it did; else None."""
    if finish_reason is None or not finish_reason.startswith(FAULT + ":"):
        return None
    return finish_reason[len(FAULT) + 1 :].strip()


@dataclass
class Completion:
    """One offline request's result (`generate`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


def kv_compat(
    model_config: ModelConfig, spec: KVCacheSpec, kv_scales: str = "", tp_size: int = 1, tp_rank: int = 0
) -> KVCompat:
    """The transfer preflight's record for this model and KV cache (rank `tp_rank`'s shard of
    `tp_size`): every field the KV bytes depend on."""
    heads = kv_head_ranges(model_config.num_kv_heads, tp_size)[tp_rank]
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (
        model_config.num_layers,
        len(heads),
        model_config.head_dim,
    ), f"KV cache spec {spec} does not match the model's shape"
    return KVCompat(
        model_id=model_config.model_id,
        weights_hash=model_config.weights_hash,
        architecture=model_config.architecture,
        layer_groups=spec.layer_groups(),
        # pages of a few layers and a block table per layer group, or one block of every layer
        layout="LBSHD" if spec.groups.num_groups == 1 else f"LBSHD, pages of {spec.shape[0]} layers",
        dtype=str(spec.dtype).removeprefix("torch."),  # torch.bfloat16 -> "bfloat16"
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=spec.block_size,
        kv_scales=kv_scales,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def _heads_of(scales: KVScales | None, heads: range) -> KVScales | None:
    """fp8 scales and offsets of some KV heads (a tensor-parallel rank's)."""
    return None if scales is None else scales.heads(heads.start, heads.stop)


def _cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _check_tensor_parallel(placement: Placement, connector: KVConnector | None) -> None:
    """What tensor_parallel_size > 1 cannot do yet: ValueError naming it."""
    if placement.device.type != "cpu" or placement.attention_backend != "torch" or placement.cuda_graphs:
        raise ValueError(
            "tensor_parallel_size > 1 runs on the CPU only for now (gloo, the torch attention backend, no "
            f"CUDA graphs); got device={placement.device}, attention_backend={placement.attention_backend}"
        )
    if connector is not None and type(connector) is not KVConnector and connector.rank_transfer is None:
        raise ValueError(
            "tensor_parallel_size > 1 with a KV connector needs the worker ranks' transfer agents "
            "(connector.rank_transfer, set by the prefill and decode services)"
        )


class LLMEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig,
        placement: Placement | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        tp = config.tensor_parallel_size
        threads = config.num_threads or (max(1, _cores() // tp) if tp > 1 else None)
        if threads:
            torch.set_num_threads(threads)
        placement = placement or Placement.from_config(config)
        if model.dtype != placement.dtype:
            if config.dtype != "auto":
                raise ValueError(f"the model is {model.dtype} but the config asks for dtype={config.dtype}")
            placement = dataclasses.replace(placement, dtype=model.dtype)  # a model built by the caller
        self.placement = placement
        device = placement.device
        mc = model.config
        if tp > 1:
            _check_tensor_parallel(placement, connector)
        # tensor parallelism: rank 0's share of the heads, MLP and vocabulary (ValueError if none fits)
        layouts = shard_layouts(mc.num_heads, mc.num_kv_heads, mc.intermediate_size, mc.vocab_size, tp)
        self.tokenizer, self.config = tokenizer, config
        self.model = model.to(device)  # with tensor parallelism: replaced by rank 0's shard below
        dtype = self.placement.dtype
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        kv_dtype = quant.kv_dtype(config.kv_cache_dtype, dtype)
        scales: KVScales | None = None
        if kv_dtype in FP8:  # calibrated on the whole model; with tensor parallelism each rank's
            # cache keeps its heads' scales, and the preflight compares the whole model's
            scales = quant.calibrate(kv_stats(self.model, calibration_ids(tokenizer)), kv_dtype)
        self._scales_digest = scales.digest() if scales is not None else ""

        def kv_spec(blocks: int, kv_heads: int) -> KVCacheSpec:
            windows = tuple(mc.window(i) for i in range(mc.num_layers))
            windows = windows if any(w is not None for w in windows) else ()  # the layer groups
            mla = mc.mla_latent  # MLA: the cached latent's (kv_lora_rank, qk_rope_head_dim)
            return KVCacheSpec(
                mc.num_layers, blocks, config.block_size, kv_heads, mc.head_dim, kv_dtype, windows, mla,
                paged_groups=True,  # full and sliding layers mixed: a table per layer group (layer_groups.py)
            )  # fmt: skip

        # rank 0 holds the most KV heads (the partition gives the first ranks the larger share), so the
        # KV budget (kv_cache_memory_mb, per rank) sizes the block count every rank uses
        probe = kv_spec(1, len(layouts[0].kv_heads))
        if probe.groups.num_groups > 1:
            log.info(
                "KV layer groups: %s (%d layers a page, a block table per group: sliding groups release "
                "what slid out of their window)", probe.layer_groups(), probe.groups.layers_per_page,
            )  # fmt: skip
        if config.num_kv_blocks:  # blocks of every layer: as many pages as that many bytes make
            num_blocks = probe.groups.pages(config.num_kv_blocks)
        else:
            num_blocks = self._kv_blocks(probe.bytes_per_block)
        spec = kv_spec(num_blocks, len(layouts[0].kv_heads))
        self.tp_workers: TPWorkers | None = None
        if tp > 1:
            from common.engine.tp_workers import TPWorkers

            t0 = time.monotonic()
            specs = [kv_spec(num_blocks, len(lay.kv_heads)) for lay in layouts]
            compats = [kv_compat(mc, sp, self._scales_digest, tp, r) for r, sp in enumerate(specs)]
            transfer = connector.rank_transfer if connector is not None else None
            rank_scales = [_heads_of(scales, lay.kv_heads) for lay in layouts]
            self.tp_workers = TPWorkers(
                model, layouts, specs, threads or 1, compats, transfer, rank_scales, config.kv_exact_prefill
            )
            self.model = self.tp_workers.model
            log.info(
                "tensor parallelism: %d ranks (KV heads %s, %d threads each) started in %.1f s",
                tp, [len(lay.kv_heads) for lay in layouts], threads, time.monotonic() - t0,
            )  # fmt: skip
        scales = _heads_of(scales, layouts[0].kv_heads)  # rank 0's (all of them without TP)
        t0 = time.monotonic()  # one zeroed tensor each for K and V: no progress to show, a line after
        self.kv_cache = PagedKVCache(
            spec, device=device, compute_dtype=dtype, scales=scales, exact_prefill=config.kv_exact_prefill
        )
        unit = "blocks" if spec.groups.num_groups == 1 else f"pages ({spec.groups.layers_per_page} layers)"
        log.info(
            "KV cache: %d %s of %d tokens (%.0f MiB%s, %s), allocated in %.1f s",
            num_blocks, unit, config.block_size, num_blocks * spec.bytes_per_block / 2**20,
            f" on each of {tp} ranks" if tp > 1 else "", str(kv_dtype).removeprefix("torch."),
            time.monotonic() - t0,
        )  # fmt: skip
        self.block_manager: BlockManager
        if spec.groups.num_groups > 1:
            self.block_manager = GroupedBlockManager(
                num_blocks, config.block_size, spec.groups.windows, config.enable_prefix_caching
            )
        else:  # every layer slides: blocks that slid out are freed (the window); else none is
            window = spec.groups.windows[0]
            self.block_manager = BlockManager(
                num_blocks, config.block_size, config.enable_prefix_caching, window
            )
        self.kv_offload = self._offload_tiers()
        self.block_manager.tier = self.kv_offload
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.policy,
            preemption_mode=config.preemption_mode,
            num_swap_blocks=config.swap_space_mb * 2**20 // spec.bytes_per_block,
            aging_s=config.aging_s,
            tenant_weights=config.tenant_weights,
            fair_quantum_tokens=config.fair_quantum_tokens,
            fair_bulk_prefill_tokens=config.fair_bulk_prefill_tokens,
            fair_burst_s=config.fair_burst_s,
            kv_window=min((w for w in spec.layer_windows if w is not None), default=None),
        )
        self.connector = connector or KVConnector()
        self.speed = StepSpeed()  # recent steps' prefill and decode speed (the service publishes it)
        self._clamped_read: tuple[float, int] = (float("-inf"), 0)  # (when, value): _kv_clamped
        self.connector.bind(self.kv_cache)
        self.connector.bind_ranks(self.tp_workers, self.kv_compat())
        scheduler = StaticBatchScheduler if config.policy == "static" else Scheduler
        self.scheduler = scheduler(
            sched_cfg, self.block_manager, tuple(mc.eos_token_ids), holds_blocks=self.connector.holds_blocks
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            self.placement.attention_backend,
            self.connector,
            tuple(mc.eos_token_ids),
            share_step=self.tp_workers.run if self.tp_workers is not None else None,
        )
        self._grammars: GrammarCompiler | None = None  # made on the first structured-output request
        if self.placement.cuda_graphs:
            t0 = time.monotonic()
            sizes = graph_batch_sizes(config.max_num_seqs)
            self.runner.enable_graphs(sizes, self.max_model_len)
            log.info("captured CUDA graphs for decode batches %s in %.1f s", sizes, time.monotonic() - t0)
        log.info("engine on %s", ", ".join(f"{k}={v}" for k, v in self.placement.describe().items()))
        self._swapped_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._seqs: dict[str, Sequence] = {}  # every request the engine knows, until it has let go of it
        self._faults: deque[float] = deque()  # when requests were failed for a fault (the last window's)

    @classmethod
    def from_config(cls, config: EngineConfig, connector: KVConnector | None = None) -> LLMEngine:
        if config.engine == "sim":  # the roofline-timed stand-in for the model (common/engine/sim.py)
            from common.engine.sim import SimEngine

            return SimEngine(config, connector)
        placement = Placement.from_config(config)
        if config.tensor_parallel_size > 1:
            _check_tensor_parallel(placement, connector)  # before loading anything
        model, tokenizer = load_model(config.model, dtype=placement.dtype)
        # with tensor parallelism the engine keeps only its shard: the whole model goes with this frame
        return cls(model, tokenizer, config, placement, connector)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (a no-op without them) and the KV offload tiers'
        writer; idempotent. The engine cannot step afterwards."""
        try:
            if self.kv_offload is not None:  # first: its last evicted blocks' heads come from the workers
                self.kv_offload.close()
        finally:
            if self.tp_workers is not None:
                self.tp_workers.close()

    def _offload_tiers(self) -> KVOffload | None:
        """The KV offload tiers behind the pool (kv_offload_ram_gb, kv_offload_disk_dir), or None."""
        cfg = self.config
        if cfg.kv_offload_ram_gb <= 0 and not cfg.kv_offload_disk_dir:
            return None
        if not cfg.enable_prefix_caching:
            raise ValueError("KV offload tiers hold prefix-cache blocks: they need enable_prefix_caching")
        if self.tp_workers is None:
            return KVOffload.create(
                self.kv_cache, repr(self.kv_compat()), cfg.kv_offload_ram_gb, cfg.kv_offload_disk_dir,
                cfg.kv_offload_disk_gb, load_mode=cfg.kv_offload_load, disk_reads=cfg.kv_offload_disk_reads,
                recompute_s_per_block=self._recompute_s_per_block,
            )  # fmt: skip
        # Tensor parallelism: rank 0's store holds every KV head of a block (the workers' fetched and
        # handed back over the step pipes: common/kv/offload.py), so its records name the whole model's
        # KV layout, as one rank's would (the fp8 scales' digest is the whole model's already).
        mc = self.model.config
        whole = kv_compat(
            mc, dataclasses.replace(self.kv_cache.spec, num_kv_heads=mc.num_kv_heads), self._scales_digest
        )
        heads = kv_head_ranges(mc.num_kv_heads, cfg.tensor_parallel_size)
        return KVOffload.create(
            self.kv_cache, repr(whole), cfg.kv_offload_ram_gb, cfg.kv_offload_disk_dir,
            cfg.kv_offload_disk_gb, self.tp_workers, heads, disk_reads=cfg.kv_offload_disk_reads,
            recompute_s_per_block=self._recompute_s_per_block,
        )  # fmt: skip

    def _recompute_s_per_block(self) -> float:
        """Seconds to compute one block's tokens at this engine's recent speed on long prompts (0:
        unknown, no step of a long prompt yet)."""
        tps = self.speed.long_prefill_tps
        return self.block_manager.block_size / tps if tps > 0 else 0.0

    def _kv_blocks(self, bytes_per_block: int) -> int:
        """KV blocks from kv_cache_memory_mb, or on a GPU (by default) from what is free after a
        profiling step at the full token budget."""
        cfg = self.config
        if cfg.kv_cache_memory_mb is not None or self.placement.device.type != "cuda":
            mb = cfg.kv_cache_memory_mb or CPU_KV_CACHE_MB
            return max(1, mb * 2**20 // bytes_per_block)
        peak = self._profile_activations()
        free, total = torch.cuda.mem_get_info(self.placement.device)
        return kv_blocks_for_gpu(total, free, peak, cfg.gpu_memory_utilization, bytes_per_block)

    @torch.inference_mode()
    def _profile_activations(self) -> int:
        """Peak bytes one forward of max_num_batched_tokens needs beyond the weights, measured with a
        throwaway KV cache just big enough for it (its own size is subtracted)."""
        mc, cfg, dev = self.model.config, self.config, self.placement.device
        n = min(cfg.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // cfg.block_size)
        spec = KVCacheSpec(
            mc.num_layers, blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim, self.placement.dtype
        )
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        scratch = PagedKVCache(spec, device=dev)
        meta_tables = [list(range(blocks))]
        runner = ModelRunner(self.model, scratch, self.placement.attention_backend)
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        pos = torch.arange(n, device=dev)
        slots = torch.arange(n, dtype=torch.long, device=dev)
        meta = runner.attention_metadata([0, n], [n], meta_tables, slots)
        hidden = self.model(ids, pos, scratch, meta)
        self.model.compute_logits(hidden[-min(n, cfg.max_num_seqs) :])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base - 2 * scratch.k.numel() * scratch.k.element_size()
        del scratch, hidden
        torch.cuda.empty_cache()
        return max(0, int(peak))

    # --- requests ---------------------------------------------------------------------------------
    def handle(self, cmd: Command) -> TokenOutput | None:
        """Apply one command (between steps); a KVArrived whose token 0 already ends the request
        returns that end as an output."""
        match cmd:
            case AddRequest():
                self.add_request(
                    cmd.token_ids,
                    cmd.params,
                    cmd.request_id,
                    cmd.priority,
                    remote_kv=cmd.remote_kv,
                    num_output_tokens=cmd.num_output_tokens,
                    tenant=cmd.tenant,
                    cache_salt=cmd.cache_salt,
                )
            case KVArrived():
                return self.kv_arrived(cmd.request_id, cmd.first_token)
            case Finish():
                self.finish(cmd.request_id, cmd.reason)
        return None

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        *,
        remote_kv: RemoteKV | None = None,
        num_output_tokens: int = 0,
        tenant: str = "",
        cache_salt: str = "",
    ) -> str:
        """Queue a request; returns its id. ValueError if it can never run here (too long, id in use).
        With num_output_tokens, the last that many ids are output already generated elsewhere (a
        migrated request): generation continues at that output index."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # on a GPU an embedding out of range is a device assert
            raise ValueError(f"token ids must be in [0, {vocab})")
        if not 0 <= num_output_tokens < len(ids):
            raise ValueError(f"num_output_tokens must be in [0, {len(ids)}), got {num_output_tokens}")
        if num_output_tokens >= params.max_tokens:
            raise ValueError(f"max_tokens {params.max_tokens} leaves none after {num_output_tokens} outputs")
        total = len(ids) - num_output_tokens + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                f"context length {self.max_model_len}"
            )
        # a windowed model's sequence holds a chunk and the window before it, not all its blocks
        bm = self.block_manager
        if bm.most_held(total, self.config.max_num_batched_tokens) > bm.num_blocks:
            raise ValueError(
                f"{total} tokens need more KV blocks than the cache has ({self.block_manager.num_blocks})"
            )
        now = time.monotonic()
        seq = Sequence(
            ids, params, seq_id=request_id, priority=priority, arrival_time=now, tenant=tenant,
            cache_root=cache_root(cache_salt),
        )  # fmt: skip
        seq.remote_kv, seq.num_prompt_tokens = remote_kv, len(ids) - num_output_tokens
        if seq.seq_id in self._seqs:
            raise ValueError(f"request id {seq.seq_id} is already in use")
        if params.guide is not None:  # GuideError (a ValueError) for a guide that does not compile
            seq.grammar = self.grammars.matcher(params.guide, ids[seq.num_prompt_tokens :])
        if params.prompt_logprobs is not None and num_output_tokens == 0 and remote_kv != "receive":
            seq.prompt_logprobs = [None]  # the first prompt token has no logprob
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        if self.kv_offload is not None and seq.prompt_logprobs is None:  # (prompt logprobs: no reuse)
            # the tiers start reading its disk blocks into RAM now (a window's admission: its first chunk
            # after the run the tiers hold, so the prefetch needs that chunk's size); its admission waits
            # for them while other sequences run (scheduler, `_prefetching`), up to
            # kv_offload_prefetch_wait_s (a bound for a stuck disk)
            keys = self.block_manager.prefetch(seq, self.config.max_num_batched_tokens)
            wait = self.config.kv_offload_prefetch_wait_s
            if keys and wait > 0:
                seq.prefetch_keys, seq.prefetch_deadline = keys, self.scheduler.clock() + wait
        return seq.seq_id

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
        return self._grammars

    def kv_arrived(self, request_id: str, first_token: int) -> TokenOutput | None:
        """A prefill service wrote the prompt's KV into this request's reserved blocks and sampled
        token 0. KeyError if the request is gone (it was finished meanwhile)."""
        seq = self._seqs[request_id]
        reason = self.scheduler.kv_arrived(seq, first_token)
        if reason is None:
            return None
        self._let_go(seq)
        return TokenOutput(request_id, [], seq.num_output_tokens, reason)

    def finish(self, request_id: str, reason: str) -> None:
        """End the request wherever it is (see api.Finish); a no-op for an unknown id."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.scheduler.finish(seq, reason)
            self._let_go(seq)

    def _let_go(self, seq: Sequence) -> None:
        """Forget a finished sequence, unless a transfer still holds its blocks (it stays findable)."""
        if seq.is_finished and seq.seq_id not in self.scheduler.parked:
            self._seqs.pop(seq.seq_id, None)
            if self._swapped_kv.pop(seq.seq_id, None) is not None and self.tp_workers is not None:
                self.tp_workers.drop(seq.seq_id)  # the workers' swapped copies go with the next step

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def load(self) -> EngineLoad:
        """How loaded the engine is now (the engine's own thread: a service reads the copy its
        AsyncEngine publishes after every step and command)."""
        sched, bm = self.scheduler, self.block_manager
        return EngineLoad(
            running=sched.num_active,
            parked=sched.num_parked,
            waiting=sched.num_waiting,
            queued_tokens=sched.queued_tokens(),
            oldest_arrival=sched.oldest_arrival(),  # add_request stamps arrivals with time.monotonic()
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            pages_per_block=bm.num_groups,
            prefill_tps=self.speed.prefill_tps,
            long_prefill_tps=self.speed.long_prefill_tps,
            decode_step_ms=self.speed.decode_step_ms,
            prefill_step_ms=self.speed.prefill_step_ms,
            prefill_ms_per_token=self.speed.prefill_ms_per_token,
            step_tokens=self.config.max_num_batched_tokens,
            decode_step_fixed_ms=self.speed.decode_step_fixed_ms,
            decode_ms_per_seq=self.speed.decode_ms_per_seq,
            preempted_swap=sched.stats["preempt_swap"],
            preempted_recompute=sched.stats["preempt_recompute"],
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
            tier_hits=bm.tier_hits,
            kv_clamped=self._kv_clamped(),
        )

    def _kv_clamped(self) -> int:
        """fp8 KV values saturated since start (PagedKVCache.clamped). Reading it waits for the device,
        so an fp8 cache is asked at most once a second (load() runs after every step); 0 otherwise."""
        if not self.kv_cache.quantized:
            return 0
        now = time.monotonic()
        at, value = self._clamped_read
        if now - at >= 1.0:
            value = self.kv_cache.clamped
            self._clamped_read = (now, value)
        return value

    def kv_compat(self) -> KVCompat:
        """What a peer must match before KV moves between this engine's cache and its own."""
        tp = self.config.tensor_parallel_size
        return kv_compat(self.model.config, self.kv_cache.spec, self._scales_digest, tp, 0)

    # --- one iteration ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        out = self.scheduler.schedule()
        if self.kv_offload is not None:  # blocks evicted by this schedule, out before anything writes
            self.kv_offload.flush()
        self._move_swapped(out)
        result = StepResult(
            admitted=[
                Admission(
                    s.seq_id, list(s.block_table), s.num_cached_tokens, [list(t) for t in s.group_tables]
                )
                for s in out.admitted
            ],
            preempted=[s.seq_id for s in out.preempted],
            num_scheduled=len(out.scheduled) + len(out.padding),
            num_padding=len(out.padding),
            num_tokens=out.num_batched_tokens + len(out.padding),
        )
        if out.is_empty and not out.padding:
            if self.tp_workers is not None:
                self.tp_workers.flush()  # this step's swaps, with no forward to carry them
            return result
        meta = self.connector.build_meta(out)
        t0 = time.perf_counter()
        try:
            sampled = self.runner.run(out, meta)
        except Exception as e:
            self.kv_cache.settle_loads()  # the copies a failed forward did not wait for
            out, sampled = self._isolate_fault(e, out, meta, result)
        finally:
            # tier reads put in layer by layer: done before anything else reads the pool (a prefill's
            # KV sender, the next schedule's swaps and evictions; common/kv/layer_loads.py)
            self.kv_cache.settle_loads()
        decodes = sum(
            1 for seq, n in out.scheduled if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
        )
        self.speed.observe(time.perf_counter() - t0, out.num_batched_tokens - decodes, decodes)
        self.scheduler.postprocess(out, [s.token_id if s is not None else None for s in sampled])
        for (seq, _), s in zip(out.scheduled, sampled, strict=True):
            if s is None:
                continue
            index = seq.num_output_tokens - 1
            lps = [s.logprob] if s.logprob is not None else None
            prompt_lps, seq.prompt_logprobs = seq.prompt_logprobs, None  # sent once, with the first token
            result.outputs.append(
                TokenOutput(seq.seq_id, [s.token_id], index, seq.finish_reason, lps, prompt_lps)
            )
            self._let_go(seq)
        return result

    def _isolate_fault(
        self, error: Exception, out: SchedulerOutput, meta: object, result: StepResult
    ) -> tuple[SchedulerOutput, list[Sampled | None]]:
        """The step raised `error`: fail the sequences that raise on their own (an output each in
        `result`), run the rest of the step, and return it with its samples. Raises `error` when no
        request explains it (module doc).

        The probes recompute each group's tokens without keeping anything (no sample, no prompt
        logprob, no KV shipped): the KV they write is what the step writes anyway, at positions the
        sequences have not computed yet. The rest then runs with the step's transfer metadata (layer
        writes posted before the fault are posted again: the same bytes to the same blocks)."""
        if not self._attributable(error):
            raise error
        log.warning("engine step failed (%r): looking for the request(s) that cause it", error)

        def culprits(group: list[tuple[Sequence, int]]) -> list[tuple[Sequence, Exception]]:
            try:
                self.runner.run(SchedulerOutput(scheduled=group), None, commit=False)
                return []
            except Exception as e:
                if not self._attributable(e):
                    raise
                if len(group) == 1:
                    return [(group[0][0], e)]
            half = len(group) // 2
            return culprits(group[:half]) + culprits(group[half:])

        found = culprits(out.scheduled)
        if not found:  # the step fails only as a whole (or not again): no request to blame
            raise error
        if len(found) == len(out.scheduled) > 1:  # every request fails alone: the engine, not them
            raise error
        now = time.monotonic()
        self._faults.extend([now] * len(found))
        while self._faults and now - self._faults[0] > FAULT_WINDOW_S:
            self._faults.popleft()
        if len(self._faults) > MAX_FAULTS:
            raise RuntimeError(
                f"the engine failed on {len(self._faults)} requests within {FAULT_WINDOW_S:g} s "
                f"(the last: {error!r})"
            ) from error
        for seq, e in found:
            why = f"the engine failed on this request: {e!r}"[:500]
            log.error("request %s: %s; the step's other requests go on", seq.seq_id, why)
            reason = f"{FAULT}: {why}"
            self.scheduler.finish(seq, reason)
            result.outputs.append(TokenOutput(seq.seq_id, [], seq.num_output_tokens, reason))
            self._let_go(seq)
        failed = {id(seq) for seq, _ in found}
        rest = dataclasses.replace(out, scheduled=[(s, n) for s, n in out.scheduled if id(s) not in failed])
        return rest, (self.runner.run(rest, meta) if rest.scheduled else [])

    def _attributable(self, error: BaseException) -> bool:
        """Whether a request could explain `error`: not with tensor parallelism (the worker ranks are
        somewhere in the step), not a fault of the device or of memory."""
        if self.tp_workers is not None or isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
            return False
        accelerator = getattr(torch, "AcceleratorError", None)
        if accelerator is not None and isinstance(error, accelerator):
            return False
        text = str(error)
        return not any(s in text for s in _DEVICE_FAULTS)

    def _move_swapped(self, out: SchedulerOutput) -> None:
        """Swap KV out and in; the tensor-parallel workers do the same to their shards, first thing
        when they get this step."""
        tpw = self.tp_workers
        for seq, blocks in out.swap_out:
            self._swapped_kv[seq.seq_id] = self.kv_cache.copy_out(blocks)
            if tpw is not None:
                tpw.swap_out(seq.seq_id, blocks)
        for seq in out.swap_in:
            saved = self._swapped_kv.pop(seq.seq_id)
            blocks = self.block_manager.live_pages(seq, seq.swap_width)  # holes were not swapped out
            assert len(blocks) == saved[0].shape[1], (
                f"{seq.seq_id}: {len(blocks)} blocks for {saved[0].shape[1]}"
            )
            self.kv_cache.copy_in(blocks, saved)
            if tpw is not None:
                tpw.swap_in(seq.seq_id, blocks)

    # --- offline convenience ----------------------------------------------------------------------
    def generate(
        self,
        prompts: Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams],
        progress: bool = False,
    ) -> list[Completion]:
        """Run prompts to completion here; stop strings apply to the text."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        runs = [self._start(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(runs), desc="generate", unit="req")
        for run in self._run(runs):
            if run.finish_reason is not None and bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return [r.completion() for r in runs]

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
        """One prompt's text as it is generated (what `splitserve generate` prints)."""
        run = self._start(prompt, params)
        for _ in self._run([run]):
            yield run.take_text()

    def _start(self, prompt: str | list[int], params: SamplingParams) -> _OfflineRun:
        rid = self.add_request(prompt, params)
        seq = self._seqs[rid]
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        return _OfflineRun(rid, seq.token_ids[: seq.num_prompt_tokens], detok)

    def _run(self, runs: list[_OfflineRun]) -> Iterator[_OfflineRun]:
        """Step until every run ended; yields a run each time it got new output."""
        by_id = {r.request_id: r for r in runs}
        while self.has_unfinished():
            for o in self.step().outputs:
                run = by_id.get(o.request_id)
                if run is None:
                    continue
                run.add(o)
                if run.detok.stopped and o.finish_reason is None:
                    self.finish(run.request_id, "stop")  # a stop string: text the engine cannot see
                    run.finish_reason = "stop"
                yield run


@dataclass
class _OfflineRun:
    request_id: str
    prompt_token_ids: list[int]
    detok: IncrementalDetokenizer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    _text: str = ""  # produced and not yet taken by stream()

    def add(self, o: TokenOutput) -> None:
        for tok in o.token_ids:
            self.token_ids.append(tok)
            self._text += self.detok.add(tok)
        if o.finish_reason is not None:
            self.finish_reason = o.finish_reason
            self._text += self.detok.flush()  # text held back in case a stop string was starting

    def take_text(self) -> str:
        text, self._text = self._text, ""
        return text

    def completion(self) -> Completion:
        return Completion(
            self.request_id, self.prompt_token_ids, self.token_ids, self.detok.text, self.finish_reason or ""
        )
