"""Conversation persistence (SQLite) and UI settings (JSON) in the user's data directory.

Location: $FGCHAT_DATA_DIR if set, else platformdirs.user_data_dir("fgchat").

Invariants:
- A message is written (and committed) as soon as it is complete: user turns on send, replies
  when they finish, partial replies when they stop, fail or the app exits. Nothing is rewritten
  in place except a conversation's title, system prompt and updated time.
- Regenerate deletes the replies it replaces, never a user turn.
- No UI imports: this module is plain Python so tests and scripts can read what the app wrote.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fgchat.engine.errors import FgchatError

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


def data_dir() -> Path:
    """The directory holding chats.sqlite3, settings.json, engine.log (created if missing)."""
    env = os.environ.get("FGCHAT_DATA_DIR")
    if env:
        path = Path(os.path.expanduser(env))
    else:
        import platformdirs

        path = Path(platformdirs.user_data_dir("fgchat"))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FgchatError(f"cannot create data directory {path}: {exc.strerror or exc}") from None
    return path


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
        """Messages for the chat template: system prompt, then every turn except extra samples."""
        out: list[dict[str, str]] = []
        if self.system_prompt.strip():
            out.append({"role": "system", "content": self.system_prompt})
        for m in self.messages:
            if m.meta.get("alt"):
                continue  # extra samples are shown and stored, not fed back
            if m.role == "assistant" and not m.content and m.meta.get("finish") == "error":
                continue  # a reply that failed before its first token adds nothing
            out.append({"role": m.role, "content": m.content})
        return out


@dataclass
class ConversationSummary:
    id: str
    title: str
    updated: float
    message_count: int


class ChatStore:
    """SQLite store of conversations. Thread-safe (one connection behind a lock)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise FgchatError(f"cannot open chat store {self.path}: {exc}") from None

    def _exec(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    # ---- writes ----
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

    def add_message(self, conv: Conversation, msg: StoredMessage) -> None:
        """Append one complete message (saving the conversation row first if needed)."""
        self.save_conversation(conv)
        cur = self._exec(
            "INSERT INTO messages(conversation_id, role, content, meta, created) VALUES (?,?,?,?,?)",
            (conv.id, msg.role, msg.content, json.dumps(msg.meta), time.time()),
        )
        msg.id = cur.lastrowid

    def delete_messages(self, conv: Conversation, ids: list[int]) -> None:
        with self._lock:
            self._db.executemany("DELETE FROM messages WHERE id = ? AND conversation_id = ?",
                                 [(i, conv.id) for i in ids])

    def delete_conversation(self, chat_id: str) -> None:
        self._exec("DELETE FROM conversations WHERE id = ?", (chat_id,))

    # ---- reads ----
    def list_conversations(self, limit: int = 200) -> list[ConversationSummary]:
        rows = self._exec(
            "SELECT c.id, c.title, c.updated, COUNT(m.id) FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id "
            "GROUP BY c.id ORDER BY c.updated DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [ConversationSummary(r[0], r[1], r[2], r[3]) for r in rows]

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


class Settings:
    """Small JSON settings file (theme, samples per prompt, ...); unreadable files are ignored."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.values: dict[str, Any] = {}
        try:
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                self.values = loaded
        except (OSError, ValueError):
            pass

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def set(self, key: str, value: Any) -> None:
        """Set and save at once (atomic replace); a failed save keeps the value in memory."""
        self.values[key] = value
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(self.values, indent=1), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            try:
                tmp.unlink()
            except OSError:
                pass
