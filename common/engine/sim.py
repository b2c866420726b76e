"""The simulated engine (`--engine sim`): the real scheduler, block manager, KV connector and services,
with only the model replaced: no weights, the forward a sleep of the step's roofline time
(common/engine/sim_profile.py) and tokens drawn deterministically.

- Time: `SimEngine.step` notes when the step began; the runner computes the step's duration from the
  batch actually scheduled (each sequence's new tokens and the tokens already in its KV) and sleeps
  until step start + duration, so the scheduler's own cost is inside the profiled time, not added to it.
- KV: a real paged KV pool (PagedKVCache, bf16) of small blocks, `sim_kv_block_bytes` each, so the KV
  connectors move real bytes; the block *count* is the profile's (its GPU memory less its weights over
  its model's KV bytes per token), so capacity, admission and preemption behave as on that GPU. The pool
  has the profile's layers when a block is big enough for 8 bytes per layer and token, else fewer
  (`pool_shape`); a prefill ships each pool layer at its share of the step's time.
- Tokens: the tokenizer is `--model`'s (the router's; default SmolLM2), so ids stay in its vocabulary.
  Token = blake2b(seed, every token id so far) mod vocab, never an EOS id; with `sim_output_len` N the
  N-th output token is EOS (unless ignore_eos or min_tokens says otherwise). The same prompt and seed
  give the same text on any service, so a migrated request continues as an unfaulted one would.
  Logprobs and guided decoding need logits: the sim refuses them (ValueError from add_request).
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from typing import Any, cast

import torch

from common.config import EngineConfig
from common.engine.api import StepResult
from common.engine.device import Placement
from common.engine.kv_connector import KVConnector
from common.engine.llm_engine import LLMEngine
from common.engine.model_runner import ModelRunner
from common.engine.sampler import Sampled
from common.engine.scheduler import SchedulerOutput
from common.engine.sequence import Sequence
from common.engine.sim_profile import SimProfile, step_seconds
from common.model.config import ModelConfig
from common.model.llama import LlamaForCausalLM
from common.sampling_params import SamplingParams
from common.text.model_info import load_model_info

log = logging.getLogger("splitserve.engine")

KV_DTYPE = torch.bfloat16  # the sim pool's element: 2 bytes


def pool_shape(profile_layers: int, block_size: int, block_bytes: int) -> tuple[int, int]:
    """(layers, head_dim) of the sim KV pool, one KV head of bf16: the profile's layers when a block of
    `block_bytes` gives each layer at least head_dim 2 (K and V: 8 bytes per token and layer), else as
    many layers as fit; head_dim the largest even number that keeps the block within block_bytes (2 at
    least). A block is then 2 * layers * block_size * head_dim * 2 bytes."""
    per_layer_min = 2 * block_size * 2 * 2  # K and V, head_dim 2, bf16
    layers = max(1, min(profile_layers, block_bytes // per_layer_min))
    head_dim = max(2, block_bytes // (2 * layers * block_size * 2) // 2 * 2)
    return layers, head_dim


def draw_token(seed: int, token_ids: list[int], vocab_size: int, avoid: tuple[int, ...] = ()) -> int:
    """A token id in [0, vocab_size) from (seed, every token so far), never one of `avoid`."""
    key = seed.to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=8, key=key).digest()
    token = int.from_bytes(digest, "little") % vocab_size
    while token in avoid:
        token = (token + 1) % vocab_size
    return token


def sim_token(seq: Sequence, seed: int, vocab_size: int, eos: tuple[int, ...], output_len: int | None) -> int:
    """The sim's next token for `seq` (module doc): EOS as output number `output_len`, else drawn."""
    params, index = seq.params, seq.num_output_tokens  # the token drawn now is output number index
    ends = output_len is not None and index + 1 >= output_len
    if ends and eos and not params.ignore_eos and index + 1 >= params.min_tokens:
        return eos[0]
    return draw_token(params.seed if params.seed is not None else seed, seq.token_ids, vocab_size, eos)


class SimModel(torch.nn.Module):
    """What the engine needs of a model when nothing runs it: its config (the sim pool's shape, the
    tokenizer's vocabulary, the profile's digest as weights_hash) and its dtype."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    @property
    def dtype(self) -> torch.dtype:
        return KV_DTYPE


class SimRunner(ModelRunner):
    """Sleeps a step's roofline time instead of running a model (module doc)."""

    def __init__(self, profile: SimProfile, engine_cfg: EngineConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.profile = profile
        self.seed, self.output_len = engine_cfg.sim_seed, engine_cfg.sim_output_len
        self.step_t0: float | None = None  # when the engine's step began (SimEngine.step)
        # what the engine's step spends after the forward (postprocess, outputs), recent average: the sleep
        # ends that much early so that the whole step, not just the forward, takes the profiled time
        self.tail_s = 0.0
        self.ran_until = 0.0  # when the last run() returned
        self.last_duration = 0.0  # the profiled time of the last step run

    def run(
        self, out: SchedulerOutput, transfer: Any | None = None, commit: bool = True
    ) -> list[Sampled | None]:
        t0 = self.step_t0 if self.step_t0 is not None else time.perf_counter()
        self.step_t0 = None
        step = self.prepare(out)
        rows = [(n, seq.num_computed_tokens) for seq, n in out.scheduled]
        rows += [(1, seq.num_tokens - 1) for seq in out.padding]
        self.last_duration = duration = step_seconds(self.profile, rows)
        self._write_kv(step.ids, step.slots)
        if transfer is not None:  # each pool layer ships at its share of the step, as a forward would
            layers = self.kv_cache.spec.num_layers
            for layer in range(layers):
                _sleep_until(t0 + duration * (layer + 1) / layers)
                self.connector.save_layer(layer, transfer)
        _sleep_until(t0 + duration - self.tail_s)
        result: list[Sampled | None] = [None] * len(out.scheduled)
        vocab, eos = self.model.config.vocab_size, self.sampler.eos_token_ids
        for i, (seq, _) in enumerate(out.scheduled):
            if step.context_lens[i] == seq.num_tokens:
                result[i] = Sampled(sim_token(seq, self.seed, vocab, eos, self.output_len), None)
        self.ran_until = time.perf_counter()
        return result

    def _write_kv(self, ids: list[int], slots: list[int]) -> None:
        """Store something of each new token in its KV slots (its id mod 251): the bytes a transfer moves
        say which tokens they belong to."""
        if not slots:
            return
        spec = self.kv_cache.spec
        values = (torch.tensor(ids, dtype=torch.float32) % 251).to(spec.dtype).view(1, -1, 1, 1)
        index = torch.tensor(slots, dtype=torch.long)
        for cache in (self.kv_cache.k, self.kv_cache.v):
            cache.view(spec.num_layers, -1, spec.num_kv_heads, spec.head_dim)[:, index] = values

    def run_shard(self, step: Any, transfer: Any | None = None) -> None:
        raise AssertionError("the sim engine has no tensor-parallel ranks (TP is the profile's)")


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class SimEngine(LLMEngine):
    """LLMEngine over a SimModel and SimRunner: everything but the forward is the real engine's."""

    def __init__(self, config: EngineConfig, connector: KVConnector | None = None) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError(
                "engine=sim: tensor parallelism is the profile's (tensor_parallel_size must be 1)"
            )
        if config.kv_cache_dtype.startswith("fp8") or config.device == "cuda":
            raise ValueError("engine=sim runs on the CPU with a bf16 KV pool (no fp8 KV, no device=cuda)")
        if config.kv_cache_memory_mb is not None:
            raise ValueError(
                "engine=sim: the KV block count is the profile's (use num_kv_blocks to override)"
            )
        self.profile = SimProfile.load(config.sim_profile)
        torch.set_num_threads(config.num_threads or 1)  # nothing here is worth more than one
        info = load_model_info(config.model)
        layers, head_dim = pool_shape(
            self.profile.model.num_layers, config.block_size, config.sim_kv_block_bytes
        )
        mc = ModelConfig(
            vocab_size=info.tokenizer.vocab_size, hidden_size=head_dim, intermediate_size=head_dim,
            num_layers=layers, num_heads=1, num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-5,
            rope_theta=10000.0, rope_scaling=None,
            max_position_embeddings=min(self.profile.model.max_position_embeddings, info.context_length),
            tie_word_embeddings=False, bos_token_id=None, eos_token_ids=info.tokenizer.eos_token_ids,
            model_id=info.model_id, weights_hash=self.profile.digest, architecture="sim",
        )  # fmt: skip
        placement = Placement(torch.device("cpu"), KV_DTYPE, "torch", cuda_graphs=False)
        model = cast(LlamaForCausalLM, SimModel(mc))
        super().__init__(model, info.tokenizer, config, placement, connector)
        self.runner = SimRunner(
            self.profile, config, model, self.kv_cache, "torch", self.connector, tuple(mc.eos_token_ids)
        )
        log.info(
            "sim engine: profile %s (%s on %s, TP %d), %d KV blocks of %d bytes in the pool (%d layers)",
            self.profile.name, self.profile.model.name, self.profile.gpu.name,
            self.profile.tensor_parallel_size, self.block_manager.num_blocks,
            self.kv_cache.spec.bytes_per_block, layers,
        )  # fmt: skip

    def _kv_blocks(self, bytes_per_block: int) -> int:
        return self.profile.kv_blocks(self.config.block_size)

    def step(self) -> StepResult:
        runner = self.runner
        assert isinstance(runner, SimRunner)
        runner.step_t0 = time.perf_counter()  # the profiled time counts from here
        ran_until = runner.ran_until
        result = super().step()
        if runner.ran_until != ran_until:  # the step ran the model: learn what follows it
            runner.tail_s += 0.2 * (time.perf_counter() - runner.ran_until - runner.tail_s)
        return result

    def add_request(self, prompt: str | list[int], params: SamplingParams, *args: Any, **kwargs: Any) -> str:
        if params.logprobs is not None or params.prompt_logprobs is not None or params.guide is not None:
            raise ValueError("engine=sim draws tokens without logits: no logprobs and no guided decoding")
        return super().add_request(prompt, params, *args, **kwargs)
