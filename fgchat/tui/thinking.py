"""A reply's think block (Qwen3 and its kind: `<think> ... </think>` before the answer) and the
thinking setting (the chat template's `enable_thinking`).

Invariants:
- A reply has a think block when its text, leading whitespace aside, starts with THINK_OPEN; the
  block ends at the first THINK_CLOSE after it (or is still open). Any other reply is all answer.
- Split parts of a streamed text only grow as the text grows (text is only appended while it
  streams): the thinking part never holds a trailing piece that may still become THINK_CLOSE,
  the answer is empty until the block closes (or the text is known to have no block), so both
  can be drawn by appending.
- Thinking tokens (`ThinkCounter`) are the tokens from the one that opens the block to the one
  that completes THINK_CLOSE, both included; every token is still counted and logged as a
  token of the reply (the fold is drawing only).
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SETTING_KEY = "thinking"  # settings.json: true, false or null (the template's default)
THINKING_LABELS = {None: "template default", True: "on", False: "off"}


@dataclass(frozen=True)
class ThinkSplit:
    """`thinking` is None when the text has no think block (or may still open one: `undecided`)."""

    thinking: str | None
    answer: str
    closed: bool = False  # the block's THINK_CLOSE has arrived
    undecided: bool = False  # the text so far is a prefix of THINK_OPEN: nothing to draw yet


def _partial_close(text: str) -> int:
    """Length of the longest proper prefix of THINK_CLOSE that `text` ends with."""
    for n in range(min(len(THINK_CLOSE) - 1, len(text)), 0, -1):
        if text.endswith(THINK_CLOSE[:n]):
            return n
    return 0


def split_thinking(text: str, *, final: bool = False) -> ThinkSplit:
    """The thinking and the answer of a reply's text: streamed so far, or whole (`final`: nothing
    more comes, so nothing is held back as undecided)."""
    head = text.lstrip()
    if not head.startswith(THINK_OPEN):
        if THINK_OPEN.startswith(head) and not final:
            return ThinkSplit(None, "", undecided=True)
        return ThinkSplit(None, text)
    body = head[len(THINK_OPEN):]
    end = body.find(THINK_CLOSE)
    if end < 0:
        held = 0 if final else _partial_close(body)
        return ThinkSplit(body[:len(body) - held].lstrip(), "")
    return ThinkSplit(body[:end].lstrip(), body[end + len(THINK_CLOSE):].lstrip(), closed=True)


class ThinkCounter:
    """Counts a streamed reply's thinking tokens, one token's text at a time, in constant memory."""

    def __init__(self) -> None:
        self.state = "start"  # start (undecided) | open | closed | none (no think block)
        self.tokens = 0
        self._head = ""  # the text while undecided
        self._tail = ""  # the last characters of an open block (THINK_CLOSE split over tokens)

    @property
    def found(self) -> bool:
        return self.state in ("open", "closed")

    def feed(self, text: str) -> None:
        if self.state in ("closed", "none"):
            return
        self.tokens += 1
        if self.state == "open":
            self._scan(text)
            return
        self._head += text
        head = self._head.lstrip()
        if head.startswith(THINK_OPEN):
            self.state = "open"
            self._head = ""
            self._scan(head[len(THINK_OPEN):])
        elif not THINK_OPEN.startswith(head):
            self.state, self.tokens, self._head = "none", 0, ""

    def _scan(self, text: str) -> None:
        window = self._tail + text
        if THINK_CLOSE in window:
            self.state, self._tail = "closed", ""
        else:
            self._tail = window[-(len(THINK_CLOSE) - 1):]


def thinking_summary(tokens: int | None, *, streaming: bool, expanded: bool, key: str) -> str:
    """The folded block's one line: "thinking · 143 tokens · F8 expands"."""
    what = "thinking…" if streaming else "thinking"
    count = "" if tokens is None else f" · {tokens} token{'' if tokens == 1 else 's'}"
    arrow = "▾" if expanded else "▸"
    return f"{arrow} {what}{count} · {key} {'folds' if expanded else 'expands'}"
