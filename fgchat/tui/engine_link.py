"""The engine side of FgchatApp: starting/restarting the engine process, polling its event pipe
on a worker thread, and applying the events (tokens, finished requests, mode changes, errors).

Invariants:
- Each engine start bumps a generation; events from a replaced engine are dropped.
- Every token and finished request is recorded in the latency log before any UI update.
- A fatal engine error fails every in-flight reply (partial text kept) and shows a banner.
- The engine child starts with SIGHUP blocked: a hangup (closed terminal, dropped SSH session)
  reaches the whole foreground process group, and the child must outlive it until the app has
  stored the replies in flight as "interrupted" and stops it.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections import deque

from textual import work
from textual.content import Content
from textual.widgets import Static
from textual.worker import get_current_worker

from fgchat.protocol.events import EngineError, EngineInfo, EngineProgress, ModeChanged, RequestFinished, TokenEvent
from fgchat.tui.chat_view import ChatView
from fgchat.tui.console import HIST_WINDOW, RECENT_ITL
from fgchat.tui.messages import EngineEvents


@contextlib.contextmanager
def _hangup_blocked():
    """Block SIGHUP in this thread while a child is started: the mask is inherited through fork
    and exec, so the engine child never sees a hangup (it is stopped by the app, or exits when
    the app is gone). A SIGHUP for the app meanwhile is taken by another thread or
    stays pending until the block ends: never lost."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class EngineLinkMixin:
    """FgchatApp's engine lifecycle and event handling (`self.engine`, `self._engine_gen`,
    `self.engine_*`, the batch/ITL statistics)."""

    def start_engine(self) -> None:
        """Start (or restart) the engine and its polling thread."""
        self._engine_gen += 1
        self.engine_state = "starting"
        self.engine_error = ""
        self.engine_phase = ""
        self.engine_started_at = time.monotonic()
        self.engine = self._engine_factory(self.config)
        with _hangup_blocked():
            self.engine.start()
        self._poll_engine(self.engine, self._engine_gen)
        self._dirty = True

    @work(thread=True, exclusive=True, group="engine-poll", exit_on_error=False)
    def _poll_engine(self, engine, generation: int) -> None:
        worker = get_current_worker()
        while not worker.is_cancelled:
            events = engine.get_events(0.05)
            if not events:
                continue
            self.post_message(EngineEvents(events, generation))
            if any(isinstance(ev, EngineError) and ev.fatal for ev in events):
                return

    async def _apply_engine_events(self, message: EngineEvents) -> None:
        if message.generation != self._engine_gen:
            return  # a replaced engine's late events
        texts: dict[int, list[str]] = {}
        endings: list[object] = []
        for ev in message.events:
            if isinstance(ev, TokenEvent):
                self._record_token(ev, texts)
            elif isinstance(ev, RequestFinished):
                chat_id = self._rid_chat.get(ev.summary.request_id, "")
                self.latency_log.add_request(ev.summary, chat_id)
                endings.append(ev)
            elif isinstance(ev, ModeChanged):
                self._mode_changed(ev)
            elif isinstance(ev, EngineInfo):
                self.engine_info = ev
                self.engine_mode = ev.mode
                if self.engine_state == "starting":
                    self.engine_state = "ready"
                    self.sub_title = ev.model_name
                    check = ev.startup_check
                    if check is not None and not check.passed:
                        self.notify(check.message, title="startup check failed", severity="warning",
                                    timeout=30)
            elif isinstance(ev, EngineProgress):
                self.engine_phase = ev.phase
            elif isinstance(ev, EngineError):
                endings.append(ev)
        for rid, parts in texts.items():
            reply = self.replies.get(rid)
            if reply is not None:
                await reply.bubble.append("".join(parts))
                view = reply.bubble.parent
                if isinstance(view, ChatView):
                    view.call_after_refresh(view.follow)
        for ev in endings:
            if isinstance(ev, RequestFinished):
                await self._finish_reply(ev.summary)
            elif isinstance(ev, EngineError):
                await self._engine_error(ev)
        if not self.replies:
            self.batch_size_now = 0
        self._dirty = True

    def _record_token(self, ev: TokenEvent, texts: dict[int, list[str]]) -> None:
        self.latency_log.add_token(ev, self._rid_chat.get(ev.request_id, ""))
        if not ev.is_first_token:
            self.batch_size_now = ev.batch_size
            self.last_batch_size = ev.batch_size
            self.batch_sizes_seen[ev.batch_size] += 1
            if ev.itl_ms is not None:
                self.itl_history.setdefault(ev.mode, deque(maxlen=HIST_WINDOW)).append(ev.itl_ms)
                self.recent_itl.append(ev.itl_ms)
                if len(self.recent_itl) > RECENT_ITL:
                    del self.recent_itl[: len(self.recent_itl) - RECENT_ITL]
        reply = self.replies.get(ev.request_id)
        if reply is not None:
            reply.tokens += 1
            if ev.text:
                texts.setdefault(ev.request_id, []).append(ev.text)

    def _mode_changed(self, ev: ModeChanged) -> None:
        self.engine_mode = ev.mode
        self.mode_note = ev.reason
        if ev.reason:
            self.notify(ev.reason, title=f"running {ev.mode}", severity="warning", timeout=6)
        self.requested_mode = None
        self._update_subtitle()

    async def _engine_error(self, ev: EngineError) -> None:
        if ev.fatal:
            loaded = self.engine_info is not None
            self.engine_state = "failed"
            self.engine_error = ev.message
            # the banner goes up before any await, so "failed" is never visible without it
            banner = self.query_one("#engine-banner", Static)
            if loaded:
                banner.update(Content(
                    f"✖ engine stopped: {ev.message}\nPartial replies and the latency log are kept. "
                    "Restart it from the command palette (ctrl+p → Restart engine)."
                ))
            else:
                banner.update(Content(f"✖ model failed to load: {ev.message}"))
            banner.display = True
            self.notify(ev.message, title="engine stopped" if loaded else "model failed to load",
                        severity="error", timeout=15)
            for rid in list(self.replies):
                await self._fail_reply(rid, ev.message)
            return
        if ev.request_id is not None and ev.request_id in self.replies:
            await self._fail_reply(ev.request_id, ev.message)
        self.notify(ev.message, title="request failed", severity="error", timeout=8)

    async def action_restart_engine(self) -> None:
        for rid in list(self.replies):
            await self._fail_reply(rid, "engine restarted")
        old = self.engine
        self.workers.cancel_group(self, "engine-poll")
        if old is not None:
            self.run_worker(old.shutdown, thread=True, group="engine-stop")
        self.engine_info = None
        self.query_one("#engine-banner", Static).display = False
        self.start_engine()
        if self.requested_mode is None:
            self.requested_mode = self.engine_mode
        self.engine.set_mode(self.requested_mode)
        self.notify("engine restarting…", timeout=3)
