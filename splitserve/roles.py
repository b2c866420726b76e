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

The answer says what the old pool looked like when it was let go. A route of a role this process
held before (a router still holding an old list) gets a retryable 503; a route of a role it never held
answers as it always did (404).

Every wait is bounded, so the call answers within drain_timeout_s + HANDBACK_WAIT_S + the stop's bounds
(common/service/base.py), and within drain_timeout_s + SWITCH_SLACK_S whatever happens: past that it
answers 202 and the switch goes on (GET /health tells the role). What would hold the event loop (joining
the engine thread, allocating the new pool, starting a KV transport) runs off it, so /health and the
streams still running keep being served during a switch. A pool whose KV transport did not close in
time (it may still have the memory registered) is kept, not freed. The old role's objects, frozen out of
the garbage collector's reach when the process first served (common/runtime/gc_pauses.py), are put back
in reach at the stop, so its reference cycles can be freed; the new role's are frozen once it started.
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
from common.runtime.gc_pauses import freeze_startup_heap
from common.service.base import Service, error_response

log = logging.getLogger(__name__)
Role = Literal["prefill", "decode"]
# a switch answers within drain_timeout_s plus this (hand-back, stop, new pool, start; each bounded)
SWITCH_SLACK_S = 60.0
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
        self.held: set[str] = {cfg.role}  # every role this process has served: their routes answer 503
        self.state = State()  # what server_config reads: told once the socket listens
        self.state.on_serving = lambda url: self.service._serving(url)
        self._switching = asyncio.Lock()
        self._switch: asyncio.Task[JSONResponse] | None = None
        self._exiting = False  # SIGTERM came: a switch under way does not start the new role
        self._kept: list[Any] = []  # pools not freed (their stop was not clean): kept alive, not reused

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
            if self._switching.locked() or (self._switch is not None and not self._switch.done()):
                return error_response(409, f"{self.cfg.worker_name} is already switching roles")
            # A task of its own: a caller that goes away does not leave the process half switched, and
            # the answer waits for it at most drain_timeout_s + SWITCH_SLACK_S (not wait_for: that would
            # cancel the switch).
            self._switch = task = asyncio.ensure_future(self.switch(wanted))
            done, _ = await asyncio.wait({task}, timeout=self.cfg.drain_timeout_s + SWITCH_SLACK_S)
            if done:
                return task.result()
            msg = f"{self.cfg.worker_name} is still switching to {wanted}: GET /health tells when it is done"
            return JSONResponse({"role": wanted, "switched": None, "message": msg}, status_code=202)

        return app

    async def drain(self) -> None:
        """SIGTERM: the current role's drain; a switch under way stops before starting the new role."""
        self._exiting = True
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
            if pool["free_blocks"] != pool["total_blocks"] or pool["leases_left"] or pool["unstopped_parts"]:
                log.error(
                    "%s: the %s pool was not whole when let go: %s", old.cfg.worker_name, old.cfg.role, pool
                )
            if self._exiting:
                return error_response(503, f"{old.cfg.worker_name} is exiting", {"Retry-After": "1"})
            engine = old.engine
            # the old role's objects were frozen out of the collector's reach once it served
            # (common/runtime/gc_pauses.py): back in reach, so its reference cycles can be freed
            gc.unfreeze()
            if pool["kv_released"]:  # let the pool's tensors go now: the new pool may need the memory
                kv = engine.kv_cache
                kv.k = kv.v = kv.k.new_empty(0)
                gc.collect()
            else:  # a transport may still have it registered: a write landing there must hit live memory
                self._kept.append(engine.kv_cache)
            self.held.add(role)
            try:
                # built off the event loop (the new pool is allocated, a KV transport starts), started on it
                app = await asyncio.to_thread(self._build, self.cfg.model_copy(update={"role": role}), engine)
                new = cast(Service, app.state.service)
                await new.start()
            except Exception:
                log.critical("%s: could not start as %s; exiting", old.cfg.worker_name, role, exc_info=True)
                old._engine_failed(f"role switch to {role} failed")
                raise
            self.app = app  # requests reach the new role only once it has started
            freeze_startup_heap()  # the new role's long-lived objects, as at a process start
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
        # a route of a role this process held before (a router's list is behind): retryable; of a role
        # it never held, the app answers as it always did (404)
        if scope["type"] == "http" and other in self.held and scope["path"] in ROLE_PATHS[other]:
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
                if self._switch is not None and not self._switch.done():  # bounded: see the docstring
                    await asyncio.wait({self._switch}, timeout=self.cfg.drain_timeout_s + SWITCH_SLACK_S)
                await self.service.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return
