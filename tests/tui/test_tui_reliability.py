"""Reliability of the TUI: nothing lost on SIGTERM / SIGHUP or with a broken chat store; private
file modes; --log-csv rows that stay unique across sessions.

The signal tests run the real CLI (`python -m fgchat.cli`) on a pseudo-terminal, type a prompt,
and signal it mid-reply; the store tests drive the app with Pilot and a real engine on the tiny
model (in a thread, like the quicker tests of test_tui.py).
"""

from __future__ import annotations

import csv
import fcntl
import os
import pty
import signal
import stat
import struct
import subprocess
import sys
import termios
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import fgchat.tui.store as store_module
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import SamplingParams
from fgchat.metrics import (
    TOKEN_COLUMNS,
    CsvAppender,
    new_session_id,
    read_requests_csv,
    read_session_ids,
    read_tokens_csv,
)
from fgchat.tui.store import (
    ChatStore,
    Conversation,
    Settings,
    StoredMessage,
    data_dir as fgchat_data_dir,
    new_chat_id,
)
from test_tui import SIZE, data_dir, make_app, type_prompt, wait_for, wait_ready  # noqa: F401

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---------------------------------------------------------------------------------------------
# signals: the real CLI on a pseudo-terminal


class PtyApp:
    """`python -m fgchat.cli` as a session leader on a new pty (its controlling terminal), with
    umask 0 so that every mode it creates is its own choice. Output is drained on a thread."""

    def __init__(self, model: Path, data: Path, log_csv: Path) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        # slow-steps and float32: the tiny model's reply (no end token before 1024 tokens in float32;
        # 138 tokens in bf16, which "auto" picks on CPUs with bf16 instructions) outlasts --log-csv's
        # sync, so a signal lands mid-reply
        env = dict(os.environ, FGCHAT_DATA_DIR=str(data), TERM="xterm-256color", FGCHAT_FAULT="slow-steps")
        for name in ("TEXTUAL", "COLUMNS", "LINES"):
            env.pop(name, None)

        def child_setup() -> None:
            os.umask(0)
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fgchat.cli", "--model", str(model), "--device", "cpu",
             "--mode", "eager", "--dtype", "float32", "--log-csv", str(log_csv)],
            stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO,
            start_new_session=True, preexec_fn=child_setup,
        )
        os.close(slave)
        self.output = bytearray()
        self.master_open = True
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.output.extend(data)

    def wait_output(self, text: bytes, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.proc.poll() is None, f"the app exited early: {bytes(self.output[-2000:])!r}"
            assert time.monotonic() < deadline, f"no {text!r} on screen: {bytes(self.output[-2000:])!r}"
            time.sleep(0.05)

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def hang_up(self) -> None:
        """Close the terminal: the kernel hangs up the pty (SIGHUP + SIGCONT to the app)."""
        os.close(self.master)
        self.master_open = False

    def children(self) -> dict[int, str]:
        out = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == self.proc.pid:
                    out[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
        return out

    def close(self) -> None:
        if self.proc.poll() is None:  # a failed test: do not leave the app (or its engine) behind
            for pid in self.children():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.proc.kill()
            self.proc.wait(10)
        if self.master_open:
            os.close(self.master)
            self.master_open = False


def csv_rows(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            return max(0, sum(1 for _ in f) - 1)
    except OSError:
        return 0


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def run_and_signal(tiny_llama: Path, tmp_path: Path, deliver) -> tuple[int, Path, Path, PtyApp]:
    """Start the app, send a prompt, call deliver(app) once the reply streams; returns the exit
    status and the data dir / --log-csv paths."""
    data = tmp_path / "data" / "fgchat"  # does not exist: the app creates it
    log_csv = tmp_path / "live.csv"
    app = PtyApp(tiny_llama, data, log_csv)
    try:
        app.wait_output(b"Enter sends", 60)  # the prompt's placeholder: the UI is up
        time.sleep(0.2)
        app.type("Hello there\r")
        deadline = time.monotonic() + 60
        while csv_rows(log_csv) < 10:  # --log-csv syncs at 10 Hz: the reply is streaming
            assert app.proc.poll() is None, bytes(app.output[-2000:])
            assert time.monotonic() < deadline, "no tokens in --log-csv"
            time.sleep(0.02)
        engines = [pid for pid, cmd in app.children().items() if "spawn_main" in cmd]
        assert len(engines) == 1, app.children()
        deliver(app)
        rc = app.proc.wait(30)
        # the engine child was stopped with the app, not left running
        deadline = time.monotonic() + 10
        while not gone(engines[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(engines[0]), "the engine process outlived the app"
        assert b"Traceback" not in app.output
        return rc, data, log_csv, app
    finally:
        app.close()


def assert_partial_reply_kept(data: Path, log_csv: Path) -> None:
    store = ChatStore(data / "chats.sqlite3")
    try:
        (summary,) = store.list_conversations()
        conv = store.load(summary.id)
    finally:
        store.close()
    assert [m.role for m in conv.messages] == ["user", "assistant"]
    user, reply = conv.messages
    assert user.content == "Hello there"
    assert reply.meta["finish"] == "interrupted"
    assert reply.content and 10 <= reply.meta["tokens"] < 1024
    # --log-csv holds every token the app had received, for that request, with one session id
    rows = read_tokens_csv(log_csv)
    sessions = read_session_ids(log_csv)
    mine = [r for r in rows if r.request_id == reply.meta["rid"] and r.chat_id == conv.id]
    assert [r.token_index for r in mine] == list(range(reply.meta["tokens"]))
    assert len(set(sessions)) == 1 and sessions[0]
    with open(log_csv, newline="", encoding="utf-8") as f:
        assert next(csv.reader(f)) == ["session_id", *TOKEN_COLUMNS]
    ui_log = (data / "ui.log").read_text()
    assert "1 reply in flight stored as interrupted" in ui_log


def test_sigterm_mid_reply_stores_the_partial_reply(tiny_llama, tmp_path):
    def two_sigterms(app: PtyApp) -> None:
        os.kill(app.proc.pid, signal.SIGTERM)
        time.sleep(0.03)
        os.kill(app.proc.pid, signal.SIGTERM)  # a second one during shutdown loses nothing

    rc, data, log_csv, _ = run_and_signal(tiny_llama, tmp_path, two_sigterms)
    assert rc == 128 + signal.SIGTERM
    assert_partial_reply_kept(data, log_csv)
    # private files, created under umask 0: the modes are the app's own
    assert mode_of(data) == 0o700
    for name in ("chats.sqlite3", "engine.log", "ui.log"):
        assert mode_of(data / name) == 0o600, name
    for extra in ("chats.sqlite3-wal", "chats.sqlite3-shm", "settings.json"):
        if (data / extra).exists():
            assert mode_of(data / extra) == 0o600, extra


def test_sighup_from_a_closed_terminal_stores_the_partial_reply(tiny_llama, tmp_path):
    def hang_up(app: PtyApp) -> None:
        app.hang_up()
        # what a shell does when its terminal goes: SIGHUP to the job's whole process group,
        # the engine child included (it keeps running until the app has stored the reply)
        os.killpg(app.proc.pid, signal.SIGHUP)

    rc, data, log_csv, _ = run_and_signal(tiny_llama, tmp_path, hang_up)
    assert rc == 128 + signal.SIGHUP
    assert_partial_reply_kept(data, log_csv)


# ---------------------------------------------------------------------------------------------
# a broken chat store: the app keeps running, says so, keeps the data in memory


def errors(app) -> list[str]:
    return [text for sev, text in app.notices if sev == "error"]


def warnings(app) -> list[str]:
    return [text for sev, text in app.notices if sev == "warning"]


async def chat_round(pilot, app, text: str) -> Conversation:
    conv = app.chats.current.conversation
    n = len(conv.messages)
    await type_prompt(pilot, text)
    await wait_for(pilot, lambda: len(conv.messages) == n + 2 and not app.replies, "a reply")
    assert [m.role for m in conv.messages[-2:]] == ["user", "assistant"]
    assert conv.messages[-1].meta["finish"] == "length" and conv.messages[-1].content
    return conv


def saved_chat(path: Path) -> Conversation:
    store = ChatStore(path)
    conv = Conversation(new_chat_id(), title="earlier chat")
    store.add_message(conv, StoredMessage("user", "earlier question"))
    store.add_message(conv, StoredMessage("assistant", "earlier answer", {"finish": "stop"}))
    store.close()
    return conv


def refuse_store_writes(monkeypatch) -> None:
    """A write-protected chats.sqlite3: opening it for writing is refused (as for a user without
    write permission; the tests may run as root, who has it anyway), so it is opened read-only."""
    real_open = store_module.open_private

    def refuse_the_store(target, flags):
        if Path(target).name == "chats.sqlite3":
            raise PermissionError(13, "Permission denied")
        return real_open(target, flags)

    monkeypatch.setattr(store_module, "open_private", refuse_the_store)


async def test_read_only_store(tiny_llama, data_dir, monkeypatch):
    data_dir.mkdir(parents=True)
    path = data_dir / "chats.sqlite3"
    old = saved_chat(path)
    refuse_store_writes(monkeypatch)
    app = make_app(tiny_llama, thread=True, max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        assert app.store.read_only
        (warning,) = warnings(app)
        assert "read-only" in warning and "Permission denied" in warning and "\n" not in warning

        # ctrl+o still lists and opens the stored chats
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: app.screen.query("#chat-list"), "saved chats list")
        app.screen.query_one("#chat-list").highlighted = 0
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chats.current.conversation.id == old.id, "chat reopened")
        conv = app.chats.current.conversation
        assert [m.content for m in conv.messages] == ["earlier question", "earlier answer"]

        # regenerate: deleting the old reply fails; said once, the new reply still comes
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(conv.messages) == 2 and not app.replies
                       and conv.messages[-1].content != "earlier answer", "regenerated")
        assert any("could not delete the replaced replies" in e for e in errors(app))

        # the system prompt: changed in memory, the failed save is reported
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: app.screen.query("#system-text"), "system prompt editor")
        app.screen.query_one("#system-text").text = "Be brief."
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: conv.system_prompt == "Be brief.", "system prompt set")
        await wait_for(pilot, lambda: any("could not save the system prompt" in e for e in errors(app)),
                       "save failure shown")

        # a new chat works; its messages live in memory, each failed save is one line
        await pilot.press("ctrl+n")
        await chat_round(pilot, app, "still there?")
        assert any("could not save the message" in e for e in errors(app))
        assert all("\n" not in e for e in errors(app))
        assert app.is_running
    # nothing on disk changed
    monkeypatch.undo()
    store = ChatStore(path)
    assert [s.id for s in store.list_conversations()] == [old.id]
    assert [m.content for m in store.load(old.id).messages] == ["earlier question", "earlier answer"]
    store.close()


def corrupt_pages(path: Path) -> None:
    """Keep page 1 (header + schema) and garble the rest: the file opens, every query fails."""
    saved_chat(path)
    data = bytearray(path.read_bytes())
    assert len(data) > 4096 * 2
    data[4096:] = b"\xa5" * (len(data) - 4096)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["not-a-database", "malformed-pages", "data-dir-is-a-file"])
async def test_broken_store_leaves_a_working_app(tiny_llama, data_dir, damage):
    if damage == "data-dir-is-a-file":
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        data_dir.write_text("not a directory\n")
        path = None
    else:
        data_dir.mkdir(parents=True)
        path = data_dir / "chats.sqlite3"
        if damage == "not-a-database":
            path.write_bytes(b"this is not an SQLite database\n" * 200)
        else:
            corrupt_pages(path)
    before = path.read_bytes() if path else data_dir.read_bytes()

    app = make_app(tiny_llama, thread=True, max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        if damage == "malformed-pages":
            assert not app.store.in_memory and warnings(app) == []  # it opens: queries fail later
        else:  # cannot be opened at all: chats in memory, one warning
            assert app.store.in_memory
            (warning,) = warnings(app)
            assert "kept in memory" in warning and "\n" not in warning

        await pilot.press("ctrl+o")
        await pilot.pause(0.2)
        if damage == "malformed-pages":
            (error,) = errors(app)
            assert error.startswith("could not list the saved chats") and "malformed" in error
            assert not app.screen.query("#chat-list") and not app.screen.query("#chat-list-empty")
        else:
            assert app.screen.query("#chat-list-empty")  # the in-memory store: no chats yet
            await pilot.press("escape")
            await pilot.pause(0.1)

        conv = await chat_round(pilot, app, "hello")
        await chat_round(pilot, app, "again")
        assert len(conv.messages) == 4
        if damage == "malformed-pages":
            assert sum("could not save the message" in e for e in errors(app)) == 4
        else:
            assert errors(app) == []
            assert [m.content for m in app.store.load(conv.id).messages] == [m.content for m in conv.messages]
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: app.screen.query("#chat-list"), "the chat in memory listed")
            await pilot.press("escape")
        assert app.is_running
    assert (path.read_bytes() if path else data_dir.read_bytes()) == before  # never overwritten


def test_store_errors_are_one_line_fgchat_errors(tmp_path):
    path = tmp_path / "chats.sqlite3"
    corrupt_pages(path)
    store = ChatStore(path)
    for call in (store.list_conversations, lambda: store.load("x"),
                 lambda: store.add_message(Conversation("c"), StoredMessage("user", "x"))):
        with pytest.raises(FgchatError) as info:
            call()
        assert "malformed" in str(info.value) and "\n" not in str(info.value)
    store.close()
    with pytest.raises(FgchatError, match="cannot open chat store"):
        ChatStore(tmp_path)  # a directory


# ---------------------------------------------------------------------------------------------
# private files


def sighup_blocked(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    raise AssertionError("no SigBlk line")


@pytest.fixture
def umask0():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_new_data_dir_and_files_are_private(tmp_path, monkeypatch, umask0):
    target = tmp_path / "share" / "fgchat"
    monkeypatch.setenv("FGCHAT_DATA_DIR", str(target))
    assert fgchat_data_dir() == target
    assert mode_of(target) == 0o700
    store = ChatStore(target / "chats.sqlite3")
    conv = Conversation(new_chat_id())
    store.add_message(conv, StoredMessage("user", "secret"))
    for name in ("chats.sqlite3", "chats.sqlite3-wal", "chats.sqlite3-shm"):
        assert mode_of(target / name) == 0o600, name
    store.close()
    Settings(target / "settings.json").set("theme", "x")
    assert mode_of(target / "settings.json") == 0o600


async def test_existing_files_are_tightened(tiny_llama, data_dir, umask0):
    """Files from an older fgchat (0644) become 0600 when opened; engine.log is opened by the
    engine process (the app's default engine). A pre-existing FGCHAT_DATA_DIR keeps its mode;
    a file of another user's is left alone."""
    data_dir.mkdir(parents=True, mode=0o755)
    saved_chat(data_dir / "chats.sqlite3")
    for name in ("engine.log", "settings.json", "ui.log"):
        (data_dir / name).write_text("{}\n" if name == "settings.json" else "old line\n")
    for path in data_dir.iterdir():
        path.chmod(0o644)
    foreign = data_dir / "foreign.json"
    foreign.write_text("{}")
    foreign.chmod(0o644)
    if os.geteuid() == 0:
        os.chown(foreign, 4321, 4321)

    app = make_app(tiny_llama, max_tokens=4)  # engine in its own process: it opens engine.log
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        app._log_problem("a line for ui.log")
        for name in ("chats.sqlite3", "engine.log", "settings.json", "ui.log"):
            assert mode_of(data_dir / name) == 0o600, name
        for name in ("chats.sqlite3-wal", "chats.sqlite3-shm"):
            assert mode_of(data_dir / name) == 0o600, name
        # (while an engine process is at hand: it blocks SIGHUP, so a hangup sent to the whole
        # process group leaves it to the app, which stores the replies first, then stops it)
        assert sighup_blocked(app.link.handle.pid)
        assert not sighup_blocked(os.getpid())  # the app's own mask is back as it was
    assert mode_of(data_dir) == 0o755
    Settings(foreign)
    assert mode_of(foreign) == (0o644 if os.geteuid() == 0 else 0o600)


# ---------------------------------------------------------------------------------------------
# --log-csv across sessions


async def test_two_sessions_append_distinct_rows_to_one_log_csv(tiny_llama, data_dir, tmp_path):
    path = tmp_path / "live.csv"
    sessions = []
    for _ in range(2):
        app = make_app(tiny_llama, thread=True, max_tokens=6,
                       log_csv=CsvAppender(path, session_id=new_session_id()))
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot, app)
            await chat_round(pilot, app, "log me")
            if not sessions:
                exported = app.log_files.export(tmp_path / "run-tokens.csv")
        assert app.latency.log.session_id == app.session_id == app.log_files.appender.session_id
        sessions.append(app.session_id)
    assert sessions[0] != sessions[1]

    rows = read_tokens_csv(path)
    ids = read_session_ids(path)
    assert len(rows) == len(ids) == 12
    assert Counter(ids) == {sessions[0]: 6, sessions[1]: 6}
    # both sessions numbered their request 1 and started t_ms at 0: only session_id tells apart
    assert {r.request_id for r in rows} == {1}
    keys = [(s, r.request_id, r.chat_id, r.token_index) for s, r in zip(ids, rows)]
    assert len(set(keys)) == len(keys)
    with open(path, encoding="utf-8") as f:
        assert sum(line.startswith("session_id,") for line in f) == 1  # one header

    # the ctrl+s export carries it too (tokens and requests)
    tokens_csv, requests_csv = exported
    assert set(read_session_ids(tokens_csv)) == {sessions[0]} and len(read_tokens_csv(tokens_csv)) == 6
    assert read_session_ids(requests_csv) == [sessions[0]]
    assert read_requests_csv(requests_csv)[0].output_tokens == 6


def test_log_csv_from_before_session_ids_is_refused_and_still_read(tiny_llama, tmp_path):
    old = tmp_path / "old.csv"
    old.write_text(",".join(TOKEN_COLUMNS) + "\n1,c1,0,eager,1,12.500,,,1,16,16,\n")
    before = old.read_text()
    with pytest.raises(FgchatError) as info:
        CsvAppender(old, session_id=new_session_id())
    message = str(info.value)
    assert "session_id" in message and "\n" not in message
    assert old.read_text() == before  # never appended to, never rewritten
    # the readers take both formats
    assert [r.token_index for r in read_tokens_csv(old)] == [0]
    assert read_session_ids(old) == [""]
    # a file written without session ids can still be appended to by a writer without one
    with CsvAppender(old) as appender:
        appender.append(read_tokens_csv(old))
    assert len(read_tokens_csv(old)) == 2

    # the CLI refuses it in one line before the UI starts
    env = dict(os.environ, FGCHAT_DATA_DIR=str(tmp_path / "data"))
    result = subprocess.run(
        [sys.executable, "-m", "fgchat.cli", "--model", str(tiny_llama), "--device", "cpu",
         "--log-csv", str(old)],
        capture_output=True, text=True, env=env, cwd=REPO, stdin=subprocess.DEVNULL, timeout=60,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "session_id" in lines[0], result.stderr
    assert old.read_text().count("\n") == 3


def test_session_ids_are_unique_and_sortable():
    ids = {new_session_id() for _ in range(50)}
    assert len(ids) == 50
    for sid in ids:
        stamp, _, suffix = sid.partition("-")
        assert len(stamp) == 16 and stamp.endswith("Z") and len(suffix) == 8


async def test_reply_ending_while_its_bubble_is_torn_down():
    """A reply can end while the app exits and removes its widgets (seen on the H200 at K 8):
    finishing a bubble whose header is gone must not raise; its status and text stay recorded."""
    from textual.app import App

    from fgchat.tui.chat_view import MessageBubble

    bubble = MessageBubble("assistant", "partial", streaming=True)

    class One(App):
        def compose(self):
            yield bubble

    async with One().run_test() as pilot:
        await pilot.pause()
        assert "generating" in str(bubble.query_one(".bubble-header").render())
        await bubble.remove_children()
        await bubble.finish("12 tok", final_text="partial reply")
        assert bubble.status == "12 tok" and bubble.text == "partial reply" and not bubble.streaming
