"""The app's link to the engine: the handle (EngineProcess or anything with its interface), the
polling thread, and what the engine last said about itself (state, mode, info).

A worker thread polls the handle's event pipe and posts what it got as an `EngineEvents` message
to the app; the app's handler calls `apply`, which updates this object's state and returns the
batch sorted for the other components (`EngineUpdate`).

Invariants:
- Every event is posted once, in order. Messages go at most every `post_s` (POST_S; CPU_POST_S
  once the engine says it computes on this machine's CPU): events arriving sooner after the
  previous post are gathered into the next one, so a GPU-rate stream (a step every 2-3 ms) costs
  the UI one handler pass per frame, not one per step, and a CPU engine (a step every ~30 ms) is
  not handled token by token on the cores it computes on. Events after a quiet `post_s` (a first
  token, a lone event) are posted at once; a fatal error never waits.
- Each start bumps `generation`; batches of a replaced engine are dropped by `apply`.
- `state` is "starting" until the engine's EngineInfo arrives ("ready"), "failed" from its
  first fatal EngineError until a restart; `error` says why in one line.
- The engine child starts with SIGHUP (and SIGINT) blocked: a hangup (closed terminal, dropped
  SSH session) reaches the whole foreground process group, and the child must outlive it until
  the app has stored the replies in flight as "interrupted" and stops it.
- A handle given at construction was started before the app existed (fgchat.tui.build_app
  spawns the engine first, so its imports and model load overlap the UI's); the first `start`
  adopts it instead of making one, and `started_at` is then the launch time it was given.
- `ready_s` is the time from `started_at` to the EngineInfo that made the engine ready, taken
  when `apply` handles it (the moment a prompt can be sent); None until then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from textual.app import App
from textual.worker import get_current_worker

from fgchat.engine.process import terminal_signals_blocked
from fgchat.protocol.events import (
    MODES,
    EngineError,
    EngineInfo,
    EngineProgress,
    Mode,
    ModeChanged,
    RequestFinished,
    RequestNotice,
    RequestSummary,
    SamplingParams,
    StartupCheck,
    TokenEvent,
)
from fgchat.protocol.handle import EngineHandle
from fgchat.tui.messages import EngineEvents

POLL_S = 0.05
POST_S = 0.016  # at most one EngineEvents message per frame (~60 Hz)
CPU_POST_S = 0.1  # ... and 10 Hz while the engine computes on this machine's CPU (it needs the cores)
REMOTE_MODES = "the server decides how it runs"  # why a mode is unavailable on an endpoint


def _fatal(events: list) -> bool:
    return any(isinstance(ev, EngineError) and ev.fatal for ev in events)


@dataclass
class EngineUpdate:
    """One batch of engine events, sorted. `endings` keeps RequestFinished and EngineError in
    arrival order (a request can finish before a fatal error in the same batch)."""

    tokens: list[TokenEvent] = field(default_factory=list)
    finished: list[RequestSummary] = field(default_factory=list)
    endings: list[RequestFinished | EngineError] = field(default_factory=list)
    ready: EngineInfo | None = None  # the EngineInfo that made a starting engine ready
    mode_changes: list[ModeChanged] = field(default_factory=list)
    fatal: EngineError | None = None
    checked: StartupCheck | None = None  # the start-up check's result, in the first info carrying it
    notices: list[RequestNotice] = field(default_factory=list)


class EngineLink:
    """Engine lifecycle and state. `factory(config)` makes the handle; `handle`, when given, is
    one already started at `started_at` (time.monotonic()), adopted by the first `start`."""

    def __init__(self, app: App, config, factory: Callable[..., EngineHandle], handle: EngineHandle | None = None,
                 started_at: float | None = None) -> None:
        self.app = app
        self.config = config
        self._factory = factory
        self.handle = handle
        self._adopt = handle is not None
        self.generation = 0
        self.state = "starting"  # starting | ready | failed
        self.error = ""
        self.info: EngineInfo | None = None
        self.phase = ""  # what a starting engine is doing (EngineProgress)
        self.started_at = started_at if started_at is not None else time.monotonic()
        self.ready_s: float | None = None
        self.mode: Mode | str = Mode.EAGER  # REMOTE_MODE: a server that does not say how it runs
        configured = getattr(config, "mode", None)
        self.requested_mode: Mode | None = Mode(configured) if configured in MODES else None
        self.mode_note = ""  # why the engine did not switch as asked ("" when it did)
        # the mode that ran the latest decode step (TokenEvent.mode), None until one ran since the
        # last ModeChanged; it differs from `mode` only where the engine ran another than it chose
        self.ran_mode: Mode | None = None
        self.posted = 0  # EngineEvents messages posted (all engines of this link)
        self.post_s = POST_S  # shortest time between two EngineEvents messages

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start (or restart) the engine and its polling thread."""
        self.generation += 1
        self.state = "starting"
        self.error = ""
        self.phase = ""
        self.ready_s = None
        self.ran_mode = None
        if self._adopt:  # started before the app: keep its start time
            self._adopt = False
        else:
            self.started_at = time.monotonic()
            self.handle = self._factory(self.config)
            with terminal_signals_blocked():
                self.handle.start()
        self.handle.fit_context = True  # a chat outgrowing the context drops its oldest turns
        self.app.run_worker(partial(self._poll, self.handle, self.generation), thread=True,
                            exclusive=True, group="engine-poll", exit_on_error=False)

    def _poll(self, handle: EngineHandle, generation: int) -> None:
        worker = get_current_worker()
        posted_at = 0.0
        while not worker.is_cancelled:
            events = handle.get_events(POLL_S)
            if not events:
                continue
            fatal = _fatal(events)
            due = posted_at + self.post_s
            while not fatal and not worker.is_cancelled and (wait := due - time.monotonic()) > 0:
                more = handle.get_events(wait)
                events.extend(more)
                fatal = _fatal(more)
            self.posted += 1
            self.app.post_message(EngineEvents(events, generation))
            posted_at = time.monotonic()
            if fatal:
                return

    def restart(self) -> None:
        """A fresh engine in the mode the old one ran (or was asked for); the old one is shut
        down on a worker thread. Callers fail the replies in flight first."""
        old = self.handle
        self.app.workers.cancel_group(self.app, "engine-poll")
        if old is not None:
            self.app.run_worker(old.shutdown, thread=True, group="engine-stop")
        self.info = None
        wanted = self.requested_mode or self.mode
        self.start()
        self.requested_mode = wanted
        self.handle.set_mode(wanted)

    def shutdown(self) -> None:
        if self.handle is not None:
            try:
                self.handle.shutdown()
            except Exception:
                pass

    # ---- commands ------------------------------------------------------------------------
    def refusal(self) -> str:
        """Why nothing can be sent now ("" when the engine takes requests)."""
        return f"the engine is not running: {self.error}" if self.state == "failed" else ""

    def set_mode(self, mode: str) -> None:
        self.requested_mode = Mode(mode)
        self.mode_note = ""
        self.handle.set_mode(mode)

    def submit(self, messages: list[dict[str, str]], requests: list[tuple[int, SamplingParams]],
               thinking: bool | None = None) -> None:
        """The K requests of one prompt as one command; `thinking`: its enable_thinking."""
        self.handle.enable_thinking = thinking
        self.handle.submit_chats(messages, requests)

    def cancel(self, request_id: int) -> None:
        self.handle.cancel(request_id)

    # ---- what the engine said ------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """URL of the remote server behind the handle; "" for the local engine."""
        return self.info.endpoint if self.info is not None else ""

    def mode_label(self) -> str:
        """The mode of the latest decode step, with the chosen one where they differ, and a
        switch asked for but not confirmed: "full", "eager (chosen full)", "eager→full?"."""
        ran = self.ran_mode or self.mode
        label = str(ran) if ran == self.mode else f"{ran} (chosen {self.mode})"
        if self.requested_mode and self.requested_mode != self.mode:
            label += f"→{self.requested_mode}?"
        return label

    def unavailable_modes(self) -> dict[str, str]:
        """mode -> why it cannot run ("" when it can). On an endpoint every mode but the one
        it reports running is unavailable unless the server reports it as available."""
        available = dict(self.info.available_modes) if self.info is not None else {}
        if self.endpoint:
            for mode in MODES:
                if mode != self.mode:
                    available.setdefault(mode, REMOTE_MODES)
        return available

    def apply(self, message: EngineEvents) -> EngineUpdate | None:
        """Update the state from one polled batch; None for a replaced engine's late batch."""
        if message.generation != self.generation:
            return None
        update = EngineUpdate()
        for ev in message.events:
            if isinstance(ev, TokenEvent):
                update.tokens.append(ev)
                if not ev.is_first_token:  # a first token comes from the prefill
                    self.ran_mode = ev.mode
            elif isinstance(ev, RequestFinished):
                update.finished.append(ev.summary)
                update.endings.append(ev)
            elif isinstance(ev, ModeChanged):
                self.mode = ev.mode
                self.ran_mode = None
                self.mode_note = ev.reason
                self.requested_mode = None
                update.mode_changes.append(ev)
            elif isinstance(ev, EngineInfo):
                if ev.startup_check is not None and (self.info is None or self.info.startup_check is None):
                    update.checked = ev.startup_check
                self.info = ev
                self.mode = ev.mode
                if self.state == "starting":
                    self.state = "ready"
                    self.ready_s = time.monotonic() - self.started_at
                    update.ready = ev
            elif isinstance(ev, EngineProgress):
                self.phase = ev.phase
            elif isinstance(ev, RequestNotice):
                update.notices.append(ev)
            elif isinstance(ev, EngineError):
                update.endings.append(ev)
                if ev.fatal and update.fatal is None:
                    self.state = "failed"
                    self.error = ev.message
                    update.fatal = ev
        return update
