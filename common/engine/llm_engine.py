"""The engine: one step = schedule() -> model_runner.run() -> postprocess()."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from common.config import EngineConfig
from common.engine.detokenizer import IncrementalDetokenizer
from common.engine.device import CPU_KV_CACHE_MB, Placement, graph_batch_sizes, kv_blocks_for_gpu
from common.engine.model_runner import ModelRunner
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from common.engine.sequence import Sequence, SequenceStatus
from common.kv.block_manager import BlockManager
from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.model.tokenizer import Tokenizer

log = logging.getLogger("splitserve.engine")


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class LLMEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig,
        placement: Placement | None = None,
    ) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        placement = placement or Placement.from_config(config)
        if model.dtype != placement.dtype:
            if config.dtype != "auto":
                raise ValueError(f"the model is {model.dtype} but the config asks for dtype={config.dtype}")
            placement = dataclasses.replace(placement, dtype=model.dtype)  # a model built by the caller
        self.placement = placement
        device = placement.device
        self.model, self.tokenizer, self.config = model.to(device), tokenizer, config
        mc = model.config
        dtype = self.placement.dtype
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        probe = KVCacheSpec(mc.num_layers, 1, config.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        num_blocks = config.num_kv_blocks or self._kv_blocks(probe.bytes_per_block)
        spec = KVCacheSpec(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        self.kv_cache = PagedKVCache(spec, device=device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.policy,
            preemption_mode=config.preemption_mode,
            num_swap_blocks=config.swap_space_mb * 2**20 // spec.bytes_per_block,
            aging_s=config.aging_s,
        )
        self.scheduler = Scheduler(sched_cfg, self.block_manager, tuple(mc.eos_token_ids))
        self.runner = ModelRunner(model, self.kv_cache, self.placement.attention_backend)
        if self.placement.cuda_graphs:
            t0 = time.monotonic()
            sizes = graph_batch_sizes(config.max_num_seqs)
            self.runner.enable_graphs(sizes, self.max_model_len)
            log.info("captured CUDA graphs for decode batches %s in %.1f s", sizes, time.monotonic() - t0)
        log.info(
            "engine on %s: %d KV blocks of %d tokens (%.0f MiB)",
            ", ".join(f"{k}={v}" for k, v in self.placement.describe().items()),
            num_blocks, config.block_size, num_blocks * spec.bytes_per_block / 2**20,
        )  # fmt: skip
        self._swapped_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.last_step: SchedulerOutput | None = None  # for benchmarks and tests that inspect a step

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        placement = Placement.from_config(config)
        model, tokenizer = load_model(config.model, dtype=placement.dtype)
        return cls(model, tokenizer, config, placement)

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
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        *,
        remote_prefill: bool = False,
        hold_blocks: bool = False,
    ) -> Sequence:
        """Queue a request. remote_prefill (decode service): reserve blocks and wait for a prefill
        service to write the prompt's KV (`kv_arrived`). hold_blocks (prefill service): keep the
        blocks after the request finishes until `release`, so its KV can still be sent."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                f"context length {self.max_model_len}"
            )
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise ValueError(
                f"{total} tokens need more KV blocks than the cache has ({self.block_manager.num_blocks})"
            )
        seq = Sequence(ids, params, seq_id=request_id, priority=priority, arrival_time=time.monotonic())
        if seq.seq_id in self._seqs:
            raise ValueError(f"request id {seq.seq_id} is already in use")
        self._seqs[seq.seq_id] = seq
        self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        seq.hold_blocks = hold_blocks
        if remote_prefill:
            self.scheduler.add_remote(seq)
        else:
            self.scheduler.add(seq)
        return seq

    def kv_arrived(self, request_id: str, first_token: int) -> RequestOutput:
        """A prefill service wrote the prompt's KV into this request's reserved blocks."""
        seq = self._seqs[request_id]
        self.scheduler.kv_arrived(seq, first_token)
        return self._output(seq, first_token)

    def release(self, request_id: str) -> None:
        """Free the blocks a hold_blocks request kept, now that its KV has been sent."""
        self.scheduler.release(self._seqs[request_id])

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self._release(seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def forget(self, seq: Sequence) -> None:
        """Abort seq if it still runs and drop it; a no-op if the id now names another sequence."""
        if self._seqs.get(seq.seq_id) is not seq:
            return
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self._release(seq)
        if seq.seq_id in self.scheduler.held:
            self.scheduler.release(seq)
        del self._seqs[seq.seq_id]
        self._detok.pop(seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # --- one iteration ----------------------------------------------------------------------------
    def step(self, on_layer_done: Callable[[int], None] | None = None) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self.last_step = out
        self._move_swapped(out)
        if out.is_empty:
            return []
        sampled = self.runner.run(out, on_layer_done)
        finished = set(map(id, self.scheduler.postprocess(out, sampled)))
        return self._outputs(out, sampled, finished)

    def _move_swapped(self, out: SchedulerOutput) -> None:
        for seq, blocks in out.swap_out:
            self._swapped_kv[seq.seq_id] = self.kv_cache.copy_out(blocks)
        for seq in out.swap_in:
            saved = self._swapped_kv.pop(seq.seq_id)
            self.kv_cache.copy_in(seq.block_table[: saved[0].shape[1]], saved)

    def _outputs(
        self, out: SchedulerOutput, sampled: list[int | None], finished: set[int]
    ) -> list[RequestOutput]:
        return [
            self._output(seq, tok)
            for (seq, _), tok in zip(out.scheduled, sampled, strict=True)
            if tok is not None and (not seq.padding or id(seq) in finished)
        ]

    def _output(self, seq: Sequence, tok: int) -> RequestOutput:
        detok = self._detok[seq.seq_id]
        new_text = detok.add(tok)
        if detok.stopped and not seq.is_finished:
            self.scheduler.finish(seq, "stop")
        if seq.is_finished:
            new_text += detok.flush()  # text held back in case a stop string was starting
            self._release(seq)
        return RequestOutput(
            seq.seq_id,
            [tok],
            new_text,
            seq.is_finished,
            seq.finish_reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
        )

    def _release(self, seq: Sequence) -> None:
        self._swapped_kv.pop(seq.seq_id, None)

    def text(self, request_id: str) -> str:
        return self._detok[request_id].text

    def pop_finished(self, request_id: str) -> Completion:
        seq = self._seqs.pop(request_id)
        assert seq.status is SequenceStatus.FINISHED, f"{request_id} has not finished"
        detok = self._detok.pop(request_id)
        return Completion(
            request_id,
            seq.token_ids[: seq.num_prompt_tokens],
            seq.output_token_ids,
            detok.text,
            seq.finish_reason or "",
        )

    # --- offline convenience ----------------------------------------------------------------------
    def generate(
        self,
        prompts: Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams],
        progress: bool = False,
    ) -> list[Completion]:
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp).seq_id for p, sp in zip(prompts, plist, strict=True)]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while self.has_unfinished():
            for o in self.step():
                if o.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [self.pop_finished(i) for i in ids]
