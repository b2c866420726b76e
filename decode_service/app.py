"""The decode service's HTTP app.

POST /internal/generate (msgpack GenerateRequest) answers with length-prefixed msgpack frames:
  Reserved   once the request holds its blocks (remote mode: where the prefill service must write)
  TokenFrame output tokens (remote mode from index 1: token 0 is the prefill service's), the last
             with a finish_reason
  ErrorFrame if the request fails
Closing the response aborts the request and frees its blocks.
GET /internal/kv: the KV endpoint, backend and transfer counters. /health, /metrics, /internal/abort
come from the common app factory.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request, Response

from common.config import EngineConfig, ServiceConfig
from common.engine.llm_engine import LLMEngine
from common.protocol import GenerateRequest
from common.service.base import read_message
from decode_service.service import DecodeService


def create_app(cfg: ServiceConfig, engine_cfg: EngineConfig, reuse: LLMEngine | None = None) -> FastAPI:
    """reuse: a role switch's engine whose weights the new one serves (splitserve/roles.py)."""
    svc = DecodeService(cfg, engine_cfg, reuse)
    app = svc.make_app()

    @app.post("/internal/generate")
    async def generate(request: Request) -> Response:
        return await svc.generate(await read_message(request, GenerateRequest))

    @app.get("/internal/kv")
    async def kv_info() -> dict[str, Any]:
        ranks = {
            str(r): asdict(s) for r, s in svc.receiver_stats().items()
        }  # tensor parallelism: each rank's
        stats = ranks["0"]
        return {"kv_endpoint": svc.kv_endpoint, "backend": svc.kv_backend, "stats": stats, "ranks": ranks}

    return app
