"""DeepSeek MLA across the split (issue 28): the latent is what moves, once.

Real processes over loopback (a prefill and a decode service, tcp KV transfer, Redis), serving the tiny
random-weight deepseek_v3 model transformers builds in test_model_archs.py (latent: kv_lora_rank 32 +
qk_rope_head_dim 8 per token and layer; 4 query heads). For prompts of 40 tokens:

* the split path's greedy tokens (prefill computes the prompt and the first token, the decode service
  continues from the transferred latents) equal transformers' `generate` and the decode service's own
  local path, without and with tensor parallelism (TP 2 on both sides: each rank holds two query heads
  and the whole latent);
* the prefill service moves exactly one latent per token and layer to each decode rank, all of it from
  its rank 0 (a latent is the same on every rank: rank 1 sends nothing), never per-head K and V.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.integration.test_model_archs import ARCHS, VOCAB, build
from tests.integration.test_services import run_request
from tests.integration.test_services_tensor_parallel import _sent_bytes, _wait_for
from tests.support.cluster import Cluster, internal_auth

pytestmark = pytest.mark.services
PROMPT = 40  # 3 blocks of the services' 16
NEW_TOKENS = 12
SERVICE_BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    folder = build(tmp_path_factory.mktemp("deepseek_v3") / "model", ARCHS["deepseek_v3"])
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return folder, hf


def _ids(seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _transformers_greedy(hf: Any, ids: list[int]) -> list[int]:
    out = hf.generate(
        torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 2), (1, 2), (2, 1)])
def test_split_greedy_equals_transformers_and_one_latent_moves(  # type: ignore[no-untyped-def]
    model, redis_url, tmp_path, prefill_tp, decode_tp
) -> None:
    folder, hf = model
    cfg = json.loads((folder / "config.json").read_text())
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    layers = cfg["num_hidden_layers"]
    cluster = Cluster(redis_url, str(tmp_path), model=str(folder))
    env = {"SPLITSERVE_DTYPE": "float32"}
    flags = ("--threads", "1", "--kv-backend", "tcp")
    try:
        prefill = cluster.start("prefill", *flags, "--tensor-parallel-size", str(prefill_tp), env=env)
        decode_ = cluster.start("decode", *flags, "--tensor-parallel-size", str(decode_tp), env=env)
        info = httpx.get(decode_.url + "/internal/kv", auth=internal_auth).json()
        assert len(info["kv_endpoint"].split(",")) == decode_tp

        async def run(ids: list[int], mode: str) -> list[int]:
            async with httpx.AsyncClient(timeout=120, auth=internal_auth) as c:
                tokens, _ = await run_request(c, decode_.url, prefill.url, ids, mode, NEW_TOKENS)
            return tokens

        per_request = layers * -(-PROMPT // SERVICE_BLOCK) * SERVICE_BLOCK * latent * 4  # fp32, one copy
        for n, seed in enumerate((1, 2), start=1):
            ids = _ids(seed)
            want = _transformers_greedy(hf, ids)
            split = asyncio.run(run(ids, "remote"))
            # a random model may draw its eos (2) early: then the service stops there
            assert split == want[: len(split)] and (len(split) == NEW_TOKENS or split[-1] == 2), (split, want)
            assert asyncio.run(run(ids, "local")) == split
            # every decode rank got the latent once, all of it from the prefill's rank 0
            want_bytes = n * decode_tp * per_request
            sent = _wait_for(lambda: _sent_bytes(prefill.url), lambda r, b=want_bytes: r.get("0") == b)
            assert sent == {"0": want_bytes}, (sent, per_request)
        for proc in (prefill, decode_):
            h = cluster.wait_blocks_free(proc)
            assert h["free_blocks"] == h["total_blocks"], f"{proc.role} leaked blocks: {h}"
    finally:
        cluster.stop()
