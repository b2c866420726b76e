"""What SLO-aware admission predicts a request's TTFT and TPOT from: the engine's fits of a prompt step's
time as fixed + per token and of a decode step's as fixed + per sequence (common/engine/speed.py), and the
router's predictions from them (router/slo.py), with the averages as the fallback until a fit exists.
The real engine publishes the fits (tests/integration/test_bench_slo_predict.py runs it through the
bench); `splitserve bench slo-predict` measures their accuracy."""

from __future__ import annotations

import pytest

from common.engine.speed import StepSpeed
from router.slo import predict_tpot_ms, predict_ttft_ms


def feed(speed: StepSpeed, sizes: list[int], fixed_ms: float, per_token_ms: float, decode: int = 0) -> None:
    for n in sizes:
        speed.observe((fixed_ms + per_token_ms * (n + decode)) / 1000.0, n, decode)


def test_the_fit_recovers_a_steps_fixed_and_per_token_cost() -> None:
    speed = StepSpeed()
    feed(speed, [24, 24, 400, 24, 96, 24, 400] * 3, fixed_ms=55.0, per_token_ms=1.2)
    assert speed.prefill_step_ms == pytest.approx(55.0, rel=1e-6)
    assert speed.prefill_ms_per_token == pytest.approx(1.2, rel=1e-6)
    # the average it replaces: tokens per second over the recent steps, mostly short ones
    assert 400 / speed.prefill_tps * 1000 > 1.3 * (55 + 1.2 * 400)
    # and a worker's capacity, a full step's tokens per second (what the planner sizes prefill by), is
    # above that average, which is mostly short steps' fixed cost
    assert speed.full_step_tps(512) == pytest.approx(512 / (55 + 1.2 * 512) * 1000, rel=1e-6)
    assert speed.full_step_tps(512) > 1.3 * speed.prefill_tps
    assert StepSpeed().full_step_tps(512) == 0.0  # nothing measured


def test_mixed_steps_count_their_decode_rows_as_tokens() -> None:
    speed = StepSpeed()
    feed(speed, [16, 200, 16, 300, 16, 200] * 2, fixed_ms=40.0, per_token_ms=0.5, decode=8)
    assert speed.prefill_step_ms == pytest.approx(40.0, rel=1e-6)
    assert speed.prefill_ms_per_token == pytest.approx(0.5, rel=1e-6)


def test_no_fit_from_steps_of_one_size_and_none_from_too_few() -> None:
    same = StepSpeed()
    feed(same, [128] * 20, fixed_ms=30.0, per_token_ms=1.0)
    assert same.prefill_ms_per_token == 0.0 and same.prefill_step_ms == 0.0 and same.prefill_tps > 0
    few = StepSpeed()
    feed(few, [24, 400], fixed_ms=30.0, per_token_ms=1.0)
    assert few.prefill_ms_per_token == 0.0  # two steps weigh less than FIT_MIN_WEIGHT


def test_a_fit_with_no_fixed_part_is_proportional() -> None:
    """Steps whose time is less than proportional at the small end would fit a negative fixed part:
    the fit is then proportional through the mean instead."""
    speed = StepSpeed()
    for n in [10, 500, 10, 500, 10, 500]:
        speed.observe((0.1 * n if n == 10 else 1.0 * n) / 1000.0, n, 0)
    assert speed.prefill_step_ms == 0.0 and speed.prefill_ms_per_token > 0


def test_a_fit_stands_while_later_steps_are_all_alike() -> None:
    speed = StepSpeed()
    feed(speed, [24, 400] * 4, fixed_ms=50.0, per_token_ms=1.0)
    feed(speed, [400] * 40, fixed_ms=50.0, per_token_ms=1.0)
    assert speed.prefill_step_ms == pytest.approx(50.0, rel=1e-6)


def test_the_router_predicts_from_the_fit_and_the_steps_the_work_takes() -> None:
    load = {"queued_tokens": 700, "prefill_tps": 500.0, "prefill_step_ms": 50.0,
            "prefill_ms_per_token": 1.0, "step_tokens": 512, "decode_step_ms": 20.0}  # fmt: skip
    # 700 queued + 300 new = 1000 tokens: 2 steps of at most 512
    assert predict_ttft_ms(load, 300, local=False) == pytest.approx(2 * 50 + 1000 * 1.0)
    assert predict_ttft_ms(load, 300, local=True) == pytest.approx(2 * 50 + 1000 + 20)
    assert predict_ttft_ms({**load, "step_tokens": 0}, 300, local=False) == pytest.approx(50 + 1000)


def test_the_router_falls_back_to_tokens_per_second_until_the_fit_exists() -> None:
    load = {"queued_tokens": 0, "prefill_tps": 500.0, "prefill_step_ms": 0.0, "prefill_ms_per_token": 0.0}
    assert predict_ttft_ms(load, 250, local=False) == pytest.approx(500.0)
    assert predict_ttft_ms({"queued_tokens": 0}, 250, local=False) is None  # nothing measured: no guess
    old = {"queued_tokens": 0, "prefill_tps": 500.0}  # a service from before the fit publishes neither
    assert predict_ttft_ms(old, 250, local=False) == pytest.approx(500.0)


def test_the_decode_fit_recovers_a_steps_fixed_and_per_sequence_cost() -> None:
    speed = StepSpeed()
    for batch in [1, 2, 4, 8, 16, 3, 1, 6] * 2:
        speed.observe((70.0 + 0.5 * batch) / 1000.0, 0, batch)
    assert speed.decode_step_fixed_ms == pytest.approx(70.0, rel=1e-6)
    assert speed.decode_ms_per_seq == pytest.approx(0.5, rel=1e-6)


def test_a_decode_step_that_does_not_grow_with_its_batch_fits_flat() -> None:
    """Step times that fall with the batch (noise around a flat line, as on this CPU at small batches) are
    a flat fit, not none: one more sequence costs nothing."""
    speed = StepSpeed()
    for batch, ms in [(1, 77.0), (4, 76.0), (2, 76.5), (8, 75.5), (1, 77.2), (6, 75.8)]:
        speed.observe(ms / 1000.0, 0, batch)
    assert speed.decode_ms_per_seq == 0.0 and 75.0 < speed.decode_step_fixed_ms < 77.5


def test_the_router_predicts_tpot_from_the_decode_fit_and_falls_back_to_the_old_rule() -> None:
    fitted = {"running": 3, "decode_step_ms": 80.0, "decode_step_fixed_ms": 70.0, "decode_ms_per_seq": 2.0}
    assert predict_tpot_ms(fitted) == pytest.approx(70.0 + 2.0 * 4)
    flat = {"running": 1, "decode_step_ms": 76.0, "decode_step_fixed_ms": 76.0, "decode_ms_per_seq": 0.0}
    assert predict_tpot_ms(flat) == pytest.approx(76.0)  # the old rule said 152 (2x): refused wrongly
    old = {"running": 1, "decode_step_ms": 76.0}
    assert predict_tpot_ms(old) == pytest.approx(152.0)  # no fit yet: the step as proportional to its batch
    assert predict_tpot_ms({"running": 0}) is None
