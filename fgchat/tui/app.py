"""fgchat's Textual app: chats in tabs on the left, the latency console on the right.

The app composes components that each own their state:
- `EngineLink` (engine_link.py): the engine handle, its polling thread, generation and state;
- `LatencyConsole` (latency_console.py): the latency log and the panel's view of it;
- `Replies` (replies.py): the requests in flight, from submission to their stored end;
- `ChatTabs` (chat_tabs.py): the chat views and every chat action;
- `SamplingChoice` (sampling.py): model defaults + user overrides, K replies per prompt;
- `LogFiles` (log_files.py): ctrl+s exports and --log-csv;
- `StoreGuard` (store_guard.py): chat store calls that never end the app.
The app itself owns the layout, the key bindings (bindings.py), the engine-event dispatch and exit.

Data flow: the link's worker thread posts `EngineEvents` (a fast stream's batches gathered into
at most one message per frame); the handler lets the link update its state, records every
token and finished request in the latency log, then buffers text in the replies' bubbles, drawn
at most every TEXT_S (replies.py). A 10 Hz timer redraws the console when something shown
changed (coalesced, so a fast stream never makes the UI fall behind); a separate 1 s timer
appends --log-csv rows. What a token costs the UI thread is its share of one handler pass;
redraws (each a layout of the whole screen) are paced by time, not by tokens.

Invariants:
- Nothing a user produced is lost: user turns are stored when sent, replies when they finish,
  stop, fail or when the app exits (partial text, finish="interrupted"); the latency log only
  grows and survives failed exports and engine deaths.
- Every latency row carries the session id (one per app run), so rows of two sessions in one
  --log-csv never collide; request ids are unique for the app's lifetime.
- A fatal engine error puts the banner up before any await, so "failed" is never visible
  without it; every in-flight reply then fails with its partial text kept.
- SIGTERM and SIGHUP (a closed terminal, a dropped SSH session) end the app like ctrl+q: partial
  replies stored (finish="interrupted"), --log-csv flushed, the engine stopped, then exit status
  128 + signal number. A second signal during that shutdown is ignored.
- A broken chat store never ends the app: a store that cannot be opened read-write is opened
  read-only (immutable in a read-only directory), else replaced by an in-memory one (one
  warning), and every later store call is guarded. At exit, every chat the store lacks is
  written to a JSON file (beside the latency logs, else in the temp dir) named in one line.
"""

from __future__ import annotations

import gc
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header, Input, Static, TabbedContent

from fgchat.engine.heap import freeze_heap
from fgchat.engine.process import EngineProcess
from fgchat.engine.startup_trace import startup_mark
from fgchat.protocol.handle import EngineHandle
from fgchat.metrics import CsvAppender, new_session_id
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import MODES, EngineError, SamplingParams
from fgchat import exit_signals
from fgchat.tui.bindings import APP_BINDINGS
from fgchat.tui.chat_tabs import ChatTabs
from fgchat.tui.dialogs import ExportScreen, MessageScreen, SamplingScreen
from fgchat.tui.engine_link import CPU_POST_S, EngineLink, EngineUpdate
from fgchat.tui.help_screen import HelpScreen
from fgchat.tui.latency_console import CPU_REFRESH_S, REFRESH_S, LatencyConsole, PanelStatus
from fgchat.tui.latency_panel import LatencyPanel
from fgchat.tui.log_files import SYNC_S, LogFiles
from fgchat.tui.messages import EngineEvents
from fgchat.tui.palette import fgchat_commands
from fgchat.tui.prompt_input import PromptInput
from fgchat.tui.replies import CPU_DRAW_SHARE, Replies
from fgchat.tui.sampling import MAX_SAMPLES, SamplingChoice
from fgchat.tui.speculation import SpecToggle
from fgchat.tui.store import ChatStore, Settings, usable_data_dir
from fgchat.tui.store_guard import StoreGuard, log_problem
from fgchat.tui.themes import BUILTIN_THEME_DIR, DEFAULT_THEME, load_themes
from fgchat.tui.thinking import THINKING_LABELS

EngineFactory = Callable[..., EngineHandle]
EXIT_SIGNALS = exit_signals.EXIT_SIGNALS
SHUTDOWN_GRACE_S = 3.0  # after a signal (data already stored): longest wait for the UI to close


def open_store(path: Path, problem: str = "") -> tuple[ChatStore, str]:
    """The chat store at `path`, else the same read-only, else an in-memory one; plus a one-line
    warning when it is not the normal read-write store ("" when it is)."""
    if not problem:
        try:
            return ChatStore(path), ""
        except FgchatError as exc:
            problem = str(exc)
        if path.exists():
            try:
                store = ChatStore(path, read_only=True)
            except FgchatError:
                pass
            else:
                return store, f"{problem}: opened read-only; chats changed now are written to a file at exit"
    return ChatStore(":memory:"), f"{problem}: chats are kept in memory and written to a file at exit"


class FgchatApp(App[int]):
    """Chat + latency console. `engine_factory(config)` returns an EngineHandle
    (protocol.handle); default EngineProcess."""

    CSS_PATH = "app.tcss"
    TITLE = "fgchat"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (34, "-tall")]

    BINDINGS = APP_BINDINGS

    def __init__(
        self,
        config,
        *,
        engine_factory: EngineFactory | None = None,
        log_csv: CsvAppender | None = None,
        sampling: SamplingParams | None = None,
        data_path: Path | None = None,
        session_id: str | None = None,
        engine: EngineHandle | None = None,
        launched_at: float | None = None,
    ) -> None:
        """`engine`: a handle already started (fgchat.tui.build_app spawns it before importing the
        UI), used for the first start instead of one from `engine_factory`. `launched_at`: the
        time.monotonic() the start-up time ("ready in X s") counts from; default the engine's
        own start (the app's mount when it makes the engine)."""
        super().__init__()
        self.startup_warnings: list[str] = []  # shown once the app is mounted
        dir_problem = ""
        if data_path is None:
            data_path, dir_problem = usable_data_dir()
        self.data_path = data_path
        self.settings = Settings(self.data_path / "settings.json")
        self.startup_warnings += self.settings.problems
        self.store, store_problem = open_store(self.data_path / "chats.sqlite3", dir_problem)
        if store_problem:
            self.startup_warnings.append(store_problem)
        self.guard = StoreGuard(self.store, self.data_path,
                                lambda text: self.notify(text, severity="error", timeout=8))
        self.sampling = SamplingChoice(self.settings, sampling or SamplingParams(max_tokens=1024))
        self.startup_warnings += self.sampling.problems
        # one id per app run, on every latency row it writes: rows of two sessions never collide
        self.session_id = session_id or getattr(log_csv, "session_id", None) or new_session_id()
        self.latency = LatencyConsole(self.session_id)
        if launched_at is None and engine is not None:
            launched_at = engine.started_at
        self.link = EngineLink(self, config, engine_factory or (
            lambda cfg: EngineProcess(cfg, log_path=self.data_path / "engine.log")),
            handle=engine, started_at=launched_at)
        self.replies = Replies(self.link, self.sampling, self.guard)
        self.spec = SpecToggle(getattr(config, "speculate", "off"), getattr(config, "draft", None))
        self.log_files = LogFiles(self.latency.log, self.settings, self.data_path, log_csv, self.notify)
        self._flushed = False
        self.kept_log_note = ""  # at exit: where the unwritten latency log went, or why it could not
        self.unsaved_note = ""  # at exit: the chats the store lacks and the file they went to
        self._text_timer: Timer | None = None  # draws buffered reply text when it is due
        self.exit_signal: int | None = None  # SIGTERM/SIGHUP that ended the app, if one did
        self._previous_handlers: dict[int, object] = {}
        # run_tui sets it: after a signal, os._exit if the UI has not closed in SHUTDOWN_GRACE_S
        # (never in tests that drive the app in-process)
        self.exit_watchdog = False
        self.notices: list[tuple[str, str]] = []  # (severity, text) of every notification shown
        self._context_notes: dict[str, str] = {}  # chat id -> the last "context full" notice shown
        themes, self.theme_problems = load_themes([BUILTIN_THEME_DIR, self.data_path / "themes"])
        for theme in themes:
            self.register_theme(theme)
        self.file_themes = [t.name for t in themes]

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat-column"):
                yield Static(id="engine-banner")
                yield ChatTabs(self.replies, self.settings, id="chats")
                yield PromptInput(placeholder="Message · Enter sends · Esc stops · F10 help", id="prompt")
            yield LatencyPanel(id="latency")
        yield Footer(compact=True)

    async def on_mount(self) -> None:
        self._previous_handlers = exit_signals.install(self.exit_on_signal)
        for warning in self.startup_warnings:
            self.notify(warning, severity="warning", timeout=15)
        wanted = self.settings.get("theme") or DEFAULT_THEME
        if wanted in self.available_themes:
            self.theme = wanted
        elif DEFAULT_THEME in self.available_themes:
            self.theme = DEFAULT_THEME
        self.theme_changed_signal.subscribe(self, lambda theme: self.settings.set("theme", theme.name))
        for problem in self.theme_problems:
            self.notify(problem, severity="warning")
        await self.chats.new_chat()
        self.query_one("#engine-banner", Static).display = False
        self.link.start()
        self.set_interval(REFRESH_S, self._redraw)
        if self.log_files.appender is not None:
            self.set_interval(SYNC_S, self.log_files.sync)
        self._update_subtitle()
        self.query_one("#prompt", Input).focus()
        startup_mark("ui: mounted")

    @property
    def chats(self) -> ChatTabs:
        return self.query_one(ChatTabs)

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity="information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """Notifications default to plain text here: engine messages and paths may contain '['."""
        self.notices.append((severity, f"{title}: {message}" if title else message))
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def get_theme_variable_defaults(self) -> dict[str, str]:
        """$spec-drafted (accepted drafted tokens) for themes that do not set it: their success text."""
        return {"spec-drafted": self.current_theme.to_color_system().generate()["text-success"]}

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield from fgchat_commands(self)

    # ------------------------------------------------------------------ engine events
    @on(EngineEvents)
    async def _engine_events(self, message: EngineEvents) -> None:
        update = self.link.apply(message)
        if update is None:
            return  # a replaced engine's late events
        if update.fatal is not None:
            self._show_engine_stopped(update.fatal)  # before any await
        endpoint = self.link.endpoint
        self.latency.record_tokens(update.tokens, self.replies.chat_of, endpoint)
        self.latency.record_requests(update.finished, self.replies.chat_of, endpoint)
        texts = self.replies.count(update.tokens)
        if self.link.info is not None:
            self.spec.confirmed(self.link.info)
        if update.ready is not None:
            self._engine_ready()
        check = update.checked
        if check is not None and not check.passed:
            self.notify(check.message, title="startup check failed", severity="warning", timeout=30)
        for notice in update.notices:  # once per chat until what is left out changes
            chat = self.replies.chat_of(notice.request_id)
            if self._context_notes.get(chat) != notice.message:
                self._context_notes[chat] = notice.message
                self.notify(notice.message, title=notice.title, severity="warning", timeout=10)
        for change in update.mode_changes:
            if change.reason:
                self.notify(change.reason, title=f"running {change.mode}", severity="warning", timeout=6)
        if update.mode_changes:
            self._update_subtitle()
        if self.replies.buffer(texts):
            await self._show_text()
        else:
            self._schedule_text()
        await self._apply_endings(update)
        if not self.replies:
            self.latency.idle()
            if update.endings:
                self.call_after_refresh(self._settle_heap)

    async def _show_text(self) -> None:
        """Draw the replies' buffered text (Replies paces it: at most every TEXT_S), and the
        console when its redraw is due, as one batch: one layout of the screen for all."""
        if self._text_timer is not None:
            self._text_timer.stop()
            self._text_timer = None
        if self._flushed or not self.screen_stack:  # exiting: replies are stored, nothing to draw
            return
        started = time.thread_time()
        with self.batch_update():
            await self.replies.show()
            self._redraw(early=REFRESH_S / 2)  # the console in the same frame when nearly due
        if self.screen_stack:
            self.screen.check_idle()  # the frame held back by the batch
        self.call_after_refresh(lambda: self.replies.drawn(time.thread_time() - started))

    def _schedule_text(self) -> None:
        """Buffered text not due yet: one timer draws it when it is."""
        delay = self.replies.show_in()
        if delay is not None and self._text_timer is None:
            self._text_timer = self.set_timer(delay, self._text_due)

    async def _text_due(self) -> None:
        self._text_timer = None
        await self._show_text()

    async def _apply_endings(self, update: EngineUpdate) -> None:
        for ev in update.endings:
            if not isinstance(ev, EngineError):
                await self.replies.finish(ev.summary)
            elif ev.fatal:
                await self.replies.fail_all(ev.message)
            else:  # the notice first: whoever sees the reply ended sees why
                self.notify(ev.message, title="request failed", severity="error", timeout=8)
                if ev.request_id is not None:
                    await self.replies.fail(ev.request_id, ev.message)

    def _engine_ready(self) -> None:
        startup_mark("ui: ready")
        # the UI's long-lived objects (modules, widgets) out of the cyclic collector's walks: a full
        # collection of ~90,000 objects stalled a streaming reply for 40-115 ms (engine.heap)
        freeze_heap(collect=True)
        info = self.link.info
        if info.device == "cpu":  # the engine computes on the cores this UI runs on: draw less often
            self.replies.draw_share, self.latency.refresh_s = CPU_DRAW_SHARE, CPU_REFRESH_S
            self.link.post_s = CPU_POST_S
            self.query_one("#prompt", Input).cursor_blink = False  # a blink is a frame every 0.5 s
        self.sampling.set_defaults(info.sampling_defaults, info.sampling_source)
        self._update_subtitle()
        if self.link.ready_s is not None:
            self.notify(f"{info.model_name} ready in {self.link.ready_s:.1f} s", timeout=4)

    def _settle_heap(self) -> None:
        """No reply in flight (the last one's frame drawn): the whole heap is collected, cyclic
        garbage among objects frozen before included (removed bubbles, closed tabs, replaced
        caches), and frozen again (engine.heap). A full collection walks every object not frozen,
        and chats and the log only grow: the collections while replies stream then walk only what
        those replies make, however long the session. The whole walk happens here, between rounds."""
        if not self.replies and not self._flushed:
            gc.unfreeze()
            freeze_heap(collect=True)

    def _show_engine_stopped(self, ev: EngineError) -> None:
        loaded = self.link.info is not None
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

    async def action_restart_engine(self) -> None:
        await self.replies.fail_all("engine restarted")
        self.query_one("#engine-banner", Static).display = False
        self.link.restart()
        self.notify("engine restarting…", timeout=3)

    # ------------------------------------------------------------------ console
    def _panel_status(self) -> PanelStatus:
        link = self.link
        return PanelStatus(
            mode=link.mode, ran_mode=link.ran_mode or "", requested_mode=link.requested_mode, mode_note=link.mode_note,
            unavailable=tuple(sorted(link.unavailable_modes().items())),
            samples=self.sampling.samples, sampling=self.sampling.label(),
            active_replies=len(self.replies), info=link.info, engine_state=link.state,
            engine_error=link.error, engine_phase=link.phase,
            starting_s=time.monotonic() - link.started_at, ready_s=link.ready_s,
            last_export=self.log_files.last_export, speculate=self.spec.current(link.info),
        )

    def _redraw(self, early: float = 0.0) -> None:
        """The console, when something shown changed and a rebuild is due (or due within
        `early` seconds)."""
        if self._flushed:
            return
        view = self.latency.rebuild(self._panel_status(), early)
        if view is None:
            return
        try:
            self.query_one(LatencyPanel).show(view)
            chats = self.chats
        except NoMatches:  # shutting down
            return
        self._update_subtitle()
        for chat in chats.views():
            chats.update_label(chat.conversation)

    def _update_subtitle(self) -> None:
        """"model · mode · weights · batch B · K k · sampling · its source" (the weights' format,
        e.g. Q4_1, once the engine has said it; a remote endpoint's are not known)."""
        link = self.link
        mode = self.spec.label(link.mode_label(), link.info, self.latency.view.spec)
        if link.info is not None and link.info.weights and not link.info.endpoint:
            mode = f"{mode} · {link.info.weights}"
        if link.state == "failed":
            model = "engine stopped"
        else:
            model = link.info.model_name if link.info else "loading…"
        thinking = self.sampling.thinking
        think = "" if thinking is None else f"thinking {THINKING_LABELS[thinking]} · "
        self.sub_title = (f"{model} · {mode} · batch {self.latency.batch_size_now} · "
                          f"K {self.sampling.samples} · {think}{self.sampling.label()}")

    # ------------------------------------------------------------------ sending and actions
    @on(TabbedContent.TabActivated)
    def _tab_activated(self) -> None:
        self.query_one("#prompt", Input).focus()

    @on(Input.Submitted, "#prompt")
    async def _prompt_submitted(self, event: Input.Submitted) -> None:
        await self.send_prompt(event.value)

    async def send_prompt(self, text: str) -> bool:
        """Send `text` as the next user turn of the current chat; False when nothing was sent
        (an empty prompt is dropped; a refused one stays in the input)."""
        prompt = self.query_one("#prompt", Input)
        if not text.strip():
            prompt.value = ""
            return False
        chat = self.chats.sendable()
        if chat is None:
            return False
        prompt.value = ""
        await self.chats.send(chat, text)
        return True

    @on(PromptInput.MultilinePaste)
    def _multiline_paste(self, event: PromptInput.MultilinePaste) -> None:
        self.edit_message(event.text)

    def edit_message(self, text: str) -> None:
        """A message of several lines, in an editor: ctrl+s sends it; a send that is refused (the
        notification says why) opens it again, so the text is never lost."""

        async def done(edited: str | None) -> None:
            if edited is not None and not await self.send_prompt(edited) and edited.strip():
                self.edit_message(edited)

        self.push_screen(MessageScreen(text), done)

    async def action_chat(self, action: str) -> None:
        """Key bindings of chat actions: run ChatTabs.action_<action>."""
        await self.chats.run_action(action)
        if action == "new_chat":
            self.query_one("#prompt", Input).focus()

    def action_mode(self, mode: str) -> None:
        if mode not in MODES:
            return
        refusal = self.link.refusal()
        if refusal:
            self.notify(refusal, severity="error")
            return
        why = self.link.unavailable_modes().get(mode) if self.link.endpoint else ""
        if why:
            self.notify(f"{mode} is unavailable on {self.link.endpoint}: {why}", severity="warning")
            return
        self.link.set_mode(mode)
        self._update_subtitle()

    def action_speculate(self) -> None:
        """The next speculation method (off → ngram → draft → off) for the next steps."""
        for text, severity in self.spec.switch(self.link):
            self.notify(text, severity=severity, timeout=6)
        self._update_subtitle()

    def action_samples(self, delta: int) -> None:
        k = self.sampling.samples + int(delta)
        self.set_samples(1 if k > MAX_SAMPLES else MAX_SAMPLES if k < 1 else k)

    def set_samples(self, k: int) -> None:
        self.sampling.set_samples(k)
        self._update_subtitle()
        n = self.sampling.samples
        text = f"{n} repl{'y' if n == 1 else 'ies'} per prompt"
        _params, note = self.sampling.replies()
        self.notify(f"{text} · {note}" if note else text, timeout=3 if note else 2)

    def set_thinking(self, value: bool | None) -> None:
        """enable_thinking for the chats sent from now on (None: the template's default); saved."""
        self.sampling.set_thinking(value)
        self._update_subtitle()
        self.notify(f"thinking: {THINKING_LABELS[value]}", timeout=3)

    def set_sampling_params(self, params: SamplingParams) -> None:
        """Use `params` for the next replies; what differs from the model's defaults is saved."""
        self.sampling.set_user(params)
        self._sampling_changed()

    def reset_sampling(self) -> None:
        self.sampling.reset()
        self._sampling_changed()

    def _sampling_changed(self) -> None:
        self._update_subtitle()
        _params, note = self.sampling.replies()
        text = f"sampling: {self.sampling.label()}"
        self.notify(f"{text} · {note}" if note else text, timeout=3)

    def action_sampling(self) -> None:
        if isinstance(self.screen, SamplingScreen):
            return

        def done(params: SamplingParams | None) -> None:
            if params is not None:
                self.set_sampling_params(params)

        choice = self.sampling
        self.push_screen(SamplingScreen(choice.params, choice.defaults, choice.source), done)

    def action_export(self) -> None:
        def done(path: str | None) -> None:
            if path:
                self.log_files.export(path)

        self.push_screen(ExportScreen(str(self.log_files.proposed_path())), done)

    def action_help_quit(self) -> None:
        """ctrl+c (Textual's hint that it does not quit), in plain text like every notice here."""
        self.notify("Press ctrl+q to quit (replies in flight are stored as interrupted)",
                    title="Do you want to quit?")

    def action_toggle_panel(self) -> None:
        panel = self.query_one(LatencyPanel)
        panel.display = not panel.display

    def action_help(self) -> None:
        self.push_screen(HelpScreen([b for b in self.BINDINGS if isinstance(b, Binding)]))

    def use_example(self, text: str) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.value = text
        prompt.cursor_position = len(text)
        prompt.focus()

    # ------------------------------------------------------------------ exit
    def exit_on_signal(self, signum: int) -> None:
        """SIGTERM/SIGHUP: what ctrl+q does, storing first. The flush runs right here, before
        any await, so nothing depends on the (possibly gone) terminal; a repeated signal is a
        no-op. Exit status 128 + signum, as a shell reports a process ended by that signal.
        Everything is on disk before the UI shuts down, so a shutdown that hangs on a hung-up
        terminal is cut short after SHUTDOWN_GRACE_S (os._exit, same status)."""
        if self.exit_signal is not None:
            return
        self.exit_signal = signum
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        n = len(self.replies)
        self._log_problem(f"{name}: exiting; {n} repl{'y' if n == 1 else 'ies'} in flight stored as interrupted")
        self.flush_on_exit()
        if self.exit_watchdog:
            timer = threading.Timer(SHUTDOWN_GRACE_S, os._exit, args=(128 + signum,))
            timer.daemon = True
            timer.start()
        self.exit(return_code=128 + signum)

    async def on_unmount(self) -> None:
        self.flush_on_exit()
        exit_signals.restore(self._previous_handlers)

    def _log_problem(self, text: str) -> None:
        """Problems at exit cannot be shown any more: they go to <data dir>/ui.log (0600)."""
        log_problem(self.data_path, text)

    def _keep_log(self) -> None:
        """The latency log's rows that no file holds yet, to <data dir>/latency/; the note for
        the terminal after the app is gone (and ui.log when it failed)."""
        try:
            kept = self.log_files.keep_at_exit()
        except FgchatError as exc:
            self.kept_log_note = f"the latency log could not be kept: {exc}"
            self._log_problem(self.kept_log_note)
            return
        if kept is not None:
            self.kept_log_note = f"latency log kept in {kept} (and -requests.csv beside it)"

    def flush_on_exit(self) -> None:
        """Keep everything: partial replies, the rest of --log-csv; then stop the engine. Idempotent."""
        if self._flushed:
            return
        self._flushed = True
        if self._text_timer is not None:
            self._text_timer.stop()
            self._text_timer = None
        self.guard.quiet = True
        self.replies.interrupt_all(self._log_problem)
        # beside the latency logs, else the temp dir (a read-only data dir)
        self.unsaved_note = self.guard.keep_unsaved(
            self.session_id, [self.log_files.kept_dir, Path(tempfile.gettempdir())])
        self.log_files.close()
        self._keep_log()
        self.link.shutdown()
        try:
            self.store.close()
        except Exception:
            pass
