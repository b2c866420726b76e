"""Runs an LLMEngine on its own thread for a service's asyncio side.

The engine and its block manager are single-threaded by design. Every change to them (add, abort,
kv_arrived, release) is a command the engine thread runs between two steps; results and events go
back to the event loop with call_soon_threadsafe. The forward pass releases the GIL, so the event
loop keeps serving HTTP and KV transfers while a step computes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from common.engine.llm_engine import LLMEngine, RequestOutput
from common.engine.sequence import Sequence
from common.protocol import ErrorFrame

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Admitted:
    """The request got its KV blocks (a reservation, or admission to local prefill)."""

    seq: Sequence
    block_ids: list[int]
    num_cached_tokens: int


Event = RequestOutput | Admitted | ErrorFrame  # ErrorFrame: the service ends the request itself


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_layer_done: Callable[[LLMEngine, int], None] | None = None,
        after_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_layer_done = on_layer_done
        self._after_step = after_step
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._listeners: dict[str, asyncio.Queue[Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.steps = 0

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)  # wake the thread
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- asyncio side -----------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps; returns its result (or raises)."""
        assert self._loop is not None, "start() first"
        fut: asyncio.Future[T] = self._loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting side
                self._loop.call_soon_threadsafe(_set_exception, fut, e)  # type: ignore[union-attr]
            else:
                self._loop.call_soon_threadsafe(_set_result, fut, result)  # type: ignore[union-attr]

        self._commands.put(command)
        return await fut

    def listen(self, request_id: str) -> asyncio.Queue[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        self._listeners[request_id] = q
        return q

    def unlisten(self, request_id: str, q: asyncio.Queue[Event] | None = None) -> None:
        """Stop listening; with q, only if q is still the listener (a retry may reuse the id)."""
        if q is None or self._listeners.get(request_id) is q:
            self._listeners.pop(request_id, None)

    def emit(self, request_id: str, event: Event) -> None:
        """Deliver an event to the request's listener (callable from the engine thread)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, request_id, event)

    def _deliver(self, request_id: str, event: Event) -> None:
        q = self._listeners.get(request_id)
        if q is not None:
            q.put_nowait(event)

    # --- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            block = not engine.has_unfinished()
            try:
                cmd = self._commands.get(block=block, timeout=0.5 if block else None)
                cmd()
                while True:  # run every queued command before the next step
                    self._commands.get_nowait()()
            except queue.Empty:
                pass
            if self._stop.is_set() or not engine.has_unfinished():
                continue
            try:
                self._step()
            except Exception:
                log.exception("engine step failed")
                raise

    def _step(self) -> None:
        engine = self.engine
        hook = None
        if self._on_layer_done is not None:
            cb = self._on_layer_done

            def hook(layer: int) -> None:
                cb(engine, layer)

        outputs = engine.step(on_layer_done=hook)
        self.steps += 1
        step = engine.last_step
        if step is not None:
            for seq in step.admitted:
                self.emit(seq.seq_id, Admitted(seq, list(seq.block_table), seq.num_cached_tokens))
        for out in outputs:
            self.emit(out.request_id, out)
        if self._after_step is not None:
            self._after_step(engine, outputs)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
