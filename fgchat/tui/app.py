"""fgchat's Textual app: chats in tabs on the left, the latency console on the right.

Data flow: the engine runs in its own process (`EngineProcess`); a worker thread polls its event
pipe and posts `EngineEvents` messages; the handler records every token in the `LatencyLog`,
streams text into the reply's Markdown and marks the console dirty; a 10 Hz timer redraws the
console (coalesced, so a fast stream never makes the UI fall behind) and syncs --log-csv.

Invariants:
- Nothing a user produced is lost: user turns are stored when sent, replies when they finish,
  stop, fail or when the app exits (partial text, finish="interrupted"); the latency log only
  grows and survives failed exports and engine deaths.
- Request ids are allocated here, unique for the app's lifetime (also across engine restarts),
  so log rows never mix two requests.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Static, TabbedContent, TabPane
from textual.worker import get_current_worker

from fgchat.engine.errors import FgchatError
from fgchat.engine.events import (
    MODES,
    EngineError,
    EngineInfo,
    ModeChanged,
    RequestFinished,
    RequestSummary,
    SamplingParams,
    TokenEvent,
)
from fgchat.engine.process import EngineProcess
from fgchat.metrics import (
    CsvAppender,
    LatencyLog,
    summarize_records,
    write_requests_csv,
    write_tokens_csv,
)
from fgchat.tui.chat_view import ChatView, MessageBubble
from fgchat.tui.dialogs import ExportScreen, OpenChatScreen, SystemPromptScreen
from fgchat.tui.help_screen import HelpScreen
from fgchat.tui.latency_panel import LatencyPanel, PanelView
from fgchat.tui.messages import EngineEvents
from fgchat.tui.store import (
    DEFAULT_SYSTEM_PROMPT,
    ChatStore,
    Conversation,
    Settings,
    StoredMessage,
    data_dir,
    new_chat_id,
    title_from,
)
from fgchat.tui.themes import BUILTIN_THEME_DIR, DEFAULT_THEME, load_themes

MAX_SAMPLES = 8  # the engine batches at most 8 sequences
STATS_WINDOW_TOKENS = 5_000  # the stats table covers at most the latest tokens (stays fast)
STATS_WINDOW_REQUESTS = 1_000
HIST_WINDOW = 5_000  # each mode's histogram keeps that mode's latest inter-token latencies
RECENT_ITL = 240
REFRESH_S = 0.1


EXAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "assets" / "prompts.txt"


def example_prompts(path: Path = EXAMPLE_PROMPTS) -> list[str]:
    """Lines of assets/prompts.txt (comments and blanks skipped); [] when it is not there."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


@dataclass
class Reply:
    """A reply being generated: one engine request."""

    rid: int
    conversation: Conversation
    bubble: MessageBubble
    sample: int  # 1-based index among the K replies asked for together
    of: int
    tokens: int = 0
    stopping: bool = False

    @property
    def primary(self) -> bool:
        return self.sample == 1


EngineFactory = Callable[..., object]


class FgchatApp(App[int]):
    """Chat + latency console. `engine_factory(config)` returns an object with EngineProcess's
    interface (start, submit_chat, cancel, set_mode, get_events, shutdown); default EngineProcess."""

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
        Binding("f4", "samples(1)", "K+1", show=False,
                tooltip="Ask for one more reply per prompt (K = 1..8 replies generated as one batch)"),
        Binding("f5", "samples(-1)", "K-1", show=False, tooltip="Ask for one reply fewer per prompt"),
        Binding("ctrl+n", "new_chat", "New", tooltip="New chat tab (chats can generate at the same time)"),
        Binding("ctrl+r", "regenerate", "Regen", tooltip="Regenerate the last reply of this chat"),
        Binding("ctrl+s", "export", "Export", tooltip="Export the latency log: tokens CSV + requests CSV"),
        Binding("ctrl+y", "copy_reply", "Copy", show=False, tooltip="Copy the last reply to the clipboard"),
        Binding("ctrl+o", "open_chat", "Open", show=False, tooltip="Reopen a saved conversation"),
        Binding("ctrl+t", "system_prompt", "System", show=False, tooltip="Edit this chat's system prompt"),
        Binding("ctrl+l", "toggle_panel", "Panel", show=False, tooltip="Show or hide the latency console"),
        Binding("ctrl+pagedown", "next_chat", "Next", show=False, tooltip="Next chat tab"),
        Binding("ctrl+pageup", "previous_chat", "Prev", show=False, tooltip="Previous chat tab"),
        Binding("f10", "help", "Help", tooltip="This help"),
    ]

    def __init__(
        self,
        config,
        *,
        engine_factory: EngineFactory | None = None,
        log_csv: CsvAppender | None = None,
        sampling: SamplingParams | None = None,
        data_path: Path | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.data_path = data_path or data_dir()
        self.settings = Settings(self.data_path / "settings.json")
        self.store = ChatStore(self.data_path / "chats.sqlite3")
        self._engine_factory = engine_factory or (
            lambda cfg: EngineProcess(cfg, log_path=self.data_path / "engine.log")
        )
        self.appender = log_csv
        self.sampling = sampling or SamplingParams(max_tokens=1024)
        self.latency_log = LatencyLog()
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

    # ------------------------------------------------------------------ engine
    def start_engine(self) -> None:
        """Start (or restart) the engine and its polling thread."""
        self._engine_gen += 1
        self.engine_state = "starting"
        self.engine_error = ""
        self.engine = self._engine_factory(self.config)
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

    @on(EngineEvents)
    async def _handle_engine_events(self, message: EngineEvents) -> None:
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
            for rid in list(self.replies):
                await self._fail_reply(rid, ev.message)
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
            return
        if ev.request_id is not None and ev.request_id in self.replies:
            await self._fail_reply(ev.request_id, ev.message)
        self.notify(ev.message, title="request failed", severity="error", timeout=8)

    # ------------------------------------------------------------------ replies
    async def _finish_reply(self, summary: RequestSummary) -> None:
        reply = self.replies.pop(summary.request_id, None)
        if reply is None:
            return
        # store first (synchronously): nothing is lost if the UI update below is interrupted
        self._persist_reply(reply, summary.text, {"finish": summary.finish_reason,
                                                  "tokens": summary.output_tokens})
        status = {"stop": "", "length": "length limit", "cancelled": "stopped", "error": "error"}.get(
            summary.finish_reason, summary.finish_reason
        )
        timing = f"{summary.output_tokens} tok · TTFT {summary.ttft_ms:.0f} ms"
        if summary.tpot_ms:
            timing += f" · {1000.0 / summary.tpot_ms:.1f} tok/s"
        self._update_tab(reply.conversation)
        await reply.bubble.finish(" · ".join(x for x in (timing, status) if x), final_text=summary.text)

    async def _fail_reply(self, rid: int, message: str) -> None:
        reply = self.replies.pop(rid, None)
        if reply is None:
            return
        self._persist_reply(reply, reply.bubble.text,
                            {"finish": "error", "error": message, "tokens": reply.tokens})
        self._update_tab(reply.conversation)
        await reply.bubble.finish(f"error: {message} · partial reply kept ({reply.tokens} tok)")

    def _persist_reply(self, reply: Reply, text: str, meta: dict) -> None:
        meta = {**meta, "rid": reply.rid}
        if reply.of > 1:
            meta.update(sample=reply.sample, of=reply.of)
        if not reply.primary:
            meta["alt"] = True  # extra samples are kept but not fed back as conversation turns
        msg = StoredMessage("assistant", text, meta)
        reply.conversation.messages.append(msg)
        reply.bubble.stored = msg  # type: ignore[attr-defined]
        self._store_message(reply.conversation, msg)

    def _store_message(self, conversation: Conversation, msg: StoredMessage) -> None:
        try:
            self.store.add_message(conversation, msg)
        except Exception as exc:  # sqlite errors: keep going, say so
            self._log_problem(f"could not save a message: {exc!r}")
            if not self._flushed:
                self.notify(f"could not save the message: {exc}", severity="error")

    # ------------------------------------------------------------------ chats
    @property
    def tabs(self) -> TabbedContent:
        return self.query_one("#chats", TabbedContent)

    def chat_views(self) -> list[ChatView]:
        return list(self.query(ChatView))

    @property
    def current_chat(self) -> ChatView | None:
        pane = self.tabs.active_pane
        if pane is None:
            return None
        views = list(pane.query(ChatView))
        return views[0] if views else None

    def chat_busy(self, conversation: Conversation) -> bool:
        return any(r.conversation is conversation for r in self.replies.values())

    async def new_chat(self, conversation: Conversation | None = None) -> ChatView:
        conv = conversation or Conversation(
            new_chat_id(), system_prompt=self.settings.get("system_prompt", DEFAULT_SYSTEM_PROMPT)
        )
        view = ChatView(conv)
        pane = TabPane(conv.title, view, id=f"chat-{conv.id}")
        await self.tabs.add_pane(pane)
        self.tabs.active = pane.id
        return view

    def _update_tab(self, conversation: Conversation) -> None:
        pane_id = f"chat-{conversation.id}"
        try:
            tab = self.tabs.get_tab(pane_id)
        except Exception:
            return  # tab closed
        label = conversation.title + (" ●" if self.chat_busy(conversation) else "")
        if tab.label_text != label:
            tab.label = label

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

    async def _start_replies(self, chat: ChatView) -> None:
        conv = chat.conversation
        messages = conv.prompt_messages()
        k = self.samples
        for j in range(1, k + 1):
            rid = self._next_rid
            self._next_rid += 1
            label = f"assistant {j}/{k}" if k > 1 else "assistant"
            bubble = await chat.add_reply(label)
            self.replies[rid] = Reply(rid, conv, bubble, j, k)
            self._rid_chat[rid] = conv.id
            params = replace(self.sampling, seed=self.sampling.seed + j - 1)
            self.engine.submit_chat(rid, messages, params)
        self._update_tab(conv)
        self._dirty = True

    # ------------------------------------------------------------------ actions
    def action_stop(self) -> None:
        chat = self.current_chat
        if chat is None:
            return
        for reply in self.replies.values():
            if reply.conversation is chat.conversation and not reply.stopping:
                reply.stopping = True
                reply.bubble.set_status("stopping…")
                self.engine.cancel(reply.rid)

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
        self.notify(f"{self.samples} repl{'y' if self.samples == 1 else 'ies'} per prompt", timeout=2)

    async def action_new_chat(self) -> None:
        await self.new_chat()
        self.query_one("#prompt", Input).focus()

    async def action_regenerate(self) -> None:
        chat = self.current_chat
        if chat is None:
            return
        conv = chat.conversation
        if self.chat_busy(conv):
            self.notify("wait for the reply to finish (Esc stops it)", severity="warning")
            return
        if self.engine_state == "failed":
            self.notify(f"the engine is not running: {self.engine_error}", severity="error")
            return
        last_user = max((i for i, m in enumerate(conv.messages) if m.role == "user"), default=None)
        if last_user is None:
            self.notify("nothing to regenerate yet", severity="warning")
            return
        dropped = conv.messages[last_user + 1:]
        del conv.messages[last_user + 1:]
        ids = [m.id for m in dropped if m.id is not None]
        if ids:
            self.store.delete_messages(conv, ids)
        dropped_ids = {id(m) for m in dropped}
        for bubble in chat.bubbles():
            if id(getattr(bubble, "stored", None)) in dropped_ids:
                await bubble.remove()
        await self._start_replies(chat)

    def action_copy_reply(self) -> None:
        chat = self.current_chat
        if chat is None:
            return
        conv = chat.conversation
        active = [r for r in self.replies.values() if r.conversation is conv and r.primary]
        if active:
            text = active[0].bubble.text
        else:
            last = [m for m in conv.messages if m.role == "assistant" and not m.meta.get("alt")]
            if not last:
                self.notify("no reply to copy yet", severity="warning")
                return
            text = last[-1].content
        self.copy_to_clipboard(text)
        self.notify(f"copied the reply ({len(text)} characters)", timeout=3)

    def action_open_chat(self) -> None:
        self.push_screen(OpenChatScreen(self.store.list_conversations()), self._open_chosen)

    async def _open_chosen(self, chat_id: str | None) -> None:
        if not chat_id:
            return
        await self.open_chat(chat_id)

    async def open_chat(self, chat_id: str) -> ChatView | None:
        for view in self.chat_views():
            if view.conversation.id == chat_id:
                self.tabs.active = f"chat-{chat_id}"
                return view
        conv = self.store.load(chat_id)
        if conv is None:
            self.notify("that chat no longer exists", severity="error")
            return None
        return await self.new_chat(conv)

    async def action_close_chat(self) -> None:
        chat = self.current_chat
        if chat is None:
            return
        conv = chat.conversation
        for reply in list(self.replies.values()):
            if reply.conversation is conv:
                self.engine.cancel(reply.rid)
                self._persist_reply(reply, reply.bubble.text,
                                    {"finish": "cancelled", "tokens": reply.tokens})
                del self.replies[reply.rid]
        await self.tabs.remove_pane(f"chat-{conv.id}")
        if not self.chat_views():
            await self.new_chat()

    def action_system_prompt(self) -> None:
        chat = self.current_chat
        if chat is None:
            return

        def done(text: str | None) -> None:
            if text is None:
                return
            chat.conversation.system_prompt = text
            self.settings.set("system_prompt", text)
            if chat.conversation.saved:
                self.store.save_conversation(chat.conversation)
            chat.refresh_system_line()

        self.push_screen(SystemPromptScreen(chat.conversation.system_prompt), done)

    def action_toggle_panel(self) -> None:
        panel = self.query_one(LatencyPanel)
        panel.display = not panel.display

    def action_next_chat(self) -> None:
        self._cycle_chat(1)

    def action_previous_chat(self) -> None:
        self._cycle_chat(-1)

    def _cycle_chat(self, step: int) -> None:
        panes = [p.id for p in self.tabs.query(TabPane)]
        if not panes or self.tabs.active not in panes:
            return
        self.tabs.active = panes[(panes.index(self.tabs.active) + step) % len(panes)]

    def action_help(self) -> None:
        self.push_screen(HelpScreen([b for b in self.BINDINGS if isinstance(b, Binding)]))

    def action_export(self) -> None:
        folder = Path(self.settings.get("export_dir") or Path.cwd())
        default = folder / time.strftime("fgchat-%Y%m%d-%H%M%S-tokens.csv")
        self.push_screen(ExportScreen(str(default)), self._export_chosen)

    def _export_chosen(self, path: str | None) -> None:
        if path:
            self.export_log(path)

    def export_log(self, path: str | Path) -> tuple[Path, Path] | None:
        """Write the tokens CSV at `path` and the requests CSV beside it (both atomic).
        On failure: an error notification; the log stays in memory for another try."""
        tokens_path = Path(str(path)).expanduser()
        stem = tokens_path.stem.removesuffix("-tokens")
        requests_path = tokens_path.with_name(f"{stem}-requests{tokens_path.suffix or '.csv'}")
        tokens, requests = self.latency_log.snapshot()
        try:
            n_tokens = write_tokens_csv(tokens_path, tokens)
            n_requests = write_requests_csv(requests_path, requests)
        except FgchatError as exc:
            self.notify(f"{exc} — the log is kept in memory; export again to another path",
                        title="export failed", severity="error", timeout=10)
            return None
        self.settings.set("export_dir", str(tokens_path.parent.resolve()))
        self.notify(f"{n_tokens} token rows → {tokens_path}\n{n_requests} request rows → {requests_path}",
                    title="latency log exported", timeout=6)
        return tokens_path, requests_path

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

    def _use_example(self, text: str) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.value = text
        prompt.cursor_position = len(text)
        prompt.focus()

    def set_sampling(self, temperature: float) -> None:
        self.sampling = replace(self.sampling, temperature=temperature)
        self.notify("greedy sampling" if temperature == 0 else f"temperature {temperature}", timeout=3)

    # ------------------------------------------------------------------ palette
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        available = self.engine_info.available_modes if self.engine_info else {}
        for key, mode in zip(("F1", "F2", "F3"), MODES):
            why = available.get(mode, "")
            help_text = f"Run decode steps in {mode} mode ({key})" + (f" — unavailable: {why}" if why else "")
            yield SystemCommand(f"Mode: {mode}", help_text, lambda m=mode: self.action_mode(m))
        yield SystemCommand("Export latency log (CSV)", "Write the tokens and requests CSVs (ctrl+s)",
                            self.action_export)
        for k in range(1, MAX_SAMPLES + 1):
            yield SystemCommand(f"Replies per prompt: {k}", f"Generate {k} replies at once (batch size {k})",
                                lambda k=k: self.set_samples(k))
        yield SystemCommand("New chat", "Open a new chat tab (ctrl+n)", self.action_new_chat)
        yield SystemCommand("Open saved chat", "Reopen a stored conversation (ctrl+o)", self.action_open_chat)
        yield SystemCommand("Close chat", "Close the current chat tab (it stays saved)", self.action_close_chat)
        yield SystemCommand("Regenerate reply", "Ask again for the last reply (ctrl+r)", self.action_regenerate)
        yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard (ctrl+y)",
                            self.action_copy_reply)
        yield SystemCommand("Edit system prompt", "System prompt of this chat (ctrl+t)", self.action_system_prompt)
        yield SystemCommand("Stop reply", "Stop the replies of this chat (Esc)", self.action_stop)
        yield SystemCommand("Sampling: greedy", "Temperature 0 (identical output in every mode)",
                            lambda: self.set_sampling(0.0))
        yield SystemCommand("Sampling: temperature 0.7", "Varied replies", lambda: self.set_sampling(0.7))
        yield SystemCommand("Toggle latency panel", "Show or hide the console (ctrl+l)", self.action_toggle_panel)
        yield SystemCommand("Restart engine", "Start a fresh engine process", self.action_restart_engine)
        yield SystemCommand("Help", "Keys and modes (F10)", self.action_help)
        for text in example_prompts():
            yield SystemCommand(f"Example: {text}", "Put this example prompt in the prompt box",
                                lambda t=text: self._use_example(t))
        for name in self.file_themes:
            yield SystemCommand(f"Theme: {name}", "Switch to this theme (remembered)",
                                lambda n=name: setattr(self, "theme", n))

    # ------------------------------------------------------------------ console refresh
    def _update_subtitle(self) -> None:
        batch = self.batch_size_now
        mode = self.engine_mode + (f"→{self.requested_mode}?" if self.requested_mode and
                                   self.requested_mode != self.engine_mode else "")
        if self.engine_state == "failed":
            model = "engine stopped"
        else:
            model = self.engine_info.model_name if self.engine_info else "loading…"
        self.sub_title = f"{model} · {mode} · batch {batch} · K {self.samples}"

    def _tick(self) -> None:
        if self._flushed:
            return
        if self.appender is not None:
            self._sync_csv()
        now = time.monotonic()
        if not self._dirty or now < self._next_build:
            return
        self._dirty = False
        self.panel_view = self._build_view()
        # keep recomputation under ~20% of the UI thread even with a long, fast log
        self._next_build = now + max(REFRESH_S, 5 * (time.monotonic() - now))
        if self.panel_view.batch_size:
            self.batch_sizes_shown.add(self.panel_view.batch_size)
        try:
            self.query_one(LatencyPanel).show(self.panel_view)
        except NoMatches:  # shutting down
            return
        self._update_subtitle()
        for view in self.chat_views():
            self._update_tab(view.conversation)

    def _build_view(self) -> PanelView:
        count = self.latency_log.token_count
        start = max(0, count - STATS_WINDOW_TOKENS)
        tokens = self.latency_log.tokens_since(start)
        requests = self.latency_log.requests()[-STATS_WINDOW_REQUESTS:]
        return PanelView(
            mode=self.engine_mode,
            requested_mode=self.requested_mode,
            mode_note=self.mode_note,
            batch_size=self.batch_size_now,
            last_batch_size=self.last_batch_size,
            samples=self.samples,
            active_replies=len(self.replies),
            summary=summarize_records(tokens, requests),
            itl_by_mode={m: np.fromiter(self.itl_history.get(m, ()), dtype=np.float64) for m in MODES},
            recent_itl=list(self.recent_itl),
            windowed=len(tokens) if start else 0,
            total_tokens=count,
            info=self.engine_info,
            engine_state=self.engine_state,
            engine_error=self.engine_error,
        )

    def _sync_csv(self) -> None:
        try:
            self.appender.sync(self.latency_log)
            if self._csv_error:
                self._csv_error = ""
                self.notify("the --log-csv file is writable again; rows caught up", timeout=4)
        except FgchatError as exc:
            if not self._csv_error:
                self.notify(f"{exc} (rows stay in memory; retrying)", title="--log-csv", severity="error")
            self._csv_error = str(exc)

    # ------------------------------------------------------------------ exit
    async def on_unmount(self) -> None:
        self.flush_on_exit()

    def _log_problem(self, text: str) -> None:
        """Problems at exit cannot be shown any more: append them to <data dir>/ui.log."""
        try:
            with open(self.data_path / "ui.log", "a", encoding="utf-8") as f:
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
        self.store.close()
