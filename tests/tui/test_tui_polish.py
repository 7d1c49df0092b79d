"""Rough edges a new user hit: idle resize, tab switch scrolling, export location, histogram
outliers, reopened chats (stats line, no stray empty tab), host time per step on CPU.
Pilot with a real engine on the tiny model (CPU), helpers from test_tui."""

from __future__ import annotations

import numpy as np
import pytest
from textual.app import App
from textual.widgets._markdown import MarkdownFence

from fgchat.tui.chat_view import reply_status
from fgchat.tui.histogram import ModeHistograms, binned, robust_edges
from fgchat.tui.store import ChatStore, Conversation, StoredMessage
from test_tui import data_dir, make_app, panel, type_prompt, wait_for, wait_ready, key  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def test_histogram_outlier_gets_an_overflow_bin():
    rng = np.random.default_rng(0)
    normal = rng.normal(12.0, 1.5, 126)
    values = np.append(normal, 8400.0)
    edges, underflow, overflow, _log = robust_edges({"eager": values}, 40)
    assert overflow and not underflow and np.isinf(edges[-1]) and edges[-2] < 20
    counts = binned(values, edges)
    assert counts.sum() == 127 and counts[-1] == 1
    assert (counts[:-1] > 0).sum() >= 15  # the rest spread over many bins, not squashed
    # a plain tail is not called overflow
    edges, underflow, overflow, _log = robust_edges({"eager": normal}, 40)
    assert not overflow and not underflow and binned(normal, edges).sum() == 126


async def test_histogram_widget_shows_the_overflow_count():
    class Host(App):
        def compose(self):
            yield ModeHistograms()

    app = Host()
    async with app.run_test(size=(60, 12)) as pilot:
        hist = app.query_one(ModeHistograms)
        rng = np.random.default_rng(1)
        hist.set_data({"eager": np.append(rng.normal(12.0, 1.5, 200), [8400.0, 9000.0])}, {}, "eager")
        await pilot.pause(0.05)
        text = hist.render().plain
        label = hist.overflow_label()
        assert label.startswith("> ") and label.endswith(" ms: 2"), label
        assert label in text
        assert hist.overflow["eager"] == 2 and int(hist.counts["eager"].sum()) == 202
        assert (hist.counts["eager"][:-1] > 0).sum() >= 15


def test_reply_status_from_meta():
    meta = {"finish": "length", "tokens": 24, "ttft_ms": 12.4, "tpot_ms": 4.0}
    assert reply_status(meta) == "24 tok · TTFT 12 ms · 250.0 tok/s · length limit"
    assert reply_status({"finish": "stop", "tokens": 3}) == "3 tok"


async def test_idle_resize_export_location_and_cpu_host_time(tiny_llama, data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = make_app(tiny_llama, thread=True, max_tokens=24)
    async with app.run_test(size=(200, 50)) as pilot:
        await wait_ready(pilot, app)
        await type_prompt(pilot, "hello")
        await wait_for(pilot, lambda: not app.replies and app.latency.log.request_count == 1, "reply")
        await wait_for(pilot, lambda: panel(app).view.total_tokens == 24, "panel refresh")
        await pilot.pause(0.2)

        # CPU: the host time per step, not "no GPU timing on CPU"
        gpu_line = panel(app).text_of("gpu-host")
        assert "host/step" in gpu_line and "ms" in gpu_line and "no GPU timing on CPU" not in gpu_line

        # idle resize: the stats table re-lays out without a new token
        wide = panel(app).text_of("stats")
        count = app.latency.log.token_count
        await pilot.resize_terminal(80, 24)
        await wait_for(pilot, lambda: panel(app).text_of("stats") != wide, "relayout after shrinking", 5)
        narrow = panel(app).text_of("stats")
        assert max(map(len, narrow.splitlines())) <= panel(app).scrollable_content_region.width
        await pilot.resize_terminal(200, 50)
        await wait_for(pilot, lambda: panel(app).text_of("stats") == wide, "relayout after growing", 5)
        assert app.latency.log.token_count == count

        # export: default folder is <data dir>/exports, not the current directory; path shown
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen.query("#export-path"), "export dialog")
        proposed = app.screen.query_one("#export-path").value
        assert proposed.startswith(str(data_dir / "exports"))
        await pilot.press("enter")
        await wait_for(pilot, lambda: list((data_dir / "exports").glob("*-tokens.csv")), "export written")
        assert not list(tmp_path.glob("*.csv"))
        await wait_for(pilot, lambda: "exported" in panel(app).text_of("export-line"), "path shown", 5)
        line = panel(app).text_of("export-line")
        assert line.endswith("-tokens.csv") and len(line) <= panel(app).scrollable_content_region.width

        # the live reply's stats are stored with it, so a reopened chat shows the same line
        stored = app.chats.current.conversation.messages[-1]
        bubble = app.chats.current.bubbles()[-1]
        assert "ttft_ms" in stored.meta and "tpot_ms" in stored.meta
        assert reply_status(stored.meta) == bubble.status


def _seed_long_chat(data_dir) -> str:
    data_dir.mkdir(parents=True, exist_ok=True)
    store = ChatStore(data_dir / "chats.sqlite3")
    conv = Conversation("seeded0001", title="Long chat")
    for i in range(8):
        store.add_message(conv, StoredMessage("user", f"question {i}"))
        store.add_message(conv, StoredMessage(
            "assistant", "\n\n".join(f"answer {i} paragraph {p}" for p in range(3)),
            {"finish": "stop", "tokens": 30 + i, "ttft_ms": 10.0 + i, "tpot_ms": 5.0, "rid": i + 1}))
    store.add_message(conv, StoredMessage("user", "the last question"))
    store.add_message(conv, StoredMessage("assistant", "THE LAST ANSWER",
                                          {"finish": "length", "tokens": 7, "ttft_ms": 9.0, "tpot_ms": 2.0}))
    store.close()
    return conv.id


def _gap_below_last(view) -> tuple[int, int]:
    """(rows of the last bubble inside the view, empty rows between it and the view's bottom)."""
    last = view.bubbles()[-1].region
    area = view.content_region
    visible = last.intersection(area).height
    return visible, area.bottom - last.bottom


async def test_reopen_replaces_blank_tab_keeps_stats_and_tab_switch_shows_the_end(tiny_llama, data_dir):
    chat_id = _seed_long_chat(data_dir)
    app = make_app(tiny_llama, thread=True, max_tokens=8)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_ready(pilot, app)
        blank = app.chats.current
        await app.chats.open_chat(chat_id)
        await wait_for(pilot, lambda: app.chats.current.conversation.id == chat_id, "chat reopened")
        await pilot.pause(0.2)
        # the untouched "New chat" tab was replaced, not left behind
        assert len(app.chats.views()) == 1 and blank not in app.chats.views()
        bubbles = app.chats.current.bubbles()
        assert bubbles[-1].status == "7 tok · TTFT 9 ms · 500.0 tok/s · length limit"
        assert bubbles[1].status == "30 tok · TTFT 10 ms · 200.0 tok/s"
        # a new chat, then back: the long chat shows its last message at once, at the bottom
        await key(pilot, "ctrl+n")
        await wait_for(pilot, lambda: len(app.chats.views()) == 2, "second tab")
        await type_prompt(pilot, "hi")
        await wait_for(pilot, lambda: not app.replies and len(app.chats.current.conversation.messages) == 2, "reply")
        for _ in range(2):
            await key(pilot, "ctrl+pagedown")
            await wait_for(pilot, lambda: app.chats.current.conversation.id == chat_id, "long chat", 5)
            view = app.chats.current
            assert view.virtual_size.height > view.scrollable_content_region.height
            visible, gap = _gap_below_last(view)
            assert visible > 0 and gap <= 2, (visible, gap, view.scroll_y, view.max_scroll_y)
            await pilot.pause(0.3)
            visible, gap = _gap_below_last(view)
            assert visible > 0 and gap <= 2, (visible, gap, view.scroll_y, view.max_scroll_y)
            await key(pilot, "ctrl+pagedown")
            await wait_for(pilot, lambda: app.chats.current.conversation.id != chat_id, "other chat", 5)


def test_startup_phase_names_a_pending_conversion(tmp_path, monkeypatch):
    """The first start of a GGUF says it converts (the slow part); a cached one, a directory or a
    preset does not."""
    from types import SimpleNamespace

    from fgchat.engine.model import resolve
    from fgchat.engine.serve_loop import startup_phase

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path / "cache"))
    assert "converting m.gguf (first start only" in startup_phase(SimpleNamespace(model=str(gguf), preset=None))
    done = resolve.conversion_dir(gguf)
    done.mkdir(parents=True)
    (done / resolve.CONVERSION_MARKER).write_text("{}")
    driver = tmp_path / "nvidia-version"  # stands in for /proc/driver/nvidia/version
    driver.write_text("NVRM")
    cuda = SimpleNamespace(model=str(gguf), preset=None, device=None)
    assert startup_phase(cuda, str(driver)) == "loading the model and capturing graphs"
    assert startup_phase(SimpleNamespace(model=str(gguf), preset=None, device="cpu"), str(driver)) == "loading the model"
    assert startup_phase(cuda, str(tmp_path / "no-driver")) == "loading the model"  # no graphs on the CPU
    assert startup_phase(SimpleNamespace(model=str(tmp_path), preset=None)).startswith("loading")
    assert startup_phase(SimpleNamespace(model=None, preset="tiny"), str(driver)) == (
        "building random weights and capturing graphs")
    assert startup_phase(SimpleNamespace(model=None, preset="tiny", device="cpu")) == "building random weights"


async def test_starting_engine_shows_its_phase_and_elapsed_time(tiny_llama, data_dir):
    import threading

    from fgchat.engine.core import Engine

    gate = threading.Event()

    def slow_engine(cfg):
        gate.wait(10)
        return Engine(cfg)

    app = make_app(tiny_llama, make_engine=slow_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(1.3)
        line = panel(app).text_of("engine-info")
        assert line.startswith("engine starting:") and line.rstrip().endswith(" s"), line
        assert app.link.state == "starting"
        gate.set()
        await wait_ready(pilot, app)
        await wait_for(pilot, lambda: " · eager step · ctx " in panel(app).text_of("engine-info"),
                       "the engine line saying how a CPU step runs")


def _blank_top_and_gap(view) -> tuple[int, int, int]:
    """(empty rows at the top of the view before its first visible widget, rows of the last
    bubble inside the view, empty rows between it and the view's bottom)."""
    area = view.content_region
    tops = [w.region.y for w in view.children if w.region.height and w.region.intersection(area).height]
    blank_top = (min(tops) - area.y) if tops else area.height
    visible, gap = _gap_below_last(view)
    return blank_top, visible, gap


async def test_long_chats_show_their_end_after_streaming_and_on_tab_switch(tiny_llama, data_dir):
    """Issue 16: a chat that outgrew its view while (or after) it streamed must show its last
    message at the bottom, in its own tab and when switched to — never its top, never blank rows
    above the text. The view anchors on every content resize, not only once per streamed batch:
    Markdown blocks mount after their parse, so the last growth comes after the last batch."""
    app = make_app(tiny_llama, max_tokens=600, max_context=2048)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(pilot, app)

        def at_end(view) -> bool:
            blank_top, visible, gap = _blank_top_and_gap(view)
            return (view.virtual_size.height > view.scrollable_content_region.height
                    and view.scroll_y == view.max_scroll_y and blank_top <= 1 and visible > 0 and gap <= 2)

        def state(view) -> str:
            return (f"scroll {view.scroll_y}/{view.max_scroll_y} virtual {view.virtual_size.height} "
                    f"view {view.scrollable_content_region.height} (blank top, last rows, gap) "
                    f"{_blank_top_and_gap(view)} anchored {view.is_anchored}")

        await type_prompt(pilot, "A long story, please")
        first = app.chats.current
        await wait_for(pilot, lambda: not app.replies and len(first.conversation.messages) == 2, "the reply", 90)
        await pilot.pause(0.5)  # Markdown blocks mount after their parse
        assert at_end(first), state(first)

        # a second chat streams a long reply; the first one, switched to mid-stream, shows its end
        await key(pilot, "ctrl+n")
        await wait_for(pilot, lambda: app.chats.current is not first, "a second tab")
        second = app.chats.current
        await type_prompt(pilot, "Another long one")
        await wait_for(pilot, lambda: app.latency.log.token_count > 650, "the second reply streaming", 60)
        await key(pilot, "ctrl+pageup")
        await wait_for(pilot, lambda: app.chats.current is first and first.size.height > 0, "back to the first", 10)
        await pilot.pause(0.05)
        assert at_end(first), state(first)
        await wait_for(pilot, lambda: not app.replies, "the second reply", 90)
        await pilot.pause(0.3)
        assert at_end(first), state(first)

        # the second finished while hidden: switched to, it shows its end at once and stays there
        await key(pilot, "ctrl+pagedown")
        await wait_for(pilot, lambda: app.chats.current is second and second.size.height > 0, "the second tab", 10)
        await pilot.pause(0.05)
        assert at_end(second), state(second)
        await pilot.pause(0.5)
        assert at_end(second), state(second)


async def test_ui_heap_is_frozen_once_the_engine_is_ready(tiny_llama, data_dir, monkeypatch):
    """The UI's long-lived objects leave the cyclic collector's full walks at ready (a full
    collection of them stalled a streaming reply for 40-115 ms). The app's own call is what is
    checked: an engine thread left by an earlier test may freeze this process's heap too."""
    import gc

    import fgchat.tui.app as app_module

    calls: list[tuple[bool, str]] = []

    def recording_freeze(collect: bool = False) -> int:
        calls.append((collect, app.link.state))
        return freeze_heap(collect)

    freeze_heap = app_module.freeze_heap
    monkeypatch.setattr(app_module, "freeze_heap", recording_freeze)
    gc.unfreeze()
    app = make_app(tiny_llama, max_tokens=8)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_ready(pilot, app)  # the engine may be ready before the first await returns
            assert calls == [(True, "ready")], "once, when the link turned ready, with a collection"
            assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual


async def test_mode_bar_stays_one_line_and_ctrl_c_says_how_to_quit(tiny_llama, data_dir):
    app = make_app(tiny_llama, thread=True)
    async with app.run_test(size=(160, 45)) as pilot:
        await wait_ready(pilot, app)
        # CPU: three modes unavailable; the four labels and their "n/a" fit the panel's one line
        await wait_for(pilot, lambda: panel(app).view.info is not None, "panel refresh", 5)
        for size in [(160, 45), (130, 40), (100, 30)]:
            await pilot.resize_terminal(*size)
            await pilot.pause(0.6)  # the panel's refresh beside a CPU engine
            bar = panel(app).text_of("mode-bar").rstrip()
            assert "\n" not in bar and len(bar) <= panel(app).content_width(), (size, bar)
            assert "mega" in bar

        # ctrl+c does not quit: the hint names ctrl+q in plain text, no markup tags
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: any("to quit" in text for _, text in app.notices), "the quit hint", 5)
        hint = next(text for _, text in app.notices if "to quit" in text)
        assert "ctrl+q" in hint and "[b]" not in hint
        assert app.is_running


async def test_a_code_line_wider_than_its_bubble_shows_a_scrollbar(tiny_llama, data_dir):
    """A reply's code block with a line wider than the bubble keeps the line whole (it scrolls
    sideways) and shows a horizontal bar; a block that fits shows none."""
    data_dir.mkdir(parents=True, exist_ok=True)
    store = ChatStore(data_dir / "chats.sqlite3")
    conv = Conversation("seededcode", title="Code")
    wide = "print('" + "x" * 150 + "')  # END"
    store.add_message(conv, StoredMessage("user", "code please"))
    store.add_message(conv, StoredMessage(
        "assistant", f"Here:\n\n```python\n{wide}\n```\n\nand short:\n\n```\nok = 1\n```\n",
        {"finish": "stop", "tokens": 40, "ttft_ms": 10.0, "tpot_ms": 5.0, "rid": 1}))
    store.close()
    app = make_app(tiny_llama, thread=True, max_tokens=8)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_ready(pilot, app)
        await app.chats.open_chat(conv.id)
        await wait_for(pilot, lambda: app.chats.current.conversation.id == conv.id, "chat reopened")
        await wait_for(pilot, lambda: len(app.chats.current.query(MarkdownFence)) == 2, "code blocks mounted")
        await pilot.pause(0.3)
        wide_fence, short_fence = app.chats.current.query(MarkdownFence)
        assert wide in wide_fence.code
        assert wide_fence.max_scroll_x > 0 and wide_fence.horizontal_scrollbar.display
        assert wide_fence.scrollbar_size_horizontal == 1
        assert short_fence.max_scroll_x == 0 and not short_fence.show_horizontal_scrollbar
        wide_fence.scroll_to(x=wide_fence.max_scroll_x, animate=False, immediate=True)
        await pilot.pause(0.1)
        assert wide_fence.scroll_x == wide_fence.max_scroll_x > 0
