"""Conversation persistence (SQLite) and UI settings (JSON) in the user's data directory.

Location: $FGCHAT_DATA_DIR if set, else platformdirs.user_data_dir("fgchat").
Privacy: chats are private. The data directory is created 0700 (the default location is also
tightened to 0700 when it is more open); chats.sqlite3 (and SQLite's -wal/-shm files, which take
its mode), settings.json, ui.log and engine.log are created 0600, and existing ones owned by the
user lose their group/other bits when opened.

Invariants:
- A message is written (and committed) as soon as it is complete: user turns on send, replies
  when they finish, partial replies when they stop, fail or the app exits. Nothing is rewritten
  in place except a conversation's title, system prompt and updated time.
- Regenerate deletes the replies it replaces, never a user turn.
- No UI imports: this module is plain Python so tests and scripts can read what the app wrote.
- Every store failure is one-line `FgchatError` (sqlite's own errors, too), so callers can guard
  each call with one `except` and keep the data in memory.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import stat
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fgchat.protocol.errors import FgchatError

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def data_dir_path() -> Path:
    """Where the data directory is ($FGCHAT_DATA_DIR or the platform default); creates nothing."""
    env = os.environ.get("FGCHAT_DATA_DIR")
    if env:
        return Path(os.path.expanduser(env))
    import platformdirs

    return Path(platformdirs.user_data_dir("fgchat"))


def data_dir() -> Path:
    """The directory holding chats.sqlite3, settings.json, engine.log (created 0700 if missing).

    The default location is fgchat's own directory: if it is more open than 0700 (and ours) it is
    tightened. A pre-existing $FGCHAT_DATA_DIR keeps its mode (the files in it are 0600 anyway).
    """
    path = data_dir_path()
    try:
        if not path.is_dir():
            path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
            tighten_mode(path)  # mkdir's mode is subject to the umask, which only removes bits
        elif not os.environ.get("FGCHAT_DATA_DIR"):
            tighten_mode(path)
    except OSError as exc:
        raise FgchatError(f"cannot create data directory {path}: {exc.strerror or exc}") from None
    return path



def usable_data_dir() -> tuple[Path, str]:
    """`data_dir()`, or where it should be with the one-line reason it cannot be made ("" when
    it can): the app shows the reason and carries on without stored chats."""
    try:
        return data_dir(), ""
    except FgchatError as exc:
        return data_dir_path(), str(exc)

def tighten_mode(path: str | os.PathLike[str], fd: int | None = None) -> None:
    """Remove group/other permission bits from a file or directory the user owns (else leave it)."""
    try:
        st = os.fstat(fd) if fd is not None else os.stat(path)
    except OSError:
        return
    if st.st_uid != os.getuid() or not (st.st_mode & 0o077):
        return
    mode = stat.S_IMODE(st.st_mode) & ~0o077
    try:
        if fd is not None:
            os.fchmod(fd, mode)
        else:
            os.chmod(path, mode)
    except OSError:
        pass


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """os.open creating the file 0600 (an existing file of the user's is tightened to 0600)."""
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE_MODE)
    tighten_mode(path, fd)
    return fd


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def _store_errors(method):
    """sqlite3 errors (and OS errors) out of a ChatStore method become one-line FgchatError."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except FgchatError:
            raise
        except (sqlite3.Error, OSError) as exc:
            raise FgchatError(f"chat store {self.path}: {_one_line(exc)}") from exc

    return wrapper


def new_chat_id() -> str:
    return uuid.uuid4().hex[:10]


@dataclass
class StoredMessage:
    role: str  # "user" | "assistant"
    content: str
    meta: dict[str, Any] = field(default_factory=dict)  # finish, alt (extra sample), error, rid
    id: int | None = None


@dataclass
class Conversation:
    id: str
    title: str = "New chat"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    messages: list[StoredMessage] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    saved: bool = False  # a row exists in the database

    def prompt_messages(self) -> list[dict[str, str]]:
        """Messages for the chat template: the system prompt (when not blank), then the turns,
        always alternating user/assistant and starting with a user turn.

        Some chat templates (Mistral's) reject a conversation whose roles do not alternate, so
        whatever failed earlier, the list sent to the engine alternates. The stored history is
        not changed (the chat still shows what happened); only this prompt view is. The rule:

        - Extra samples (meta "alt", replies 2..K of K) are shown and stored, never fed back;
          only the primary reply (1 of K) is a conversation turn.
        - An assistant reply with text is sent as it is, also a partial one (cancelled, failed
          mid-reply, cut off by an engine stop): the user saw that text and may refer to it.
        - An assistant reply without text (failed before its first token, or empty / blank)
          adds nothing and is left out; so is a user turn that never got a stored reply. The
          user turns that then follow each other are merged into one user turn, their texts
          joined with a blank line, in order: the model sees everything the user wrote.
        - Two assistant turns in a row (not written by the app, but possible in an old or
          hand-edited store) are merged the same way; an assistant turn before the first user
          turn answers nothing and is left out.

        So the result is [system], user, assistant, user, ..., and it ends with a user turn
        whenever the last stored turn that counts is a user turn (the case when a reply is asked
        for).
        """
        out: list[dict[str, str]] = []
        if self.system_prompt.strip():
            out.append({"role": "system", "content": self.system_prompt})
        turns: list[dict[str, str]] = []
        for m in self.messages:
            if m.role not in ("user", "assistant"):
                continue
            if m.meta.get("alt"):
                continue  # extra samples are shown and stored, not fed back
            if m.role == "assistant" and not m.content.strip():
                continue  # a reply without text (failed before its first token, empty) adds nothing
            if m.role == "assistant" and not turns:
                continue  # nothing before it to answer
            if turns and turns[-1]["role"] == m.role:
                turns[-1]["content"] += "\n\n" + m.content  # keep roles alternating: merge
            else:
                turns.append({"role": m.role, "content": m.content})
        return out + turns


@dataclass
class ConversationSummary:
    id: str
    title: str
    updated: float
    message_count: int


class ChatStore:
    """SQLite store of conversations. Thread-safe (one connection behind a lock).

    `ChatStore(path)` opens (creating 0600) for reading and writing; `read_only=True` opens an
    existing store without ever writing to it (writes then fail with FgchatError): in a
    read-only or immutable directory, where SQLite cannot create the -shm file a WAL store needs,
    it is opened immutable (`immutable` then True: SQLite assumes nobody changes the file);
    `ChatStore(":memory:")` keeps chats in memory only. Any failure is one-line FgchatError.
    """

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.in_memory = os.fspath(path) == ":memory:"
        self.read_only = read_only and not self.in_memory
        self.immutable = False
        self._lock = threading.Lock()
        db = None
        try:
            if self.in_memory:
                db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
            elif self.read_only:
                db = self._open_read_only()
            else:
                os.close(open_private(self.path, os.O_RDWR))  # created 0600 before SQLite sees it
                db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA foreign_keys = ON")
            if not self.read_only:
                db.execute("PRAGMA journal_mode = WAL")
                db.executescript(_SCHEMA)
                for suffix in ("-wal", "-shm"):  # SQLite gives them the database's mode
                    tighten_mode(f"{self.path}{suffix}")
        except (sqlite3.Error, OSError) as exc:
            if db is not None:
                try:
                    db.close()
                except sqlite3.Error:
                    pass
            reason = getattr(exc, "strerror", None) if isinstance(exc, OSError) else None
            raise FgchatError(f"cannot open chat store {self.path}: {reason or _one_line(exc)}") from None
        self._db = db

    def _open_read_only(self) -> sqlite3.Connection:
        """The store read-only; immutable when plain read-only fails (a WAL store in a directory
        where its -shm cannot be created)."""
        plain = "file:" + urllib.parse.quote(os.fspath(self.path.absolute())) + "?mode=ro"
        try:
            return _readable(plain)
        except sqlite3.Error:
            db = _readable(plain + "&immutable=1")
            self.immutable = True
            return db

    def _exec(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    # ---- writes ----
    @_store_errors
    def save_conversation(self, conv: Conversation) -> None:
        """Insert or update the conversation row (title, system prompt, updated)."""
        conv.updated = time.time()
        self._exec(
            "INSERT INTO conversations(id, title, system_prompt, created, updated) VALUES (?,?,?,?,?) "
            "ON CONFLICT(id) DO UPDATE SET title=excluded.title, system_prompt=excluded.system_prompt, "
            "updated=excluded.updated",
            (conv.id, conv.title, conv.system_prompt, conv.created, conv.updated),
        )
        conv.saved = True

    @_store_errors
    def add_message(self, conv: Conversation, msg: StoredMessage) -> None:
        """Append one complete message (saving the conversation row first if needed)."""
        self.save_conversation(conv)
        cur = self._exec(
            "INSERT INTO messages(conversation_id, role, content, meta, created) VALUES (?,?,?,?,?)",
            (conv.id, msg.role, msg.content, json.dumps(msg.meta), time.time()),
        )
        msg.id = cur.lastrowid

    @_store_errors
    def delete_messages(self, conv: Conversation, ids: list[int]) -> None:
        with self._lock:
            self._db.executemany("DELETE FROM messages WHERE id = ? AND conversation_id = ?",
                                 [(i, conv.id) for i in ids])

    @_store_errors
    def delete_conversation(self, chat_id: str) -> None:
        self._exec("DELETE FROM conversations WHERE id = ?", (chat_id,))

    # ---- reads ----
    @_store_errors
    def list_conversations(self, limit: int = 200) -> list[ConversationSummary]:
        rows = self._exec(
            "SELECT c.id, c.title, c.updated, COUNT(m.id) FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id "
            "GROUP BY c.id ORDER BY c.updated DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [ConversationSummary(r[0], r[1], r[2], r[3]) for r in rows]

    @_store_errors
    def load(self, chat_id: str) -> Conversation | None:
        row = self._exec(
            "SELECT id, title, system_prompt, created, updated FROM conversations WHERE id = ?", (chat_id,)
        ).fetchone()
        if row is None:
            return None
        msgs = self._exec(
            "SELECT id, role, content, meta FROM messages WHERE conversation_id = ? ORDER BY id", (chat_id,)
        ).fetchall()
        messages = [StoredMessage(r[1], r[2], _meta(r[3]), r[0]) for r in msgs]
        return Conversation(row[0], row[1], row[2], messages, row[3], row[4], saved=True)

    def close(self) -> None:
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:
                pass


def _readable(uri: str) -> sqlite3.Connection:
    """A connection to the store at `uri`, checked readable (closed again when not)."""
    db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
    try:
        db.execute("SELECT COUNT(*) FROM conversations").fetchone()
    except sqlite3.Error:
        db.close()
        raise
    return db


def _meta(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def title_from(text: str, width: int = 24) -> str:
    """A short one-line title from the first user message."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


# the settings the app reads and the types their values must have; a value of another type is
# ignored (and kept in the file as the user wrote it); keys not listed here are kept as they are
SETTING_TYPES: dict[str, tuple[type, ...]] = {
    "samples": (int,),
    "system_prompt": (str,),
    "theme": (str,),
    "export_folder": (str, type(None)),
    "sampling_overrides": (dict,),
    "sampling": (dict, type(None)),
    "thinking": (bool, type(None)),
}
_TYPE_NAMES = {int: "a whole number", str: "text", dict: "a table", type(None): "null", bool: "true or false"}


def _wrong_type(key: str, value: Any) -> str:
    """Why `value` cannot be setting `key` ("" when it can)."""
    allowed = SETTING_TYPES.get(key)
    if allowed is None or (isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool))):
        return ""
    wanted = " or ".join(_TYPE_NAMES[t] for t in allowed)
    shown = json.dumps(value)
    shown = shown if len(shown) <= 24 else shown[:23] + "…"
    return f'settings.json: "{key}" is {shown}, not {wanted}; ignored'


class Settings:
    """Small JSON settings file (theme, samples per prompt, system prompt, ...).

    Invariants:
    - What the user wrote is never lost: a value of the wrong type is ignored (`get` gives the
      default) but stays in the file; a file that is not a JSON object is moved aside as
      settings.json.bad-<time> before anything writes settings.json, and one that cannot be read
      or moved aside is left untouched (changes are then kept in memory only).
    - `problems` holds one line per thing ignored, naming the key or the file, for the app to show.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.values: dict[str, Any] = {}
        self.problems: list[str] = []
        self.ignored: set[str] = set()  # keys whose saved values have the wrong type
        self.writable = True  # False: the file is left as it is; changes stay in memory
        tighten_mode(self.path)
        try:
            loaded = json.loads(self.path.read_bytes().decode("utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError(f"not a JSON object but {type(loaded).__name__}")
        except (FileNotFoundError, NotADirectoryError):  # none yet (or no data dir: the app says so)
            return
        except OSError as exc:
            self._leave_untouched(exc.strerror or _one_line(exc))
            return
        except ValueError as exc:  # JSON syntax, bad UTF-8, not an object
            self._move_aside(_one_line(exc))
            return
        self.values = loaded
        for key, value in loaded.items():
            problem = _wrong_type(key, value)
            if problem:
                self.ignored.add(key)
                self.problems.append(problem)

    def _leave_untouched(self, reason: str) -> None:
        self.writable = False
        self.problems.append(f"{self.path.name} could not be read ({reason}): left untouched; "
                             "settings changed now are kept for this session only")

    def _move_aside(self, reason: str) -> None:
        """The unreadable file to settings.json.bad-<time> (a free name), so a later save
        never overwrites it; left untouched when it cannot be moved."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for n in range(1, 100):
            aside = self.path.with_name(f"{self.path.name}.bad-{stamp}" + (f"-{n}" if n > 1 else ""))
            if not os.path.lexists(aside):
                break
        else:
            self._leave_untouched(f"{reason}; no free name to move it aside")
            return
        try:
            os.rename(self.path, aside)
        except OSError as exc:
            self._leave_untouched(f"{reason}; cannot move it aside: {exc.strerror or _one_line(exc)}")
            return
        self.problems.append(f"{self.path.name} could not be read ({reason}): kept as {aside}; "
                             "using default settings")

    def get(self, key: str, default: Any = None) -> Any:
        """The saved value of `key`; `default` when there is none or it has the wrong type."""
        return default if key in self.ignored else self.values.get(key, default)

    def set(self, key: str, value: Any) -> None:
        """Set and save at once (atomic replace, file 0600); a failed save keeps the value in memory."""
        self.values[key] = value
        self.ignored.discard(key)
        if not self.writable:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(self.values, indent=1))
            os.replace(tmp, self.path)
        except OSError:
            try:
                tmp.unlink()
            except OSError:
                pass
