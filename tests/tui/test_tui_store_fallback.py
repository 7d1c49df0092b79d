"""Chats never vanish with a store that cannot take them: a read-only data directory (where a
WAL store's -shm cannot be created; or an immutable one) still shows the saved chats (the store opened immutable),
and at exit every chat the store lacks (read-only store, in-memory store) is written whole to a
JSON file beside the latency logs, or in the temp dir, and named in one line. Pilot with a real
engine on the tiny model; the read-only directory is a real one (a child process without the
capabilities that let root write anywhere, when the tests run as root)."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fgchat.tui.store import ChatStore
from test_tui import SIZE, data_dir, make_app, wait_ready  # noqa: F401
from test_tui_reliability import chat_round, refuse_store_writes, saved_chat

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
PR_CAPBSET_DROP = 24
DAC_CAPS = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


def kept_chats(note: str) -> tuple[Path, list[dict]]:
    path = Path(note.rsplit(" written to ", 1)[1])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return path, json.loads(path.read_text())["chats"]


async def test_chats_a_read_only_store_lacks_are_written_beside_the_latency_logs(tiny_llama, data_dir, monkeypatch):
    data_dir.mkdir(parents=True)
    old = saved_chat(data_dir / "chats.sqlite3")
    refuse_store_writes(monkeypatch)
    app = make_app(tiny_llama, thread=True, max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        assert app.store.read_only
        conv = await chat_round(pilot, app, "still there?")
    monkeypatch.undo()
    note = app.unsaved_note
    assert note.startswith('1 chat not in the chat store ("still there?")') and "\n" not in note
    path, chats = kept_chats(note)
    assert path.parent == data_dir / "latency" and path.name == f"{app.session_id}-chats.json"
    (chat,) = chats
    assert chat["id"] == conv.id and chat["id"] != old.id
    assert [(m["role"], m["content"]) for m in chat["messages"]] == [(m.role, m.content) for m in conv.messages]
    assert f"written to {path}" in (data_dir / "ui.log").read_text()


async def test_chats_of_an_in_memory_store_go_to_the_temp_dir(tiny_llama, data_dir, tmp_path, monkeypatch):
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    data_dir.write_text("not a directory\n")  # no data dir: chats in memory, no latency folder
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    app = make_app(tiny_llama, thread=True, max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        assert app.store.in_memory
        first = await chat_round(pilot, app, "hello")
        await pilot.press("ctrl+n")
        second = await chat_round(pilot, app, "and another")
    path, chats = kept_chats(app.unsaved_note)
    assert path.parent == tmp_path / "tmp" and app.unsaved_note.startswith("2 chats not in the chat store")
    assert sorted(c["id"] for c in chats) == sorted([first.id, second.id])
    assert all(len(c["messages"]) == 2 for c in chats)


async def test_untouched_store_writes_no_file(tiny_llama, data_dir):
    app = make_app(tiny_llama, thread=True, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await chat_round(pilot, app, "saved as usual")
    assert app.unsaved_note == "" and not list(data_dir.glob("latency/*-chats.json"))


# ---------------------------------------------------------------------------------------------
# a real read-only data directory, in a child process (root's DAC capabilities dropped)

CHILD = r"""
import asyncio, json, os, sys
if os.access(os.environ["FGCHAT_DATA_DIR"], os.W_OK):
    print("RESULT null")  # still allowed to write there: no read-only directory to test
    sys.exit(0)
from test_tui import SIZE, make_app, wait_for, wait_ready
from test_tui_reliability import chat_round

async def main():
    app = make_app(sys.argv[1], thread=True, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: app.screen.query("#chat-list"), "saved chats list")
        listed = [s.title for s in app.store.list_conversations()]
        app.screen.query_one("#chat-list").highlighted = 0
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chats.current.conversation.title == "earlier chat", "chat opened")
        shown = [m.content for m in app.chats.current.conversation.messages]
        await pilot.press("ctrl+n")
        await chat_round(pilot, app, "in a read-only dir")
    out = {"listed": listed, "shown": shown, "read_only": app.store.read_only,
           "immutable": app.store.immutable, "note": app.unsaved_note}
    print("RESULT " + json.dumps(out))

asyncio.run(main())
"""


def drop_dac_capabilities() -> None:
    """In the child before exec: root keeps its uid but obeys file modes like any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in DAC_CAPS:
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)


def protect(data: Path, how: str, on: bool) -> None:
    """Make `data` read-only (mode 0500) or immutable (chattr +i, which binds root too), or undo it."""
    if how == "read-only":
        data.chmod(0o500 if on else 0o700)
        return
    try:
        done = subprocess.run(["chattr", "+i" if on else "-i", str(data)], capture_output=True).returncode == 0
    except OSError:
        done = False
    if on and not done:
        pytest.skip("chattr +i is not available here")


@pytest.mark.parametrize("how", ["read-only", "immutable"])
def test_a_read_only_data_dir_shows_saved_chats_and_keeps_new_ones(tiny_llama, tmp_path, how):
    data, tmp, home = tmp_path / "data", tmp_path / "tmp", tmp_path / "home"
    for folder in (data, tmp, home):
        folder.mkdir()
    saved_chat(data / "chats.sqlite3")
    assert sorted(p.name for p in data.iterdir()) == ["chats.sqlite3"]  # closed cleanly: no -wal, -shm
    protect(data, how, True)
    env = {**os.environ, "FGCHAT_DATA_DIR": str(data), "HOME": str(home), "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), str(REPO / "tests" / "tui")])}
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tiny_llama)], env=env, cwd=str(home),
                              capture_output=True, text=True, timeout=150,
                              preexec_fn=drop_dac_capabilities if os.geteuid() == 0 else None)
    finally:
        protect(data, how, False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    if out is None:
        pytest.skip("this user may write in a 0500 directory (capabilities could not be dropped)")
    assert out["listed"] == ["earlier chat"] and out["read_only"] and out["immutable"]
    assert out["shown"] == ["earlier question", "earlier answer"]
    note = out["note"]
    assert note.startswith('1 chat not in the chat store ("in a read-only dir")'), note
    path, (chat,) = kept_chats(note)
    assert path.parent == tmp and chat["messages"][0]["content"] == "in a read-only dir"
    store = ChatStore(data / "chats.sqlite3", read_only=True)  # the store itself is untouched
    assert [s.title for s in store.list_conversations()] == ["earlier chat"]
    store.close()
