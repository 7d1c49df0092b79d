"""The Textual app driven by Pilot, with a real engine on a tiny model (CPU).

Most tests use the engine in its own process (the app's default); a few use the in-thread
variant where start-up time matters more than isolation. On CPU only eager runs: asking for
piecewise/full is answered with a fallback to eager, which the UI must show. One test builds an
engine whose graph modes "work" (they replay the eager program) so the recorded side of a mode
switch can be checked too.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import SamplingParams
from fgchat.engine.process import EngineThread
from fgchat.metrics import CsvAppender, read_requests_csv, read_tokens_csv
from fgchat.tui.app import FgchatApp
from fgchat.tui.chat_view import MessageBubble, sanitize
from fgchat.tui.histogram import ModeHistograms
from fgchat.tui.latency_panel import LatencyPanel
from fgchat.tui.store import ChatStore

pytestmark = pytest.mark.timeout(120)

START_TIMEOUT = 60.0  # spawn + import torch + load, on a busy 2-core machine
SIZE = (120, 40)


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "data"
    monkeypatch.setenv("FGCHAT_DATA_DIR", str(path))
    return path


def make_app(
    model: Path | str,
    *,
    max_tokens: int = 48,
    thread: bool = False,
    make_engine=None,
    max_context: int = 1024,
    log_csv: CsvAppender | None = None,
) -> FgchatApp:
    config = EngineConfig(model=str(model), device="cpu", mode="eager", max_context=max_context)
    factory = None
    if thread or make_engine is not None:
        factory = lambda cfg: EngineThread(cfg, make_engine=make_engine and (lambda: make_engine(cfg)))  # noqa: E731
    return FgchatApp(
        config,
        engine_factory=factory,
        log_csv=log_csv,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def wait_for(pilot, condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            app = pilot.app
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for: {what} "
                f"(focused={app.focused!r}, engine={app.link.state}, notices={app.notices[-3:]})"
            )
        await pilot.pause(0.02)


async def wait_ready(pilot, app: FgchatApp) -> None:
    await wait_for(pilot, lambda: app.link.state != "starting", "engine start", START_TIMEOUT)
    assert app.link.state == "ready", app.link.error


async def key(pilot, name: str) -> None:
    """A key press through the app's normal key path, without Pilot's wait-for-idle (which
    stalls for up to a second per key while a reply streams)."""
    pilot.app.simulate_key(name)
    await pilot.pause(0.05)


async def type_prompt(pilot, text: str) -> None:
    app = pilot.app
    prompt = app.query_one("#prompt")
    await wait_for(pilot, lambda: app.focused is prompt, "the prompt to have focus", 10)
    prompt.value = text
    await key(pilot, "enter")


def panel(app: FgchatApp) -> LatencyPanel:
    return app.query_one(LatencyPanel)


def assistant_bubbles(app: FgchatApp) -> list[MessageBubble]:
    chat = app.chats.current
    assert chat is not None
    return [b for b in chat.bubbles() if b.role == "assistant"]


# ---------------------------------------------------------------------------------------------


async def test_reply_streams_mode_fallback_histograms_export(tiny_llama, data_dir, tmp_path):
    app = make_app(tiny_llama, max_tokens=64)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        assert app.link.info.available_modes["full"]  # CPU: graphs are unavailable

        # a prompt streams a reply
        conv = app.chats.current.conversation
        await type_prompt(pilot, "Hello there")
        await wait_for(pilot, lambda: len(conv.messages) == 2 and not app.replies, "the reply")
        (bubble,) = assistant_bubbles(app)
        assert bubble.appends >= 2, "text should arrive in several pieces while it streams"
        assert [m.role for m in conv.messages] == ["user", "assistant"]
        final = conv.messages[-1]
        assert final.content == bubble.text and final.meta["tokens"] == 64
        assert not bubble.streaming and "64 tok" in bubble.status
        await pilot.pause(0.05)
        shown = bubble.query_one("Markdown").source
        assert shown and shown == sanitize(final.content)
        first_rid = final.meta["rid"]

        # mode key: full is asked for, the engine answers it fell back to eager; the UI says so
        await pilot.press("f3")
        await wait_for(pilot, lambda: "full unavailable" in app.link.mode_note, "ModeChanged with a reason")
        await wait_for(pilot, lambda: "full unavailable" in panel(app).text_of("mode-note"), "note shown")
        assert "mode eager" in panel(app).text_of("batch-line")
        assert any("full unavailable" in text for sev, text in app.notices if sev == "warning")

        # tokens after the switch record the mode the engine reports (eager), not the one asked for
        await type_prompt(pilot, "And again")
        await wait_for(pilot, lambda: len(conv.messages) == 4 and not app.replies, "second reply")
        later = [t for t in app.latency.log.tokens() if t.request_id != first_rid]
        assert len(later) == 64
        assert {t.mode for t in later} == {app.link.mode} == {"eager"}

        # histograms received data (eager only; the other two are on the same axis, empty)
        await wait_for(pilot, lambda: panel(app).view.total_tokens == 128, "panel refresh")
        hist = app.query_one(ModeHistograms)
        assert hist.series["eager"].size == 126  # two requests x 63 inter-token latencies
        assert hist.series["full"].size == 0 and hist.series["piecewise"].size == 0
        # the counts are binned when the widget renders, which follows set_data on a later refresh
        await wait_for(pilot, lambda: int(sum(hist.counts.get("eager", []))) == 126, "histogram drawn")
        assert hist.total == 126

        # export: the key opens a dialog; the CSV rows match the streamed tokens
        out = tmp_path / "export" / "run-tokens.csv"
        out.parent.mkdir()
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen.query("#export-path"), "export dialog")
        app.screen.query_one("#export-path").value = str(out)
        await pilot.press("enter")
        await wait_for(pilot, lambda: out.exists(), "tokens CSV")
        rows = read_tokens_csv(out)
        logged = app.latency.log.tokens()
        assert len(rows) == len(logged) == 128
        assert [(r.request_id, r.token_index, r.mode, r.batch_size) for r in rows] == [
            (t.request_id, t.token_index, t.mode, t.batch_size) for t in logged
        ]
        assert {r.chat_id for r in rows} == {conv.id}
        for rid in {r.request_id for r in rows}:
            assert [r.token_index for r in rows if r.request_id == rid] == list(range(64))
        requests = read_requests_csv(out.with_name("run-requests.csv"))
        assert [r.output_tokens for r in requests] == [64, 64]

        # an unwritable path: visible error, the log stays in memory, a retry works
        bad = tmp_path / "missing-dir" / "x-tokens.csv"
        assert app.log_files.export(bad) is None
        assert any(sev == "error" and "export failed" in text for sev, text in app.notices)
        assert app.latency.log.token_count == 128
        assert app.log_files.export(tmp_path / "retry-tokens.csv") is not None
        assert len(read_tokens_csv(tmp_path / "retry-tokens.csv")) == 128


class GraphlessModesEngine(Engine):
    """An engine whose piecewise/full modes are "available" and run the eager program.

    Lets a CPU test exercise the recorded side of a live mode switch (mode per token, mode
    counts per request) without CUDA graphs.
    """

    def _make_modes(self):
        from fgchat.engine.modes.eager import EagerMode
        from fgchat.protocol.events import Mode

        modes = super()._make_modes()
        for mode in (Mode.PIECEWISE, Mode.FULL, Mode.MEGA):
            runner = EagerMode(self.program, False, self.notes.append)
            runner.mode = mode
            modes.install(mode, runner)
        return modes


async def test_mode_switch_is_recorded_on_later_tokens(tiny_llama, data_dir):
    app = make_app(tiny_llama, max_tokens=1900, max_context=2048, make_engine=GraphlessModesEngine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        assert not any(app.link.info.available_modes.values())
        await type_prompt(pilot, "Tell me a long story")
        await wait_for(pilot, lambda: app.latency.log.token_count >= 6, "some eager tokens")
        (reply,) = app.replies.values()

        await key(pilot, "f3")
        await wait_for(pilot, lambda: app.link.mode == "full", "the engine to confirm full")
        assert app.link.mode_note == ""
        await wait_for(pilot, lambda: any(t.mode == "full" for t in app.latency.log.tokens()), "full tokens")
        await wait_for(pilot, lambda: "mode full" in panel(app).text_of("batch-line"), "mode shown")

        await key(pilot, "f2")
        await wait_for(pilot, lambda: any(t.mode == "piecewise" for t in app.latency.log.tokens()),
                       "piecewise tokens")
        await key(pilot, "escape")
        await wait_for(pilot, lambda: not app.replies, "the reply to stop")

        tokens = [t for t in app.latency.log.tokens() if t.request_id == reply.rid]
        modes = [t.mode for t in tokens[1:]]  # the first token comes from prefill (eager)
        # modes only change at step boundaries, in the order the keys were pressed
        order = [m for i, m in enumerate(modes) if i == 0 or modes[i - 1] != m]
        assert order == ["eager", "full", "piecewise"]
        (record,) = app.latency.log.requests()
        assert record.finish_reason == "cancelled"
        assert set(record.modes) == {"eager", "full", "piecewise"}
        assert sum(record.modes.values()) == len(tokens)
        await wait_for(pilot, lambda: all(panel(app).view.itl_by_mode[m].size for m in
                                          ("eager", "piecewise", "full")), "all three histograms")
        stored = app.chats.current.conversation.messages[-1]
        assert stored.meta["finish"] == "cancelled" and stored.content == reply.bubble.text


async def test_two_chats_generate_together_batch_size_two(tiny_llama, data_dir):
    app = make_app(tiny_llama, max_tokens=1900, max_context=2048)
    shown: set[str] = set()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await type_prompt(pilot, "First chat, long reply please")
        first_chat = app.chats.current
        await wait_for(pilot, lambda: app.latency.log.token_count > 0, "first reply to stream")
        await key(pilot, "ctrl+n")
        await wait_for(pilot, lambda: app.chats.current is not first_chat, "a second chat tab")
        await type_prompt(pilot, "Second chat, also long")
        await wait_for(pilot, lambda: len(app.replies) == 2, "two replies in flight")

        def saw_two() -> bool:
            shown.add(panel(app).text_of("batch-line"))
            return app.latency.batch_sizes_seen[2] > 0 and any("batch size 2" in s for s in shown)

        await wait_for(pilot, saw_two, "batch size 2 reported and displayed")
        assert "batch 2" in app.sub_title or any("batch size 2" in s for s in shown)
        assert any(t.batch_size == 2 for t in app.latency.log.tokens())
        # stop both: Esc stops the current chat's reply, then the other tab's
        await key(pilot, "escape")
        await key(pilot, "ctrl+pageup")
        await wait_for(pilot, lambda: app.chats.current is first_chat, "back to the first chat")
        await key(pilot, "escape")
        await wait_for(pilot, lambda: not app.replies, "both replies stopped")
        assert [r.finish_reason for r in app.latency.log.requests()] == ["cancelled", "cancelled"]

        # K replies at once: F4 twice asks for 3 per prompt -> batch size 3
        await pilot.press("f4", "f4")
        assert app.sampling.samples == 3
        await type_prompt(pilot, "Three at once")
        await wait_for(pilot, lambda: app.latency.batch_sizes_seen[3] > 0, "batch size 3")
        assert len(app.replies) == 3 and {r.conversation.id for r in app.replies.values()} == {
            first_chat.conversation.id}
        await key(pilot, "escape")
        await wait_for(pilot, lambda: not app.replies, "three replies stopped")
        labels = [b.heading for b in assistant_bubbles(app)]
        assert labels[-3:] == ["assistant 1/3", "assistant 2/3", "assistant 3/3"]
        prompt = first_chat.conversation.prompt_messages()
        assert sum(m["role"] == "assistant" for m in prompt) == 2  # extra samples not fed back


async def test_empty_prompt_ignored_help_and_small_terminal(tiny_llama, data_dir):
    app = make_app(tiny_llama, thread=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("enter")
        await type_prompt(pilot, "   \n ")
        await pilot.pause(0.2)
        assert not app.replies and app.latency.log.token_count == 0
        assert app.chats.current.conversation.messages == []
        assert [b for b in app.chats.current.bubbles()] == []
        assert ChatStore(data_dir / "chats.sqlite3").list_conversations() == []

        # 80x24: the console and the batch size stay visible
        assert panel(app).display and panel(app).region.width >= 30
        assert "batch size" in panel(app).text_of("batch-line")
        assert "batch" in app.sub_title

        await pilot.press("f10")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "HelpScreen", "help screen")
        text = app.screen.query_one("Markdown").source
        for key in ("f1", "f2", "f3", "escape", "ctrl+s", "ctrl+n", "ctrl+r", "ctrl+y", "ctrl+o"):
            assert key in text
        await pilot.press("escape")
        await wait_for(pilot, lambda: type(app.screen).__name__ != "HelpScreen", "help closed")

        # a real reply still works in the small terminal
        await type_prompt(pilot, "hi")
        await wait_for(pilot, lambda: app.chats.current.conversation.messages[-1:]
                       and app.chats.current.conversation.messages[-1].role == "assistant", "reply")


async def test_model_load_failure_is_shown(tmp_path, data_dir):
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    app = make_app(bad)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.link.state == "failed", "load failure", START_TIMEOUT)
        banner = app.query_one("#engine-banner")
        assert banner.display
        shown = banner.visual.plain
        assert shown.startswith("✖ model failed to load:")
        assert "config.json" in shown, shown
        assert any(sev == "error" for sev, _ in app.notices)
        # the panel redraws on its refresh timer (up to 0.5 s beside a CPU engine)
        await wait_for(pilot, lambda: "engine stopped" in panel(app).text_of("mode-note"), "panel note", 5)
        # a prompt is not sent, and the text is not thrown away
        await type_prompt(pilot, "hello?")
        assert app.query_one("#prompt").value == "hello?"
        assert not app.replies and app.chats.current.conversation.messages == []


async def test_engine_death_keeps_partial_reply_and_log(tiny_llama, data_dir, tmp_path):
    app = make_app(tiny_llama, max_tokens=1800, max_context=2048)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await type_prompt(pilot, "Keep talking")
        await wait_for(pilot, lambda: app.replies and next(iter(app.replies.values())).tokens >= 10,
                       "ten tokens")
        (reply,) = app.replies.values()
        os.kill(app.link.handle.pid, signal.SIGKILL)
        await wait_for(pilot, lambda: app.link.state == "failed" and not app.replies,
                       "the death to be noticed")
        assert app.link.error.startswith("engine process exited")
        assert "SIGKILL" in app.link.error
        assert not app.replies
        assert reply.bubble.text and reply.tokens >= 10
        assert "engine process exited" in reply.bubble.status and "partial reply kept" in reply.bubble.status
        banner = app.query_one("#engine-banner")
        assert banner.display and "engine stopped" in banner.visual.plain
        stored = app.chats.current.conversation.messages[-1]
        assert stored.role == "assistant" and stored.content == reply.bubble.text
        assert stored.meta["finish"] == "error"
        # persisted, and the latency log is intact and exportable
        conv_id = app.chats.current.conversation.id
        on_disk = ChatStore(data_dir / "chats.sqlite3").load(conv_id)
        assert on_disk.messages[-1].content == reply.bubble.text
        n = app.latency.log.token_count
        assert n >= 10
        assert len(read_tokens_csv(app.log_files.export(tmp_path / "after-tokens.csv")[0])) == n

        # restart from the palette's command: a fresh engine, request ids keep growing
        app.sampling.max_tokens = 8
        await app.action_restart_engine()
        await wait_ready(pilot, app)
        assert not app.query_one("#engine-banner").display
        await type_prompt(pilot, "Still there?")
        await wait_for(pilot, lambda: app.latency.log.request_count == 1 and not app.replies, "a new reply")
        (record,) = app.latency.log.requests()
        assert record.request_id == reply.rid + 1 and record.output_tokens == 8
        assert app.latency.log.token_count == n + 8


async def test_conversations_persist_and_reopen(tiny_llama, data_dir):
    app = make_app(tiny_llama, thread=True, max_tokens=24)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await type_prompt(pilot, "Remember me")
        await wait_for(pilot, lambda: len(app.chats.current.conversation.messages) == 2, "reply")
        conv = app.chats.current.conversation
        reply_text = conv.messages[-1].content
        # copy the reply; edit the system prompt (stored with the conversation)
        await pilot.press("ctrl+y")
        assert app.clipboard == reply_text
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: app.screen.query("#system-text"), "system prompt editor")
        app.screen.query_one("#system-text").text = "You answer in one word."
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: conv.system_prompt == "You answer in one word.", "system prompt saved")
        assert conv.prompt_messages()[0] == {"role": "system", "content": "You answer in one word."}
        # regenerate replaces the reply (in memory and on disk), keeping the user turn
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not app.replies and len(conv.messages) == 2, "regenerated")
        assert len(assistant_bubbles(app)) == 1
        # a second chat left mid-reply: its partial reply is flushed on exit
        app.sampling.max_tokens = 5000
        await pilot.press("ctrl+n")
        await type_prompt(pilot, "Unfinished business")
        await wait_for(pilot, lambda: app.replies and next(iter(app.replies.values())).tokens >= 5,
                       "a partial reply")
        partial_id = app.chats.current.conversation.id
    store = ChatStore(data_dir / "chats.sqlite3")
    partial = store.load(partial_id)
    assert [m.role for m in partial.messages] == ["user", "assistant"]
    assert partial.messages[1].meta["finish"] == "interrupted" and partial.messages[1].content
    store.close()

    app2 = make_app(tiny_llama, thread=True)
    async with app2.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app2)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: app2.screen.query("#chat-list"), "saved chats list")
        option_list = app2.screen.query_one("#chat-list")
        ids = [option_list.get_option_at_index(i).id for i in range(option_list.option_count)]
        assert set(ids) == {conv.id, partial_id}
        option_list.highlighted = ids.index(conv.id)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app2.chats.current.conversation.id == conv.id, "chat reopened")
        await pilot.pause(0.1)
        bubbles = app2.chats.current.bubbles()
        assert [b.role for b in bubbles] == ["user", "assistant"]
        assert bubbles[0].text == "Remember me"
        assert bubbles[1].text == app2.chats.current.conversation.messages[1].content
        assert app2.chats.current.conversation.system_prompt == "You answer in one word."


async def test_themes_from_files_chosen_and_remembered(tiny_llama, data_dir):
    app = make_app(tiny_llama, thread=True)
    async with app.run_test(size=SIZE) as pilot:
        assert len(app.file_themes) >= 3
        assert app.theme == "fgchat-midnight"
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: app.screen.query("CommandInput"), "command palette")
        await pilot.press(*"Theme: fgchat-paper")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.theme == "fgchat-paper", "theme change")
        await pilot.pause(0.1)
    app2 = make_app(tiny_llama, thread=True)
    async with app2.run_test(size=SIZE) as pilot:
        await pilot.pause(0.1)
        assert app2.theme == "fgchat-paper"


async def test_log_csv_appends_as_tokens_arrive(tiny_llama, data_dir, tmp_path):
    path = tmp_path / "live.csv"
    app = make_app(tiny_llama, thread=True, max_tokens=32, log_csv=CsvAppender(path))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await type_prompt(pilot, "log me")
        await wait_for(pilot, lambda: app.latency.log.request_count == 1, "reply")
        await wait_for(pilot, lambda: path.exists() and len(read_tokens_csv(path)) == 32, "rows appended")
        app.sampling.max_tokens = 4000
        await type_prompt(pilot, "and more")
        await wait_for(pilot, lambda: app.latency.log.token_count > 40, "more tokens")
    # on exit the rest of the log is flushed
    assert len(read_tokens_csv(path)) == app.latency.log.token_count


def test_engine_process_reports_events_and_death(tiny_llama):
    from fgchat.protocol.events import EngineError, EngineInfo, RequestFinished, TokenEvent
    from fgchat.engine.process import EngineProcess

    proc = EngineProcess(EngineConfig(model=str(tiny_llama), device="cpu", mode="full", max_context=512))
    proc.start()
    try:
        events: list = []
        deadline = time.monotonic() + START_TIMEOUT
        while not any(isinstance(e, EngineInfo) for e in events) and time.monotonic() < deadline:
            events += proc.get_events(0.2)
        assert any(isinstance(e, EngineInfo) for e in events)
        proc.submit_chat(7, [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5, ignore_eos=True))
        while not any(isinstance(e, RequestFinished) for e in events) and time.monotonic() < deadline:
            events += proc.get_events(0.2)
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert [t.token_index for t in tokens] == [0, 1, 2, 3, 4]
        assert all(t.request_id == 7 for t in tokens)
        proc.submit_chat(8, [{"role": "user", "content": "x" * 5000}], SamplingParams(max_tokens=5))
        while not any(isinstance(e, EngineError) for e in events) and time.monotonic() < deadline:
            events += proc.get_events(0.2)
        err = next(e for e in events if isinstance(e, EngineError))
        assert err.request_id == 8 and not err.fatal and "context" in err.message
        os.kill(proc.pid, signal.SIGKILL)
        later: list = []
        while not later and time.monotonic() < deadline:
            later = proc.get_events(0.2)
        assert len(later) == 1 and later[0].fatal and later[0].message.startswith("engine process exited")
        assert proc.get_events(0.05) == []  # reported once
    finally:
        proc.shutdown()


@pytest.mark.skipif(not os.environ.get("FGCHAT_SCREENSHOT"),
                    reason="set FGCHAT_SCREENSHOT=assets/screenshot.svg to write the README screenshot")
async def test_readme_screenshot(tiny_llama, data_dir):
    """Not a check: renders the README screenshot (real engine, tiny random model, mid-stream)."""
    target = Path(os.environ["FGCHAT_SCREENSHOT"]).resolve()
    app = make_app(tiny_llama, max_tokens=1900, max_context=2048)
    async with app.run_test(size=(132, 38)) as pilot:
        await wait_ready(pilot, app)
        await key(pilot, "f3")
        await type_prompt(pilot, "Explain what a CUDA graph is in three sentences.")
        await wait_for(pilot, lambda: app.latency.log.token_count > 150, "a first reply")
        await key(pilot, "ctrl+n")
        await wait_for(pilot, lambda: len(app.chats.views()) == 2, "second chat")
        await type_prompt(pilot, "Why is batch-1 decoding memory-bound?")
        await wait_for(pilot, lambda: app.latency.batch_sizes_seen[2] > 150, "two replies streaming together")
        await pilot.pause(0.3)
        app.save_screenshot(filename=target.name, path=str(target.parent))
    assert target.exists()


def test_gpu_line_shows_the_host_launch_time_where_it_fits():
    s = {"gpu_step_ms_mean": 1.0, "host_overhead_ms_mean": 0.02, "gpu_fraction": 0.98, "launch_ms_mean": 0.8}
    wide = LatencyPanel._gpu_host(s, 80)
    assert "launch 0.80" in wide.plain and "GPU/step 1.00" in wide.plain
    # host-bound (launch >= 75% of the GPU time): the launch figure is styled as an error
    assert any("error" in str(span.style) for span in wide.spans)
    calm = LatencyPanel._gpu_host(dict(s, launch_ms_mean=0.3), 80)
    assert "launch 0.30" in calm.plain and not any("error" in str(span.style) for span in calm.spans)
    assert "launch" not in LatencyPanel._gpu_host(s, 50).plain
    assert "launch" not in LatencyPanel._gpu_host(dict(s, launch_ms_mean=None), 80).plain


async def test_failed_startup_check_is_shown(tiny_llama, data_dir, monkeypatch):
    """A production path that disagrees with the float32 reference (forced by FGCHAT_FAULT in the
    engine process): one warning naming the path, and the panel says what runs."""
    monkeypatch.setenv("FGCHAT_FAULT", "startup-check")
    app = make_app(tiny_llama)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await wait_for(pilot, lambda: any("startup check failed" in t for _, t in app.notices), "warning")
        warning = next(t for sev, t in app.notices if "startup check failed" in t)
        assert "plain torch ops, eager, float32" in warning and "\n" not in warning
        assert app.link.info.startup_check is not None and not app.link.info.startup_check.passed
        # the result comes in a later EngineInfo (the check runs once the engine is idle)
        await wait_for(pilot, lambda: "FAILED vs float32" in panel(app).text_of("captures"), "panel")
        # the chat still works
        await type_prompt(pilot, "hi")
        await wait_for(pilot, lambda: app.chats.current.conversation.messages[-1:]
                       and app.chats.current.conversation.messages[-1].role == "assistant", "reply")
