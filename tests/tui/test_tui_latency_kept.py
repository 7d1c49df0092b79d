"""At exit, a latency log with rows that no file holds (no --log-csv, nothing exported since)
goes to <data dir>/latency/<session id>-tokens.csv and -requests.csv, and the terminal is told
where. Drives the real app with Pilot and a real engine on the tiny model."""

from __future__ import annotations

import pytest

from fgchat.metrics import CsvAppender, new_session_id, read_requests_csv, read_tokens_csv
from test_tui import SIZE, data_dir, make_app, wait_ready  # noqa: F401
from test_tui_reliability import chat_round

pytestmark = pytest.mark.timeout(120)


def kept_files(data) -> list[str]:
    folder = data / "latency"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


async def test_a_log_nothing_wrote_is_kept_at_exit_and_the_note_says_where(tiny_llama, data_dir):
    app = make_app(tiny_llama, thread=True, max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await chat_round(pilot, app, "first")
        await chat_round(pilot, app, "second")
    sid = app.session_id
    assert kept_files(data_dir) == [f"{sid}-requests.csv", f"{sid}-tokens.csv"]
    tokens = read_tokens_csv(data_dir / "latency" / f"{sid}-tokens.csv")
    assert len(tokens) == 12 == app.latency.log.token_count
    assert len(read_requests_csv(data_dir / "latency" / f"{sid}-requests.csv")) == 2
    assert str(data_dir / "latency" / f"{sid}-tokens.csv") in app.kept_log_note


async def test_an_export_of_every_row_leaves_nothing_to_keep_and_later_rows_are_kept(tiny_llama, data_dir,
                                                                                     tmp_path):
    app = make_app(tiny_llama, thread=True, max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await chat_round(pilot, app, "exported")
        assert app.log_files.export(tmp_path / "all-tokens.csv") is not None
    assert kept_files(data_dir) == [] and app.kept_log_note == ""

    app = make_app(tiny_llama, thread=True, max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await chat_round(pilot, app, "exported")
        assert app.log_files.export(tmp_path / "early-tokens.csv") is not None
        await chat_round(pilot, app, "after the export")
    tokens = read_tokens_csv(data_dir / "latency" / f"{app.session_id}-tokens.csv")
    assert len(tokens) == 12  # the whole log, not only the rows since the export


async def test_log_csv_holds_the_rows_so_nothing_is_kept(tiny_llama, data_dir, tmp_path):
    path = tmp_path / "live.csv"
    app = make_app(tiny_llama, thread=True, max_tokens=6, log_csv=CsvAppender(path, session_id=new_session_id()))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await chat_round(pilot, app, "synced")
    assert len(read_tokens_csv(path)) == 6
    assert kept_files(data_dir) == [] and app.kept_log_note == ""


async def test_a_log_that_cannot_be_kept_is_one_note_and_a_ui_log_line(tiny_llama, data_dir):
    app = make_app(tiny_llama, thread=True, max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await chat_round(pilot, app, "nowhere to go")
        (data_dir / "latency").write_text("a file where the folder goes")
    assert app.kept_log_note.startswith("the latency log could not be kept:")
    assert "\n" not in app.kept_log_note
    assert app.kept_log_note in (data_dir / "ui.log").read_text()


def test_run_tui_prints_the_note_after_the_app_is_gone(monkeypatch, capsys):
    import fgchat.tui as tui

    class Ran:
        exit_watchdog = False
        return_code = 0
        kept_log_note = "latency log kept in /x/latency/s-tokens.csv (and -requests.csv beside it)"
        unsaved_note = '1 chat not in the chat store ("hi") written to /x/latency/s-chats.json'

        def run(self) -> int:
            print("ui", file=__import__("sys").stderr)
            return 0

        def flush_on_exit(self) -> None:
            pass

    monkeypatch.setattr(tui, "build_app", lambda **_: Ran())
    assert tui.run_tui() == 0
    assert capsys.readouterr().err.splitlines() == ["ui", f"fgchat: {Ran.unsaved_note}", f"fgchat: {Ran.kept_log_note}"]
