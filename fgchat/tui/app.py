"""fgchat's Textual app: chats in tabs on the left, the latency console on the right.

Data flow: the engine runs in its own process (`EngineProcess`); a worker thread polls its event
pipe and posts `EngineEvents` messages; the handler records every token in the `LatencyLog`,
streams text into the reply's Markdown and marks the console dirty; a 10 Hz timer redraws the
console (coalesced, so a fast stream never makes the UI fall behind) and syncs --log-csv.

Invariants:
- Nothing a user produced is lost: user turns are stored when sent, replies when they finish,
  stop, fail or when the app exits (partial text, finish="interrupted"); the latency log only
  grows and survives failed exports and engine deaths.
- Request ids are unique for the app's lifetime (also across engine restarts), so log rows
  never mix two requests; every latency row also carries the session id (one per app run), so
  rows of two sessions in one --log-csv never collide.
- SIGTERM and SIGHUP (a closed terminal, a dropped SSH session) end the app like ctrl+q: partial
  replies stored (finish="interrupted"), --log-csv flushed, the engine stopped, then exit status
  128 + signal number. A second signal during that shutdown is ignored.
- A broken chat store never ends the app: every store call is guarded (one-line notification,
  data kept in memory); a store that cannot be opened is replaced by an in-memory one (one warning).

FgchatApp owns its state (created in __init__), layout, sending and exit; its behaviour is split
by responsibility into mixins: engine_link (engine process + events), replies (in-flight replies),
chat_tabs (tabs), export (CSV export + --log-csv), palette (ctrl+p commands), console (refresh).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input, Static, TabbedContent

from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import MODES, EngineInfo, SamplingParams
from fgchat.engine.process import EngineProcess
from fgchat.metrics import CsvAppender, LatencyLog, new_session_id
from fgchat.tui.chat_tabs import ChatTabsMixin
from fgchat.tui.console import HIST_WINDOW, REFRESH_S, ConsoleMixin
from fgchat.tui.dialogs import SamplingScreen
from fgchat.tui.engine_link import EngineLinkMixin
from fgchat.tui.export import ExportMixin
from fgchat.tui.help_screen import HelpScreen
from fgchat.tui.latency_panel import LatencyPanel, PanelView
from fgchat.tui.messages import EngineEvents
from fgchat.tui.palette import PaletteMixin
from fgchat.tui.replies import K_TEMPERATURE, MAX_SAMPLES, Reply, ReplyMixin, reply_params
from fgchat.tui.store import (
    ChatStore,
    Settings,
    StoredMessage,
    data_dir,
    data_dir_path,
    open_private,
    title_from,
)
from fgchat.tui.themes import BUILTIN_THEME_DIR, DEFAULT_THEME, load_themes

EngineFactory = Callable[..., object]

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # handled like ctrl+q; exit status 128 + signum
SHUTDOWN_GRACE_S = 3.0  # after a signal (data already stored): longest wait for the UI to close


def _ignore_signal(signum, frame) -> None:
    pass


def one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


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
                return store, f"{problem}: opened read-only; new messages are kept in memory only"
    return ChatStore(":memory:"), f"{problem}: chats are kept in memory for this session"


class FgchatApp(
    EngineLinkMixin, ReplyMixin, ChatTabsMixin, ExportMixin, PaletteMixin, ConsoleMixin, App[int]
):
    """Chat + latency console. `engine_factory(config)` returns an object with EngineProcess's
    interface (start, submit_chats or submit_chat, cancel, set_mode, get_events, shutdown); default
    EngineProcess."""

    CSS_PATH = "app.tcss"
    TITLE = "fgchat"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (34, "-tall")]

    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="Stop the replies of the current chat (partial text is kept)"),
        Binding("f1", "mode('eager')", "Eager", group=Binding.Group("Mode", compact=True),
                tooltip="Mode eager: every kernel launched from Python"),
        Binding("f2", "mode('piecewise')", "Piecewise", group=Binding.Group("Mode", compact=True),
                tooltip="Mode piecewise: CUDA graphs between attention calls"),
        Binding("f3", "mode('full')", "Full", group=Binding.Group("Mode", compact=True),
                tooltip="Mode full: the whole decode step as one CUDA graph"),
        Binding("f4", "samples(1)", "K+1", group=Binding.Group("Replies", compact=True),
                tooltip="Ask for one more reply per prompt (K = 1..8 replies generated as one batch)"),
        Binding("f5", "samples(-1)", "K-1", group=Binding.Group("Replies", compact=True),
                tooltip="Ask for one reply fewer per prompt"),
        Binding("f6", "sampling", "Sampling",
                tooltip="Sampling: temperature, top-p, top-k, seed (remembered)"),
        Binding("ctrl+n", "new_chat", "New", tooltip="New chat tab (chats can generate at the same time)"),
        Binding("ctrl+r", "regenerate", "Regen", tooltip="Regenerate the last reply of this chat"),
        Binding("ctrl+s", "export", "Export", tooltip="Export the latency log: tokens CSV + requests CSV"),
        Binding("ctrl+y", "copy_reply", "Copy", show=False, tooltip="Copy the last reply to the clipboard"),
        Binding("ctrl+o", "open_chat", "Open", tooltip="Reopen a saved conversation"),
        Binding("ctrl+t", "system_prompt", "System", show=False, tooltip="Edit this chat's system prompt"),
        Binding("ctrl+l", "toggle_panel", "Panel", show=False, tooltip="Show or hide the latency console"),
        Binding("ctrl+pagedown", "next_chat", "Next", show=False, tooltip="Next chat tab"),
        Binding("ctrl+pageup", "previous_chat", "Prev", show=False, tooltip="Previous chat tab"),
        Binding("f10", "help", "Help", tooltip="This help"),
        Binding("ctrl+q", "quit", "Quit", priority=True,
                tooltip="Quit (replies in flight are stored as interrupted)"),
    ]

    def __init__(
        self,
        config,
        *,
        engine_factory: EngineFactory | None = None,
        log_csv: CsvAppender | None = None,
        sampling: SamplingParams | None = None,
        data_path: Path | None = None,
        session_id: str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.startup_warnings: list[str] = []  # shown once the app is mounted
        dir_problem = ""
        if data_path is None:
            try:
                data_path = data_dir()
            except FgchatError as exc:
                data_path, dir_problem = data_dir_path(), str(exc)
        self.data_path = data_path
        self.settings = Settings(self.data_path / "settings.json")
        self.store, store_problem = open_store(self.data_path / "chats.sqlite3", dir_problem)
        if store_problem:
            self.startup_warnings.append(store_problem)
        self._engine_factory = engine_factory or (
            lambda cfg: EngineProcess(cfg, log_path=self.data_path / "engine.log")
        )
        self.appender = log_csv
        self.sampling = self._saved_sampling(sampling or SamplingParams(max_tokens=1024))
        # one id per app run, on every latency row it writes: rows of two sessions never collide
        self.session_id = session_id or getattr(log_csv, "session_id", None) or new_session_id()
        self.latency_log = LatencyLog(session_id=self.session_id)
        self.engine = None
        self._engine_gen = 0
        self.engine_state = "starting"  # starting | ready | failed
        self.engine_error = ""
        self.engine_info: EngineInfo | None = None
        self.engine_mode: str = "eager"
        self.requested_mode: str | None = getattr(config, "mode", None)
        self.mode_note = ""
        self.replies: dict[int, Reply] = {}
        self._next_rid = 1
        self._rid_chat: dict[int, str] = {}
        self.samples = int(min(max(int(self.settings.get("samples", 1) or 1), 1), MAX_SAMPLES))
        self.batch_size_now = 0
        self.last_batch_size = 0
        self.batch_sizes_seen: Counter[int] = Counter()  # decode batch sizes of tokens received
        self.batch_sizes_shown: set[int] = set()  # batch sizes the console displayed
        self.recent_itl: list[float] = []
        self.itl_history: dict[str, deque[float]] = {m: deque(maxlen=HIST_WINDOW) for m in MODES}
        self._next_build = 0.0  # monotonic time before which the console is not recomputed
        self.panel_view = PanelView()
        self._dirty = True
        self._flushed = False
        self.exit_signal: int | None = None  # SIGTERM/SIGHUP that ended the app, if one did
        self._previous_handlers: dict[int, object] = {}
        # run_tui sets it: after a signal, os._exit if the UI has not closed in SHUTDOWN_GRACE_S
        # (never in tests that drive the app in-process)
        self.exit_watchdog = False
        self._csv_error = ""
        self.notices: list[tuple[str, str]] = []  # (severity, text) of every notification shown
        self.theme_problems: list[str] = []
        self.file_themes: list[str] = []
        self._register_file_themes()

    # ------------------------------------------------------------------ setup
    def _register_file_themes(self) -> None:
        themes, self.theme_problems = load_themes([BUILTIN_THEME_DIR, self.data_path / "themes"])
        for theme in themes:
            self.register_theme(theme)
        self.file_themes = [t.name for t in themes]

    def _apply_saved_theme(self) -> None:
        wanted = self.settings.get("theme") or DEFAULT_THEME
        if wanted in self.available_themes:
            self.theme = wanted
        elif DEFAULT_THEME in self.available_themes:
            self.theme = DEFAULT_THEME

    def _saved_sampling(self, base: SamplingParams) -> SamplingParams:
        """`base` with the temperature, top-p, top-k and seed saved in the settings, if valid
        (invalid saved values are ignored with a start-up warning)."""
        saved = self.settings.get("sampling")
        if not isinstance(saved, dict):
            return base
        try:
            params = replace(
                base,
                temperature=float(saved.get("temperature", base.temperature)),
                top_p=float(saved.get("top_p", base.top_p)),
                top_k=int(saved.get("top_k", base.top_k)),
                seed=int(saved.get("seed", base.seed)),
            )
            params.validate()
        except Exception as exc:
            self.startup_warnings.append(f"saved sampling settings ignored: {one_line(exc)}")
            return base
        return params

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat-column"):
                yield Static(id="engine-banner")
                yield TabbedContent(id="chats")
                yield Input(placeholder="Message · Enter sends · Esc stops · F10 help", id="prompt")
            yield LatencyPanel(id="latency")
        yield Footer(compact=True)

    async def on_mount(self) -> None:
        self._install_signal_handlers()
        for warning in self.startup_warnings:
            self.notify(warning, severity="warning", timeout=15)
        self._apply_saved_theme()
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        for problem in self.theme_problems:
            self.notify(problem, severity="warning")
        await self.new_chat()
        self.query_one("#engine-banner", Static).display = False
        self.start_engine()
        self.set_interval(REFRESH_S, self._tick)
        self._update_subtitle()
        self.query_one("#prompt", Input).focus()

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

    def _remember_theme(self, theme) -> None:
        self.settings.set("theme", theme.name)

    # ------------------------------------------------------------------ message handlers
    @on(EngineEvents)
    async def _handle_engine_events(self, message: EngineEvents) -> None:
        await self._apply_engine_events(message)

    @on(TabbedContent.TabActivated)
    def _tab_activated(self) -> None:
        self.query_one("#prompt", Input).focus()

    # ------------------------------------------------------------------ sending
    @on(Input.Submitted, "#prompt")
    async def _prompt_submitted(self, event: Input.Submitted) -> None:
        await self.send_prompt(event.value)

    async def send_prompt(self, text: str) -> bool:
        """Send `text` as the next user turn of the current chat; False when nothing was sent."""
        prompt = self.query_one("#prompt", Input)
        if not text.strip():
            prompt.value = ""
            return False  # empty prompts are ignored
        chat = self.current_chat
        if chat is None:
            return False
        if self.engine_state == "failed":
            self.notify(f"the engine is not running: {self.engine_error}", severity="error")
            return False  # the text stays in the input
        conv = chat.conversation
        if self.chat_busy(conv):
            self.notify("this chat is still replying: Esc stops it, ctrl+n opens another chat",
                        severity="warning")
            return False
        prompt.value = ""
        if not any(m.role == "user" for m in conv.messages):
            conv.title = title_from(text)
        msg = StoredMessage("user", text)
        conv.messages.append(msg)
        self._store_message(conv, msg)
        bubble = await chat.add_message(msg)
        bubble.stored = msg  # type: ignore[attr-defined]
        await self._start_replies(chat)
        return True

    # ------------------------------------------------------------------ actions
    def action_mode(self, mode: str) -> None:
        if mode not in MODES:
            return
        if self.engine_state == "failed":
            self.notify(f"the engine is not running: {self.engine_error}", severity="error")
            return
        self.requested_mode = mode
        self.mode_note = ""
        self.engine.set_mode(mode)
        self._dirty = True
        self._update_subtitle()

    def action_samples(self, delta: int) -> None:
        k = self.samples + int(delta)
        if k > MAX_SAMPLES:
            k = 1
        elif k < 1:
            k = MAX_SAMPLES
        self.set_samples(k)

    def set_samples(self, k: int) -> None:
        self.samples = min(max(int(k), 1), MAX_SAMPLES)
        self.settings.set("samples", self.samples)
        self._dirty = True
        self._update_subtitle()
        text = f"{self.samples} repl{'y' if self.samples == 1 else 'ies'} per prompt"
        _params, note = reply_params(self.sampling, self.samples)
        self.notify(f"{text} · {note}" if note else text, timeout=3 if note else 2)

    def sampling_label(self) -> str:
        """The sampling shown in the subtitle, e.g. "T 0.7 top-p 0.95 top-k 0 seed 0";
        "T 0→0.7" when K > 1 replies are sampled instead of greedy (see `reply_params`)."""
        p = self.sampling
        t = f"T {p.temperature:g}"
        if self.samples > 1 and p.temperature == 0:
            t += f"→{K_TEMPERATURE:g}"
        return f"{t} top-p {p.top_p:g} top-k {p.top_k} seed {p.seed}"

    def _update_subtitle(self) -> None:
        super()._update_subtitle()  # "model · mode · batch B · K k"
        self.sub_title = f"{self.sub_title} · {self.sampling_label()}"

    def set_sampling_params(self, params: SamplingParams) -> None:
        """Use `params` (temperature, top-p, top-k, seed) for the next replies; saved in settings."""
        params.validate()
        self.sampling = params
        self.settings.set("sampling", {"temperature": params.temperature, "top_p": params.top_p,
                                       "top_k": params.top_k, "seed": params.seed})
        self._dirty = True
        self._update_subtitle()
        text = f"sampling: {self.sampling_label()}"
        _params, note = reply_params(params, self.samples)
        self.notify(f"{text} · {note}" if note else text, timeout=3)

    def action_sampling(self) -> None:
        if isinstance(self.screen, SamplingScreen):
            return

        def done(params: SamplingParams | None) -> None:
            if params is not None:
                self.set_sampling_params(params)

        self.push_screen(SamplingScreen(self.sampling), done)

    def action_toggle_panel(self) -> None:
        panel = self.query_one(LatencyPanel)
        panel.display = not panel.display

    def action_help(self) -> None:
        self.push_screen(HelpScreen([b for b in self.BINDINGS if isinstance(b, Binding)]))

    # ------------------------------------------------------------------ store
    def _store_call(self, what: str, call: Callable, *args, default=None):
        """Run one ChatStore call; a failure is a one-line error notification (and a ui.log line),
        never a crash: the caller's data stays in memory and the app keeps running."""
        try:
            return call(*args)
        except Exception as exc:  # sqlite/OS errors (FgchatError from ChatStore), closed store
            text = f"could not {what}: {one_line(exc)}"
            self._log_problem(text)
            if not self._flushed:
                self.notify(f"{text} (kept in memory)", severity="error", timeout=8)
            return default

    # ------------------------------------------------------------------ exit
    def _install_signal_handlers(self) -> None:
        """SIGTERM/SIGHUP → `exit_on_signal` on the event loop. Python-level handlers (main thread
        only: under a test runner the app may run elsewhere, then the process's handling stays)
        that only schedule the work: CPython runs them in signal-number order, so a hangup's
        SIGHUP (1) is seen before the SIGCONT (18) the kernel sends with it, and Textual's SIGCONT
        handler (which would resume the dead terminal and can block) is disarmed first."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return

        def on_signal(signum: int, frame) -> None:
            if signum == signal.SIGHUP:
                try:
                    signal.signal(signal.SIGCONT, _ignore_signal)
                except (ValueError, OSError):
                    pass
            try:
                loop.call_soon_threadsafe(self.exit_on_signal, signum)
            except RuntimeError:  # the loop is closed: the app already flushed
                pass

        for sig in EXIT_SIGNALS:
            try:
                self._previous_handlers[int(sig)] = signal.signal(sig, on_signal)
            except (ValueError, OSError):
                continue

    def _remove_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            try:
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            except (ValueError, OSError, TypeError):
                pass
        self._previous_handlers.clear()

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
        self._remove_signal_handlers()

    def _log_problem(self, text: str) -> None:
        """Problems at exit cannot be shown any more: append them to <data dir>/ui.log (0600)."""
        try:
            fd = open_private(self.data_path / "ui.log", os.O_WRONLY | os.O_APPEND)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        except OSError:
            pass

    def flush_on_exit(self) -> None:
        """Keep everything: partial replies, the rest of --log-csv; then stop the engine. Idempotent."""
        if self._flushed:
            return
        self._flushed = True
        for reply in list(self.replies.values()):
            try:
                self._persist_reply(reply, reply.bubble.text, {"finish": "interrupted", "tokens": reply.tokens})
            except Exception as exc:
                self._log_problem(f"could not save an interrupted reply: {exc!r}")
        self.replies.clear()
        if self.appender is not None:
            try:
                self.appender.sync(self.latency_log)
            except FgchatError:
                pass
            try:
                self.appender.close()
            except FgchatError:
                pass
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception:
                pass
        try:
            self.store.close()
        except Exception:
            pass
