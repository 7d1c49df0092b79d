"""Chat store calls that never end the app, and the ui.log for problems nobody can see any more.

Invariants:
- A failed ChatStore call is one line: a ui.log entry always, and an error notification while
  the app still shows notifications (not after exit began). The caller's data stays in memory.
- A chat that the store does not hold as it is (a write to it failed, or the store is in
  memory) is in `unsaved` until exit, when `keep_unsaved` writes every such chat whole to a
  JSON file (0600, a new file, never one that exists) in the first folder that takes it.
- ui.log is private (0600) and only appended to.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fgchat.tui.store import ChatStore, Conversation, StoredMessage, open_private

NAMED_CHATS = 3  # the exit line names this many unsaved chats, then counts the rest


def one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def log_problem(data_path: Path, text: str) -> None:
    """Append one line to <data dir>/ui.log (0600); silently nothing when it cannot be written."""
    try:
        fd = open_private(Path(data_path) / "ui.log", os.O_WRONLY | os.O_APPEND)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
    except OSError:
        pass


class StoreGuard:
    """Runs ChatStore calls for the chat components; `notify(text)` shows an error line."""

    def __init__(self, store: ChatStore, data_path: Path, notify: Callable[[str], None]) -> None:
        self.store = store
        self.data_path = data_path
        self._notify = notify
        self.quiet = False  # exit began: failures go to ui.log only
        self.unsaved: dict[str, Conversation] = {}  # chat id -> a chat the store lacks (in part)

    def call(self, what: str, call: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """`call(*args)`; on failure (sqlite/OS errors, a closed store) one line, and `default`.
        A chat among `args` is unsaved when the call failed or the store is in memory."""
        try:
            result = call(*args)
        except Exception as exc:
            text = f"could not {what}: {one_line(exc)}"
            log_problem(self.data_path, text)
            if not self.quiet:
                self._notify(f"{text} (kept in memory)")
            result, failed = default, True
        else:
            failed = False
        if failed or self.store.in_memory:
            self.unsaved.update((a.id, a) for a in args if isinstance(a, Conversation))
        return result

    def add_message(self, conversation: Conversation, msg: StoredMessage) -> None:
        self.call("save the message", self.store.add_message, conversation, msg)

    def keep_unsaved(self, name: str, folders: Iterable[Path]) -> str:
        """At exit: every unsaved chat, whole, to <folder>/<name>-chats.json in the first of
        `folders` where a new file can be written. Returns the line that names the chats and
        the file (or why none could be written); "" when every chat is in the store."""
        chats = list(self.unsaved.values())
        if not chats:
            return ""
        titles = ", ".join(f'"{c.title}"' for c in chats[:NAMED_CHATS])
        more = f" and {len(chats) - NAMED_CHATS} more" if len(chats) > NAMED_CHATS else ""
        what = f"{len(chats)} chat{'s' if len(chats) > 1 else ''} not in the chat store ({titles}{more})"
        text = json.dumps({"chats": [_chat_record(c) for c in chats]}, indent=1, ensure_ascii=False)
        reasons = []
        for folder in folders:
            try:
                path = _write_new(Path(folder) / f"{name}-chats.json", text)
            except OSError as exc:
                reasons.append(f"{folder}: {exc.strerror or one_line(exc)}")
                continue
            note = f"{what} written to {path}"
            log_problem(self.data_path, note)
            return note
        note = f"{what} could not be written anywhere ({'; '.join(reasons)})"
        log_problem(self.data_path, note)
        return note


def _chat_record(conversation: Conversation) -> dict[str, Any]:
    """A chat as plain JSON values: what ChatStore keeps of it (no row ids)."""
    record = dataclasses.asdict(conversation)
    record.pop("saved", None)
    record["messages"] = [{k: v for k, v in m.items() if k != "id"} for m in record["messages"]]
    return record


def _write_new(path: Path, text: str) -> Path:
    """`text` to `path` as a new 0600 file (`path` with -2, -3, ... when it exists)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for n in range(1, 100):
        candidate = path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")
        try:
            fd = open_private(candidate, os.O_WRONLY | os.O_EXCL)
        except FileExistsError:
            continue
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError:  # a full disk: no partial file left behind
            candidate.unlink(missing_ok=True)
            raise
        return candidate
    raise FileExistsError(17, "no free file name", str(path))
