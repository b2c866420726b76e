"""The prefill service's HTTP app.

POST /internal/prefill (msgpack PrefillRequest) -> msgpack PrefillResult, answered once every layer
was sent and kv_done (with the first token and the fence) was delivered to the decode service.
/health, /metrics, /internal/abort come from the common app factory.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, Response

from common.config import EngineConfig, ServiceConfig
from common.engine.llm_engine import LLMEngine
from common.protocol import PrefillRequest
from common.service.base import read_message
from prefill_service.service import PrefillService


def create_app(cfg: ServiceConfig, engine_cfg: EngineConfig, reuse: LLMEngine | None = None) -> FastAPI:
    """reuse: a role switch's engine whose weights the new one serves (splitserve/roles.py)."""
    svc = PrefillService(cfg, engine_cfg, reuse)
    app = svc.make_app()

    @app.post("/internal/prefill")
    async def prefill(request: Request) -> Response:
        return await svc.prefill(await read_message(request, PrefillRequest))

    return app
