"""The one engine behind `fgchat serve`, shared by every HTTP request.

A pump thread reads the engine handle's events and hands each batch to the event loop; there
`dispatch` routes every request's events to the asyncio queue of the HTTP request that owns it.

Invariants:
- All state below is touched on the event loop thread only (the pump only calls
  `loop.call_soon_threadsafe`).
- A request id counts against capacity from `submit` until the engine says it ended
  (RequestFinished, its EngineError, or a fatal error), not until its HTTP response ends: a
  client that goes away or a stop string cancels the request, and the slot frees when the engine
  confirms. Capacity = ENGINE_SLOTS running + max_queue waiting; past it `submit` raises Busy.
- A detached request's later events are dropped (after metrics).
- After a fatal engine error every routed request gets that error and `submit` raises
  Unavailable; the server keeps answering (503) instead of dying.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fgchat.protocol.events import (
    MODES,
    EngineError,
    EngineInfo,
    EngineProgress,
    ModeChanged,
    RequestFinished,
    SamplingParams,
    TokenEvent,
)
from fgchat.protocol.config import MAX_BATCH
from fgchat.protocol.handle import EngineHandle
from fgchat.serve.metrics import ServeMetrics

ENGINE_SLOTS = MAX_BATCH
MODE_SWITCH_TIMEOUT_S = 120.0  # a first switch to full may capture graphs


class Busy(Exception):
    """The engine's running batch and its wait queue are full."""


class Unavailable(Exception):
    """The engine stopped (message: why)."""


class Stopped(Exception):
    """The caller of wait_for_info asked it to stop waiting."""


@dataclass
class RequestGroup:
    """The engine requests of one HTTP request: choice i is engine request rids[i]."""

    rids: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # (choice index, event)


@dataclass
class _Active:
    started: bool = False  # got its first token (running, not waiting)


class EngineHub:
    def __init__(self, handle: EngineHandle, info: EngineInfo, mode: str, max_queue: int,
                 metrics: ServeMetrics | None = None) -> None:
        self.handle = handle
        self.info = info
        self.mode = mode
        self.capacity = ENGINE_SLOTS + max_queue
        self.metrics = metrics or ServeMetrics()
        self.metrics.set_mode(mode)
        self.failed = ""  # the fatal error's message once the engine stopped
        self._ids = itertools.count(1)
        self._active: dict[int, _Active] = {}
        self._routes: dict[int, tuple[RequestGroup, int]] = {}
        self._mode_waiters: list[asyncio.Future] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    def start_pump(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pump = threading.Thread(target=self._pump_events, name="fgchat-serve-pump", daemon=True)
        self._pump.start()

    def _pump_events(self) -> None:
        while not self._stop.is_set():
            events = self.handle.get_events(0.05)
            if events and self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self.dispatch, events)
                except RuntimeError:  # the loop closed: the server is stopping
                    return
            if self.handle.failed and not events:
                return

    def stop_requests(self, reason: str) -> None:
        """End every request in flight with `reason`, as a fatal engine error does (a stream's
        error chunk and [DONE], a 503 for the others), and refuse new ones. On the loop."""
        self._error(EngineError(reason, fatal=True))

    def close(self) -> None:
        self._stop.set()
        if self._pump is not None:
            self._pump.join(2.0)
        self.handle.shutdown()

    # ---- requests ---------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return sum(1 for a in self._active.values() if a.started)

    @property
    def waiting(self) -> int:
        return len(self._active) - self.running

    def submit(self, messages: list[dict[str, str]] | str, params: list[SamplingParams]) -> RequestGroup:
        """Submit len(params) replies to `messages` as one batch; Busy or Unavailable if not now."""
        if self.failed:
            raise Unavailable(self.failed)
        if len(self._active) + len(params) > self.capacity:
            self.metrics.rejected.inc()
            raise Busy(f"server busy: {len(self._active)} requests in flight, room for {self.capacity}")
        group = RequestGroup([next(self._ids) for _ in params])
        for i, rid in enumerate(group.rids):
            self._active[rid] = _Active()
            self._routes[rid] = (group, i)
        self.handle.submit_chats(messages, list(zip(group.rids, params)))
        self._gauges()
        return group

    def detach(self, group: RequestGroup) -> None:
        """Stop routing the group's events; cancel what still runs."""
        for i, rid in enumerate(group.rids):
            self._routes.pop(rid, None)
            self.cancel(group, i)

    def cancel(self, group: RequestGroup, index: int) -> None:
        """Cancel choice `index` if it still runs; its events (the engine's RequestFinished) are
        still routed."""
        rid = group.rids[index]
        if rid in self._active and not self.failed:
            self.handle.cancel(rid)

    async def set_mode(self, mode: str) -> ModeChanged:
        """Ask the engine for `mode`; returns its answer (an unavailable mode falls back to eager)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode '{mode}' (choose {', '.join(MODES)})")
        if self.failed:
            raise Unavailable(self.failed)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._mode_waiters.append(fut)
        self.handle.set_mode(mode)
        try:
            return await asyncio.wait_for(fut, MODE_SWITCH_TIMEOUT_S)
        finally:
            if fut in self._mode_waiters:
                self._mode_waiters.remove(fut)

    # ---- events (on the loop) ---------------------------------------------------------------
    def dispatch(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, TokenEvent):
                self.metrics.token(ev)
                if ev.request_id in self._active:
                    self._active[ev.request_id].started = True
                self._route(ev.request_id, ev)
            elif isinstance(ev, RequestFinished):
                self.metrics.request(ev.summary, self.mode)
                self._active.pop(ev.summary.request_id, None)
                self._route(ev.summary.request_id, ev, last=True)
            elif isinstance(ev, EngineError):
                self._error(ev)
            elif isinstance(ev, ModeChanged):
                self.mode = ev.mode
                self.metrics.set_mode(ev.mode)
                for fut in self._mode_waiters:
                    if not fut.done():
                        fut.set_result(ev)
                self._mode_waiters.clear()
            elif isinstance(ev, EngineInfo):
                self.info = ev
        self._gauges()

    def _error(self, ev: EngineError) -> None:
        if ev.fatal:
            self.failed = ev.message
            for rid in list(self._routes):
                self._route(rid, EngineError(ev.message, rid, fatal=True), last=True)
            self._active.clear()
            for fut in self._mode_waiters:
                if not fut.done():
                    fut.set_exception(Unavailable(ev.message))
            return
        if ev.request_id is not None:
            self._active.pop(ev.request_id, None)
            self._route(ev.request_id, ev, last=True)

    def _route(self, rid: int, ev: Any, last: bool = False) -> None:
        target = self._routes.pop(rid, None) if last else self._routes.get(rid)
        if target is not None:
            group, index = target
            group.queue.put_nowait((index, ev))

    def _gauges(self) -> None:
        self.metrics.running.set(self.running)
        self.metrics.waiting.set(self.waiting)


def wait_for_info(handle: EngineHandle, timeout_s: float, on_phase: Callable[[str], None] | None = None,
                  stopped: Callable[[], bool] | None = None) -> tuple[EngineInfo, str, list]:
    """Block until the started handle sends EngineInfo: (info, mode, events after it). A fatal
    error while loading raises Unavailable with its one-line message; `stopped()` turning true
    raises Stopped within about 0.1 s."""
    deadline = time.monotonic() + timeout_s
    info: EngineInfo | None = None
    rest: list = []
    while time.monotonic() < deadline:
        if stopped is not None and stopped():
            raise Stopped()
        for ev in handle.get_events(0.1):
            if isinstance(ev, EngineError) and ev.fatal:
                raise Unavailable(ev.message)
            if info is None and isinstance(ev, EngineInfo):
                info = ev
            elif info is None and on_phase is not None and isinstance(ev, EngineProgress):
                on_phase(ev.phase)
            elif info is not None:
                rest.append(ev)
        if info is not None:
            return info, str(info.mode), rest
    raise Unavailable(f"the engine did not start within {timeout_s:.0f} s")
