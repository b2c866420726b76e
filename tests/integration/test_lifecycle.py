"""One remote-KV request's whole life through two real engines in one process, with the services' own
KV connectors and engine commands: only the wire is replaced, by a sender that copies straight from
the prefill engine's cache into the decode engine's (the same connector calls a transport makes).

Checks what the other P/D systems got wrong (docs/architecture.md): the split request gives the tokens
of a plain run, token 0 appears once, a partial prefix hit on the decode side ships only the blocks it
lacks, a request whose KV did not fully arrive never decodes, a write under a stale fence writes
nothing, and every block is free on both sides afterwards.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from common.config import EngineConfig
from common.connector.decode import DecodeConnector
from common.connector.prefill import PrefillConnector
from common.connector.remote_kv import IncomingKV
from common.engine.api import AddRequest, Finish, KVArrived, TokenOutput
from common.engine.llm_engine import LLMEngine
from common.protocol import KVDone, PrefillRequest
from common.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
SYSTEM = "You are a concise assistant. Answer in one short sentence, and never add anything else."
MAX_TOKENS = 8


@dataclass
class CopySender:
    """The prefill side's sender for this test: what a transport does, minus the wire."""

    src: LLMEngine
    dst: LLMEngine
    owner: DecodeConnector
    drop_layer: int | None = None  # a write that "fails silently" (never lands)
    sent: list[tuple[int, list[int]]] = field(default_factory=list)  # (layer, destination blocks)

    async def send_layer(
        self, endpoint: str, request_id: str, fence: int, layer: int, src: list[int], dst: list[int],
        traceparent: str | None = None,
    ) -> None:  # fmt: skip
        if not self.owner.may_write(request_id, fence):
            return  # a stale fence: nothing is written
        self.sent.append((layer, dst))
        if layer == self.drop_layer:
            return
        self.dst.kv_cache.k[layer, dst] = self.src.kv_cache.k[layer, src]
        self.dst.kv_cache.v[layer, dst] = self.src.kv_cache.v[layer, src]
        self.owner.layer_arrived(request_id, fence, layer)

    async def send_done(self, endpoint: str, msg: KVDone) -> None:
        self.owner.kv_done(msg)


class Pair:
    def __init__(self, smollm) -> None:  # type: ignore[no-untyped-def]
        model, tok = smollm
        self.tok = tok
        self.arrived: dict[str, KVDone] = {}
        self.failed: dict[str, str] = {}
        self.dconn = DecodeConnector(self._arrived, self._failed)
        self.pconn = PrefillConnector(lambda endpoint: self.sender, lambda rkv, why: None)
        # P computes long prompts in chunks of 24 tokens: several chunks, blocks written twice
        self.p = LLMEngine(model, tok, EngineConfig(max_num_batched_tokens=24), connector=self.pconn)
        self.d = LLMEngine(model, tok, EngineConfig(), connector=self.dconn)
        self.sender = CopySender(self.p, self.d, self.dconn)

    def _arrived(self, rkv: IncomingKV, msg: KVDone) -> None:
        self.arrived[rkv.request_id] = msg

    def _failed(self, rkv: IncomingKV, why: str) -> None:
        self.failed[rkv.request_id] = why

    def prompt(self, question: str) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return self.tok.encode(self.tok.apply_chat_template(messages))

    async def split(self, rid: str, ids: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
        """Reserve on D, prefill on P (KV through the connectors), decode on D; the output ids."""
        self.d.handle(AddRequest(rid, ids, params, remote_kv="receive"))
        (admission,) = self.d.step().admitted
        reservation = self.reservation = await self.dconn.reserve(admission)
        req = PrefillRequest(rid, ids, params, "copy://d", reservation.block_ids, reservation.fence,
                             reservation.num_cached_tokens)  # fmt: skip
        outgoing = await self.pconn.add(req)
        self.p.handle(AddRequest(rid, ids, params.replace(max_tokens=1, min_tokens=0), remote_kv="send"))
        first: TokenOutput | None = None
        while first is None:  # the engine thread: its connector posts each layer's writes to this loop
            first = next((o for o in (await asyncio.to_thread(self.p.step)).outputs if o.finished), None)
        token0 = first.token_ids[0]
        await self.pconn.finish_sending(outgoing, token0, len(ids))
        await self.pconn.settle(outgoing)
        self.p.handle(Finish(rid, "sent"))
        if rid not in self.arrived:
            await self.dconn.end(reservation, _idle)
            self.d.handle(Finish(rid, "abort"))
            return [token0], None
        await self.dconn.release_lease(reservation)
        out: list[int] = [token0]
        end = self.d.handle(KVArrived(rid, token0))
        while end is None:
            for o in self.d.step().outputs:
                assert o.index == len(out), "every token once, in order"
                out += o.token_ids
                end = o if o.finished else None
        await self.dconn.end(reservation, _idle)
        return out, end.finish_reason

    def assert_all_free(self) -> None:
        for engine in (self.p, self.d):
            bm = engine.block_manager
            bm.check_integrity()
            assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.parked
        assert not self.pconn.requests and not self.dconn.requests


async def _idle(request_id: str) -> None:
    """CopySender writes synchronously: nothing is ever still landing."""


@pytest.fixture(scope="module")
def pair(smollm) -> Pair:  # type: ignore[no-untyped-def]
    return Pair(smollm)


def test_split_request_gives_the_plain_run_tokens_and_token_zero_once(pair: Pair, smollm) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = pair.prompt("What is the capital of France?")
    want = LLMEngine(model, tok, EngineConfig()).generate([ids], params)[0].token_ids
    got, reason = asyncio.run(pair.split("r1", ids, params))
    assert got == want and reason == "length"
    chunks = -(-len(ids) // 24)
    assert len(pair.sender.sent) == chunks * model.config.num_layers  # one write per layer per chunk
    pair.assert_all_free()


def test_a_partial_prefix_hit_on_decode_ships_only_the_missing_blocks(pair: Pair, smollm) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    warm = pair.prompt("Name three colors.")
    pair.d.generate([warm], params)  # D now holds the system prompt's blocks in its prefix cache
    ids = pair.prompt("How many legs does a spider have?")
    want = LLMEngine(model, tok, EngineConfig()).generate([ids], params)[0].token_ids
    pair.sender.sent.clear()
    got, _ = asyncio.run(pair.split("r2", ids, params))
    assert got == want
    held = pair.reservation.num_cached_tokens // pair.d.block_manager.block_size
    assert held > 0, "the decode service reused its cached system prompt"
    sent = {b for _, dst in pair.sender.sent for b in dst}
    assert sent == set(pair.reservation.block_ids[held:]), "exactly the blocks the decode side lacked"
    pair.assert_all_free()


def test_kv_that_did_not_fully_arrive_is_never_decoded(pair: Pair) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    pair.sender.drop_layer = 3
    try:
        got, reason = asyncio.run(pair.split("r3", pair.prompt("2+2="), params))
    finally:
        pair.sender.drop_layer = None
    assert reason is None and len(got) == 1, "only token 0: the decode side never ran it"
    assert pair.failed["r3"].startswith("KV incomplete:") and "r3" not in pair.arrived
    pair.assert_all_free()


def test_a_write_under_a_stale_fence_writes_nothing(pair: Pair) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = pair.prompt("Why is the sky blue?")

    async def main() -> None:
        pair.d.handle(AddRequest("r4", ids, params, remote_kv="receive"))
        (admission,) = pair.d.step().admitted
        reservation = await pair.dconn.reserve(admission)
        await pair.dconn.end(reservation, _idle)  # aborted before the prefill service wrote anything
        before = pair.d.kv_cache.k[:, admission.block_ids].clone()
        pair.sender.sent.clear()
        await pair.sender.send_layer("copy://d", "r4", reservation.fence, 0, [0], admission.block_ids[:1])
        assert not pair.sender.sent and bool((pair.d.kv_cache.k[:, admission.block_ids] == before).all())
        pair.d.handle(Finish("r4", "abort"))

    asyncio.run(main())
    pair.assert_all_free()
