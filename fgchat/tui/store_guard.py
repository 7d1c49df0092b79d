"""Chat store calls that never end the app, and the ui.log for problems nobody can see any more.

Invariants:
- A failed ChatStore call is one line: a ui.log entry always, and an error notification while
  the app still shows notifications (not after exit began). The caller's data stays in memory.
- ui.log is private (0600) and only appended to.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fgchat.tui.store import ChatStore, Conversation, StoredMessage, open_private


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

    def call(self, what: str, call: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """`call(*args)`; on failure (sqlite/OS errors, a closed store) one line, and `default`."""
        try:
            return call(*args)
        except Exception as exc:
            text = f"could not {what}: {one_line(exc)}"
            log_problem(self.data_path, text)
            if not self.quiet:
                self._notify(f"{text} (kept in memory)")
            return default

    def add_message(self, conversation: Conversation, msg: StoredMessage) -> None:
        self.call("save the message", self.store.add_message, conversation, msg)
