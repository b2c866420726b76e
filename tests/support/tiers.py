"""What the KV offload tier tests share: their prompts and request order, requests run one at a time over an
engine with tiers, and a tier's figures."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from common.engine.llm_engine import LLMEngine
from common.kv.layer_loads import LayerLoads
from common.kv.tiers import TierStats, TierStore
from common.prefix_hash import prefix_chain
from common.sampling_params import SamplingParams

WAIT_S = 30  # how long a test waits for the tiers' writer to catch up
QUESTIONS = [  # ~60-70 tokens each (3-4 full blocks of 16), ~90 after a chat template's system prompt
    "Describe, step by step, how a bicycle converts the rider's pedaling into forward motion, "
    "mentioning the chain, the gears and the wheels. Then say what changes when the rider shifts to a "
    "lower gear on a steep hill, and why riding downhill in the highest gear feels so different from "
    "riding uphill in the lowest one.",
    "Write a short note to a neighbour asking them to water the tomato plants on the balcony while "
    "you are away for the weekend, and thank them. Mention that the watering can is behind the door, "
    "that the small pots need less water than the big ones, and that they may pick any ripe tomatoes "
    "they find while you are gone.",
    "Explain why the sky looks blue during the day and red or orange at sunset, in words a ten year "
    "old would understand, with one everyday example. Then explain why clouds look white or grey, and "
    "why the sky on the moon looks black even in the middle of the day when the sun is shining.",
]
ORDER = [0, 1, 2, 0, 1, 2, 0]  # prompt 0 is evicted twice by request 4: on disk for request 6
LONG = ORDER + [1, 2]  # prompts 1 and 2 on disk for requests 7 and 8


def run_in_turn(
    engine: LLMEngine,
    prompts: list[list[int]],
    order: list[int],
    params: SamplingParams,
    before: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """The requests `order` names, one at a time; before each, the tiers' writes are done (a condition,
    not a sleep) and `before(i)` may inject a fault. The block manager's integrity is checked after."""
    outs = []
    for i, p in enumerate(order):
        if engine.kv_offload is not None:
            assert engine.kv_offload.store.wait_idle(WAIT_S), "the tier writer never caught up"
        if before is not None:
            before(i)
        outs.append(engine.generate([prompts[p]], params)[0].token_ids)
    engine.block_manager.check_integrity()
    return outs


def tier(engine: LLMEngine, name: str) -> TierStats:
    """The figures of the engine's `name` tier ("ram" or "disk")."""
    assert engine.kv_offload is not None
    return next(t for t in engine.kv_offload.stats().tiers if t.tier == name)


def damage(store: TierStore, prompt: list[int], fault: str) -> None:
    """Damage every disk record holding a block of this prompt: "truncated" (half its bytes),
    "checksum" (one bit of one K/V value flipped) or "missing" (deleted)."""
    assert store.disk is not None and store.slot is not None
    keys = {store.disk.where[h][0] for h in prefix_chain(prompt, 16) if h in store.disk.where}
    assert keys, "the disk tier holds none of the prompt's blocks"
    for key in keys:
        f = store.slot / f"{key:016x}.kv"
        data = bytearray(f.read_bytes())
        if fault == "truncated":
            f.write_bytes(data[: len(data) // 2])
        elif fault == "checksum":
            data[len(data) - 1000] ^= 0x01  # one bit of one K/V value
            f.write_bytes(data)
        elif fault == "missing":
            f.unlink()


def slow_copier(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tier reads put in layer by layer (common/kv/layer_loads.py) copy each slot only once a reader asked
    for it (`LayerLoads.wait`: a layer's wait, or a settle): a layer that read its pages without waiting
    finds what they held before. A condition, no sleep; a new load starts unasked."""
    asked: dict[int, int] = {}  # id(LayerLoads) -> the highest slot a reader asked for
    cv = threading.Condition()
    real_add, real_wait, real_copy = LayerLoads.add, LayerLoads.wait, LayerLoads._copy_slot

    def add(self: LayerLoads, *a: object) -> None:
        with cv:
            asked[id(self)] = -1
        real_add(self, *a)  # type: ignore[arg-type]

    def wait(self: LayerLoads, slot: int) -> None:
        with cv:
            asked[id(self)] = max(asked.get(id(self), -1), slot)
            cv.notify_all()
        real_wait(self, slot)

    def copy(self: LayerLoads, load: object, slot: int) -> None:
        with cv:
            assert cv.wait_for(lambda: asked.get(id(self), -1) >= slot, WAIT_S), (
                f"no reader asked for slot {slot}"
            )
        real_copy(self, load, slot)  # type: ignore[arg-type]

    monkeypatch.setattr(LayerLoads, "add", add)
    monkeypatch.setattr(LayerLoads, "wait", wait)
    monkeypatch.setattr(LayerLoads, "_copy_slot", copy)
