"""The engine: one step = schedule() -> model_runner.run() -> postprocess()."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from common.config import EngineConfig
from common.engine.detokenizer import IncrementalDetokenizer
from common.engine.model_runner import ModelRunner
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from common.engine.sequence import Sequence, SequenceStatus
from common.kv.block_manager import BlockManager
from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        mc = model.config
        dtype = DTYPES[config.dtype]
        probe = KVCacheSpec(mc.num_layers, 1, config.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory_mb * 2**20 // probe.bytes_per_block
        )
        spec = KVCacheSpec(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        self.kv_cache = PagedKVCache(spec)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.policy,
            preemption_mode=config.preemption_mode,
            num_swap_blocks=config.swap_space_mb * 2**20 // spec.bytes_per_block,
            aging_s=config.aging_s,
        )
        self.scheduler = Scheduler(sched_cfg, self.block_manager, tuple(mc.eos_token_ids))
        self.runner = ModelRunner(model, self.kv_cache)
        self._swapped_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.last_step: SchedulerOutput | None = None  # for benchmarks and tests that inspect a step

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        model, tokenizer = load_model(config.model, dtype=DTYPES[config.dtype])
        return cls(model, tokenizer, config)

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
