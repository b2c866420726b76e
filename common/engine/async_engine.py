"""Runs an LLMEngine on its own thread for a service's asyncio side.

The engine and its block manager are single-threaded by design. Every change to them is a typed
command (common/engine/api.py) that the engine thread runs between two steps; what a step did goes
back to the event loop in one call_soon_threadsafe per step, each admission and output to the queue of
the request it belongs to. The forward pass releases the GIL, so the event loop keeps serving HTTP and
KV transfers while a step computes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from common.engine.api import Admission, Command, TokenOutput
from common.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

EngineEvent = Admission | TokenOutput
_Job = tuple[Command, "asyncio.Future[TokenOutput | None]"]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._listeners: dict[str, asyncio.Queue[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.steps = 0
        # A step that raised leaves the engine in an unknown state (a half-run step, a tensor-parallel
        # rank gone): `failure` says why, and `on_fatal(why)` runs on the engine thread. A service
        # exits there, so that its peers' leases and the routers' migration take over its requests.
        self.failure: str | None = None
        self.on_fatal: Callable[[str], None] | None = None

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def stopping(self) -> bool:
        """stop() was called."""
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)  # wake the thread
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- asyncio side -----------------------------------------------------------------------------
    async def submit(self, cmd: Command) -> TokenOutput | None:
        """Run cmd on the engine thread between steps; its result (an output it caused, also delivered
        to the request's listener first), or its exception."""
        assert self._loop is not None, "start() first"
        if self.failure is not None:
            raise RuntimeError(self.failure)
        fut: asyncio.Future[TokenOutput | None] = self._loop.create_future()
        self._commands.put((cmd, fut))
        return await fut

    def listen(self, request_id: str, q: asyncio.Queue[Any]) -> None:
        """Deliver the request's admissions and outputs to q (which may carry the service's own events)."""
        self._listeners[request_id] = q

    def unlisten(self, request_id: str, q: asyncio.Queue[Any]) -> None:
        """Stop delivering, if q is still the request's listener."""
        if self._listeners.get(request_id) is q:
            del self._listeners[request_id]

    def _deliver(self, events: list[EngineEvent]) -> None:
        for ev in events:
            q = self._listeners.get(ev.request_id)
            if q is not None:
                q.put_nowait(ev)

    def _settle(self, fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    # --- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        engine, loop = self.engine, self._loop
        assert loop is not None
        while not self._stop.is_set():
            block = not engine.has_unfinished()
            try:
                job = self._commands.get(block=block, timeout=0.5 if block else None)
                while job is not None:  # every queued command runs before the next step
                    self._apply(*job)
                    job = self._commands.get_nowait()
            except queue.Empty:
                pass
            if self._stop.is_set() or not engine.has_unfinished():
                continue
            try:
                result = engine.step()
            except Exception as e:
                log.exception("engine step failed")
                self._fail(f"engine step failed: {e!r}")
                return  # logged; the thread ends with it
            self.steps += 1
            events: list[EngineEvent] = [*result.admitted, *result.outputs]
            if events:
                loop.call_soon_threadsafe(self._deliver, events)

    def _fail(self, why: str) -> None:
        """No step runs any more: every waiting command fails with why, and so does any later one."""
        self.failure = why
        loop = self._loop
        assert loop is not None
        while True:
            try:
                job = self._commands.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                loop.call_soon_threadsafe(self._settle, job[1], None, RuntimeError(why))
        if self.on_fatal is not None:
            self.on_fatal(why)

    def _apply(self, cmd: Command, fut: asyncio.Future[TokenOutput | None]) -> None:
        assert self._loop is not None
        try:
            out = self.engine.handle(cmd)
        except Exception as e:  # handed to the awaiting side
            self._loop.call_soon_threadsafe(self._settle, fut, None, e)
            return
        if out is not None:  # the listener hears of it before the caller resumes
            events: list[EngineEvent] = [out]
            self._loop.call_soon_threadsafe(self._deliver, events)
        self._loop.call_soon_threadsafe(self._settle, fut, out, None)
