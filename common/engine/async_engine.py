"""Runs an LLMEngine on its own thread for a service's asyncio side.

The engine and its block manager are single-threaded by design. Every change to them is a typed
command (common/engine/api.py) that the engine thread runs between two steps; what a step did goes
back to the event loop in one call_soon_threadsafe per step, each admission and output to the queue of
the request it belongs to. The forward pass releases the GIL, so the event loop keeps serving HTTP and
KV transfers while a step computes.

The engine's load goes the other way by publication, not by reading: after every step and every batch
of commands (and once at construction) the engine thread builds an `EngineLoad` and swaps it into
`load` (one reference assignment); the event loop only reads that value. The engine's state changes
only in steps and commands, so the last value is current while the engine is idle, and a command's
effect is in `load` before its caller resumes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from common.engine.api import Admission, Command, EngineLoad, TokenOutput
from common.engine.llm_engine import LLMEngine
from common.prefix_hash import KVEvent, KVHeld

log = logging.getLogger(__name__)

EngineEvent = Admission | TokenOutput
_Job = tuple[Command, "asyncio.Future[TokenOutput | None]"]
# a command run: its future, and its output or its exception (settled on the event loop)
_Done = tuple["asyncio.Future[TokenOutput | None]", TokenOutput | None, BaseException | None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._listeners: dict[str, asyncio.Queue[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.steps = 0
        self._load = engine.load()  # the engine thread has not started: no step or command runs yet
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
    @property
    def load(self) -> EngineLoad:
        """The engine's load as of its last step or command (see the module docstring)."""
        return self._load

    def kv_events(self) -> tuple[Callable[[], list[KVEvent]], Callable[[], list[KVHeld]]]:
        """Record the prefix cache's changes from now on; (drain, snapshot) for a KVEventPublisher. The
        block manager hands these over itself (common/kv/block_manager.py): the engine thread appends to
        an event deque that one other thread drains, and the snapshot copies the hash index, again if
        the engine thread changed it meanwhile."""
        bm = self.engine.block_manager
        bm.enable_kv_events()
        return bm.drain_kv_events, bm.cached_hashes

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

    def _settle_all(self, done: list[_Done]) -> None:
        for fut, out, error in done:
            if out is not None:  # the listener hears of it before the caller resumes
                self._deliver([out])
            self._settle(fut, out, error)

    # --- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        engine, loop = self.engine, self._loop
        assert loop is not None
        while not self._stop.is_set():
            block = not engine.has_unfinished()
            done: list[_Done] = []
            try:
                job = self._commands.get(block=block, timeout=0.5 if block else None)
                while job is not None:  # every queued command runs before the next step
                    done.append(self._apply(*job))
                    job = self._commands.get_nowait()
            except queue.Empty:
                pass
            if done:
                self._load = engine.load()  # before the callers resume: their commands show in it
                loop.call_soon_threadsafe(self._settle_all, done)
            if self._stop.is_set() or not engine.has_unfinished():
                continue
            try:
                result = engine.step()
                self._load = engine.load()
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

    def _apply(self, cmd: Command, fut: asyncio.Future[TokenOutput | None]) -> _Done:
        """Run cmd; its exception is handed to the awaiting side."""
        try:
            return fut, self.engine.handle(cmd), None
        except Exception as e:
            return fut, None, e
