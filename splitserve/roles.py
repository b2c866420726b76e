"""Role switching: one service process that serves as prefill or decode, and changes role without a
restart when asked (the planner, an operator).

`RoleHost` is the process's ASGI app. It runs the lifespan itself and hands every HTTP request to the
current role's app (prefill_service/app.py or decode_service/app.py). Each of those apps gets one more
route, `POST /internal/role` (JSON `{"role": "decode"}`), signed like every /internal/ call (the
app's InternalAuthMiddleware checks it before the handler runs). A switch:

    drain        the service leaves the registry; new work gets a retryable 503
    finish       what runs finishes (a prefill its transfer, a decode stream its tokens), up to
                 drain_timeout_s; the rest is handed back (a decode stream closes without an error
                 frame and the router migrates it; a prefill call answers 503)
    stop         heartbeat, leases, records, KV receiver, engine thread; the pool is counted (every
                 block free, no transfer left) and its tensors let go
    start        the other role's service on the same weights and tokenizer (no reload), with a fresh
                 KV pool, under the same worker id and a NEW incarnation: routers see a new process
                 (and callers learn the new signing audience from /health)

The answer says what the old pool looked like when it was let go. A route of the other role (a router
still holding an old list) gets a retryable 503, never a 404.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from typing import Any, Literal, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import State
from starlette.types import Receive, Scope, Send

from common.config import EngineConfig, ServiceConfig
from common.engine.llm_engine import LLMEngine
from common.service.base import Service, error_response

log = logging.getLogger(__name__)
Role = Literal["prefill", "decode"]
ROLE_PATHS: dict[str, tuple[str, ...]] = {  # the routes only one role has
    "prefill": ("/internal/prefill",),
    "decode": ("/internal/generate", "/internal/kv"),
}


def _create_app(cfg: ServiceConfig, engine_cfg: EngineConfig, reuse: LLMEngine | None) -> FastAPI:
    if cfg.role == "decode":
        from decode_service.app import create_app
    else:
        from prefill_service.app import create_app
    return create_app(cfg, engine_cfg, reuse)


class RoleHost:
    """The ASGI app of a service process that can change role (see the module docstring)."""

    def __init__(self, cfg: ServiceConfig, engine_cfg: EngineConfig) -> None:
        # the worker id stays the same in every role (the default one names the role it started in)
        self.cfg = cfg.model_copy(update={"worker_id": cfg.worker_name})
        self.engine_cfg = engine_cfg
        self.app = self._build(self.cfg, None)
        self.state = State()  # what server_config reads: told once the socket listens
        self.state.on_serving = lambda url: self.service._serving(url)
        self._switching = asyncio.Lock()

    @property
    def service(self) -> Service:
        return cast(Service, self.app.state.service)

    def _build(self, cfg: ServiceConfig, reuse: LLMEngine | None) -> FastAPI:
        app = _create_app(cfg, self.engine_cfg, reuse)

        @app.post("/internal/role")
        async def role(request: Request) -> JSONResponse:
            try:
                wanted = json.loads(await request.body())["role"]
            except (ValueError, KeyError, TypeError):
                return error_response(400, 'the body must be JSON {"role": "prefill" | "decode"}')
            if wanted not in ("prefill", "decode"):
                return error_response(400, f"role must be 'prefill' or 'decode', not {wanted!r}")
            if self.engine_cfg.tensor_parallel_size > 1:  # the worker ranks would have to switch too
                return error_response(400, "role switching with tensor_parallel_size > 1 is not supported")
            if self._switching.locked():
                return error_response(409, f"{self.cfg.worker_name} is already switching roles")
            # shielded: a caller that goes away does not leave the process half switched
            return await asyncio.shield(asyncio.ensure_future(self.switch(wanted)))

        return app

    async def drain(self) -> None:
        """SIGTERM: the current role's drain."""
        await self.service.drain()

    async def switch(self, role: Role) -> JSONResponse:
        async with self._switching:
            old = self.service
            if old.cfg.role == role:
                return JSONResponse({"role": role, "incarnation": old.incarnation, "switched": False})
            if old.draining:
                return error_response(409, f"{old.cfg.worker_name} is draining", {"Retry-After": "1"})
            log.warning("%s: switching %s -> %s", old.cfg.worker_name, old.cfg.role, role)
            pool = await old.retire()
            if pool["free_blocks"] != pool["total_blocks"] or pool["leases_left"]:
                log.error(
                    "%s: the %s pool was not whole when let go: %s", old.cfg.worker_name, old.cfg.role, pool
                )
            engine = old.engine
            kv = engine.kv_cache  # let the pool's tensors go now: the new pool may need the memory
            kv.k = kv.v = kv.k.new_empty(0)
            gc.collect()
            try:
                self.app = self._build(self.cfg.model_copy(update={"role": role}), engine)
                await self.service.start()
            except Exception:
                log.critical("%s: could not start as %s; exiting", old.cfg.worker_name, role, exc_info=True)
                old._engine_failed(f"role switch to {role} failed")
                raise
            new = self.service
            log.warning(
                "%s: now %s (incarnation %s -> %s)",
                new.cfg.worker_name,
                role,
                old.incarnation,
                new.incarnation,
            )
            body = {"role": role, "incarnation": new.incarnation, "previous_incarnation": old.incarnation}
            return JSONResponse({**body, "switched": True, "released": pool})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        role = self.service.cfg.role
        other = "decode" if role == "prefill" else "prefill"
        if scope["type"] == "http" and scope["path"] in ROLE_PATHS[other]:
            msg = f"{self.cfg.worker_name} serves as {role} now"
            await error_response(503, msg, {"Retry-After": "1"})(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Start and stop whichever role's service is current (the apps' own lifespans do not run)."""
        while True:
            message: Any = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.service.start()
                except Exception as e:
                    await send({"type": "lifespan.startup.failed", "message": repr(e)})
                    raise
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.service.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return
