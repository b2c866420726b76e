"""The simulated engine: the profile arithmetic (checked against the formulas written out by hand, not by
timing), the deterministic token draw, and the real engine around the sim (scheduler, block manager)
run in process with the tiny model's tokenizer."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sim import SimEngine, draw_token, pool_shape
from common.engine.sim_profile import SimProfile, shipped, step_bytes, step_flops, step_seconds
from common.sampling_params import SamplingParams

H100_8B = "llama3-8b-h100"


def test_shipped_profiles_load_with_their_hardware() -> None:
    assert shipped() == ["llama3-70b-h100-tp4", "llama3-70b-h200-tp2", "llama3-8b-h100", "llama3-8b-h200"]
    p = SimProfile.load(H100_8B)
    # Llama-3-8B: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes = 128 KiB per token
    assert p.model.kv_bytes_per_token == 131072
    assert SimProfile.load("llama3-70b-h100-tp4").model.kv_bytes_per_token == 327680
    assert SimProfile.load("llama3-8b-h200").gpu.memory_bandwidth == 4.8e12


def test_a_profile_with_an_unknown_key_or_name_is_an_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(SimProfile.load(H100_8B).model_dump_json())
    data["efficiency"]["flops_typo"] = 0.5
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="flops_typo"):
        SimProfile.load(str(bad))
    with pytest.raises(ValueError, match="llama3-8b-h100"):  # the message lists the shipped ones
        SimProfile.load("llama3-8b-a100")


def test_decode_step_is_weights_plus_kv_over_bandwidth() -> None:
    p = SimProfile.load(H100_8B)
    # batch of 4 decode rows, 1000 tokens cached each: memory-bound
    rows = [(1, 1000)] * 4
    weights = 8.03e9 * 2
    kv = 4 * 1001 * 131072
    memory = (weights + kv) / (3.35e12 * 0.8)
    flops = 4 * (2 * 8.03e9 + 4 * 32 * 32 * 128 * (1000 + 1))
    assert flops / (989e12 * 0.6) < memory
    assert step_bytes(p.model, rows) == pytest.approx(weights + kv, rel=1e-12)
    assert step_seconds(p, rows) == pytest.approx(memory + 0.002, rel=1e-12)


def test_prefill_step_is_flops_over_compute_and_tp_divides_both() -> None:
    p = SimProfile.load("llama3-70b-h100-tp4")
    # one 512-token chunk after 1024 cached tokens: compute-bound
    n, c = 512, 1024
    flops = 2 * 70.55e9 * n + 4 * 80 * 64 * 128 * (n * c + n * (n + 1) / 2)
    assert step_flops(p.model, [(n, c)]) == pytest.approx(flops, rel=1e-12)
    compute = flops / (4 * 989e12 * 0.6)
    memory = (70.55e9 * 2 + (c + n) * 327680) / (4 * 3.35e12 * 0.8)
    assert compute > memory
    assert step_seconds(p, [(n, c)]) == pytest.approx(compute + 0.002, rel=1e-12)
    assert step_seconds(p, []) == 0.0


def test_kv_blocks_are_the_gpus_memory_left_over_the_kv_per_token() -> None:
    p = SimProfile.load(H100_8B)
    budget = 0.9 * 81559 * 2**20 - 8.03e9 * 2 - 2 * 2**30
    assert p.kv_blocks(16) == int(budget // (131072 * 16))
    # each of 2 GPUs holds half the weights and half of each block
    p70 = SimProfile.load("llama3-70b-h200-tp2")
    budget = 0.9 * 143771 * 2**20 - 70.55e9 * 2 / 2 - 2 * 2**30
    assert p70.kv_blocks(16) == int(budget // (327680 / 2 * 16))


def test_pool_shape_fits_the_block_bytes() -> None:
    assert pool_shape(32, 16, 1024) == (8, 2)  # 2 x 8 layers x 16 tokens x 2 dims x 2 bytes
    assert pool_shape(32, 16, 4096) == (32, 2)
    assert pool_shape(32, 16, 16384) == (32, 8)
    assert pool_shape(80, 16, 64) == (1, 2)  # never less than one layer of head_dim 2


def test_token_draw_is_deterministic_in_range_and_never_eos() -> None:
    ids = [5, 6, 7]
    a = [draw_token(0, ids + [i], 100, avoid=(3,)) for i in range(300)]
    assert a == [draw_token(0, ids + [i], 100, avoid=(3,)) for i in range(300)]
    assert all(0 <= t < 100 for t in a) and 3 not in a
    assert len(set(a)) > 50  # spread over the vocabulary
    assert a != [draw_token(1, ids + [i], 100, avoid=(3,)) for i in range(300)]  # the seed matters


@pytest.fixture(scope="module")
def sim() -> SimEngine:
    engine = LLMEngine.from_config(EngineConfig(engine="sim", sim_output_len=5, block_size=16))
    assert isinstance(engine, SimEngine)
    return engine


def test_sim_engine_runs_the_real_scheduler_with_the_profiles_blocks(sim: SimEngine) -> None:
    assert sim.block_manager.num_blocks == SimProfile.load(H100_8B).kv_blocks(16)
    assert sim.kv_cache.spec.bytes_per_block == 1024
    prompt = list(range(10, 50))
    first = sim.generate([prompt, prompt], SamplingParams(max_tokens=20))
    assert first[0].token_ids == first[1].token_ids  # the same tokens so far, the same draw
    assert len(first[0].token_ids) == 5 and first[0].finish_reason == "stop"  # sim_output_len
    assert first[0].token_ids[-1] in sim.tokenizer.eos_token_ids
    longer = sim.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert longer.finish_reason == "length" and longer.token_ids[:4] == first[0].token_ids[:4]
    assert sim.block_manager.num_free_blocks == sim.block_manager.num_blocks


def test_each_step_is_timed_from_the_batch_it_ran(sim: SimEngine) -> None:
    prompt = list(range(100, 140))  # 40 tokens: one prefill step, then decode steps
    sim.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    profile = SimProfile.load(H100_8B)
    sim.step()
    assert sim.runner.last_duration == pytest.approx(step_seconds(profile, [(40, 0)]), rel=1e-12)  # type: ignore[attr-defined]
    sim.step()
    assert sim.runner.last_duration == pytest.approx(step_seconds(profile, [(1, 40)]), rel=1e-12)  # type: ignore[attr-defined]
    while sim.has_unfinished():
        sim.step()


def test_sim_refuses_what_needs_logits_and_settings_it_would_ignore(sim: SimEngine) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        sim.add_request([1, 2, 3], SamplingParams(max_tokens=2, logprobs=1))
    with pytest.raises(ValidationError, match="engine=sim"):
        EngineConfig(sim_seed=3)  # the torch engine would ignore it
    with pytest.raises(ValueError, match="tensor"):
        SimEngine(EngineConfig(engine="sim", tensor_parallel_size=2))


def test_calibration_takes_the_steps_excess_over_the_roofline_as_overhead() -> None:
    from splitserve.sim_calibrate import fit

    profile = SimProfile.load("llama3-8b-h200")
    batching = {"output_tokens": 3000, "continuous_tok_s": 1500.0, "continuous_steps": 400}  # 5 ms a step
    fitted, figures = fit(profile, {"gpu": "NVIDIA H200, 143771 MiB", "batching": batching}, 135_000_000)
    roofline = 135e6 * 2 / (4.8e12 * 0.8)
    assert fitted.efficiency.step_overhead_s == pytest.approx(0.005 - roofline, abs=1e-6)  # rounded to 1 us
    assert fitted.efficiency.bandwidth == profile.efficiency.bandwidth and fitted.name.endswith("-calibrated")
    assert figures["measured_step_ms"] == pytest.approx(5.0)
    with pytest.raises(ValueError, match="H100"):  # a run on another GPU does not fit this profile
        fit(profile, {"gpu": "NVIDIA H100 80GB HBM3", "batching": batching}, 135_000_000)
    with pytest.raises(ValueError, match="batching"):
        fit(profile, {"gpu": "NVIDIA H200", "batching": {"skipped": "no model"}}, 135_000_000)


def test_sim_fleet_gives_each_service_its_own_port_and_id() -> None:
    from splitserve.cli import build_parser
    from splitserve.sim_fleet import configs

    args = build_parser().parse_args(
        ["sim-fleet", "--prefill", "2", "--decode", "3", "--port", "9000", "--sim-profile", "llama3-8b-h200"]
    )
    cfgs, engine_cfg = configs(args)
    assert [(c.role, c.port) for c in cfgs] == [("prefill", 9000), ("prefill", 9001)] + [
        ("decode", p) for p in (9002, 9003, 9004)
    ]
    assert len({c.worker_name for c in cfgs}) == 5
    assert engine_cfg.engine == "sim" and engine_cfg.sim_profile == "llama3-8b-h200"
