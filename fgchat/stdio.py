"""Terminal-safe output helpers for the CLI (no torch import).

- `TerminalSanitizer` strips terminal control and escape sequences from streamed model text, so
  a model cannot move the cursor, retitle the window, set the clipboard (OSC 52) or hide text when
  its output goes to a terminal. It keeps state between calls: a sequence split across tokens is
  still removed whole.
- `silence_stdout` is the Python docs' recipe for a closed pipe (`fgchat generate | head`): point
  stdout at devnull so nothing more (not even the flush at exit) raises BrokenPipeError.
- `one_line` makes an error message safe to print as one line.
"""

from __future__ import annotations

import os
import sys

_TEXT, _ESC, _CSI, _STR, _STR_ESC, _ESC_INTER = range(6)
_KEEP = frozenset("\n\t")
# C1 controls that open a sequence: CSI, and the string commands OSC, DCS, SOS, PM, APC
_C1_CSI = "\x9b"
_C1_STR = frozenset("\x9d\x90\x98\x9e\x9f")
_C1_ST = "\x9c"


def _is_control(ch: str) -> bool:
    o = ord(ch)
    return o < 0x20 or o == 0x7F or 0x80 <= o <= 0x9F


class TerminalSanitizer:
    """Feed text pieces in order; each call returns the printable part. Removed: CSI sequences
    (ESC [ ... final, and the C1 form), OSC / DCS / SOS / PM / APC strings (up to BEL or ST; a
    newline ends an unterminated one so a stray ESC ] cannot swallow the rest of the output), other
    ESC sequences, and every C0/C1 control character except newline and tab (so also CR, BS, BEL)."""

    def __init__(self) -> None:
        self._state = _TEXT

    def feed(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            self._step(ch, out)
        return "".join(out)

    def _step(self, ch: str, out: list[str]) -> None:
        o = ord(ch)
        st = self._state
        if st == _ESC:
            if ch == "[":
                self._state = _CSI
            elif ch in "]PX^_":
                self._state = _STR
            elif 0x20 <= o <= 0x2F:
                self._state = _ESC_INTER
            elif 0x30 <= o <= 0x7E:
                self._state = _TEXT  # a two-character sequence (ESC 7, ESC c, ...): dropped
            elif ch == "\x1b":
                pass
            else:  # not a sequence after all: drop the ESC, keep the character
                self._state = _TEXT
                self._step(ch, out)
            return
        if st == _CSI:
            if 0x20 <= o <= 0x3F:
                return  # parameter and intermediate bytes
            self._state = _TEXT
            if 0x40 <= o <= 0x7E:
                return  # the final byte
            self._step(ch, out)  # malformed: the sequence ends here, the character is text
            return
        if st == _ESC_INTER:
            if 0x20 <= o <= 0x2F:
                return
            self._state = _TEXT
            if 0x30 <= o <= 0x7E:
                return
            self._step(ch, out)
            return
        if st == _STR_ESC:
            if ch == "\\":
                self._state = _TEXT  # ST
                return
            self._state = _ESC  # ESC inside a string ends it and starts a new sequence
            self._step(ch, out)
            return
        if st == _STR:
            if ch in ("\x07", _C1_ST):
                self._state = _TEXT
            elif ch == "\x1b":
                self._state = _STR_ESC
            elif ch == "\n":
                self._state = _TEXT
                out.append(ch)
            return
        # _TEXT
        if ch == "\x1b":
            self._state = _ESC
        elif ch == _C1_CSI:
            self._state = _CSI
        elif ch in _C1_STR:
            self._state = _STR
        elif ch in _KEEP or not _is_control(ch):
            out.append(ch)


def sanitize_terminal_text(text: str) -> str:
    """`text` without terminal control and escape sequences (a whole text at once)."""
    return TerminalSanitizer().feed(text)


def is_tty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError, OSError):
        return False


def silence_stdout() -> None:
    """After EPIPE on stdout: send the rest of stdout to devnull (the Python docs' recipe), so
    the buffered remainder and the flush at exit do not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    if fd is not None:
        os.dup2(devnull, fd)
        os.close(devnull)
    else:  # a stream without a file descriptor (tests): replace the object instead
        sys.stdout = open(devnull, "w", encoding="utf-8", closefd=True)  # noqa: SIM115


def one_line(message: str) -> str:
    """`message` as one printable line: newlines, escape and other control characters are
    shown escaped (a user's value echoed in an error cannot break the line or drive the terminal)."""
    out = []
    for ch in str(message).strip():
        if ch in ("\t", " ") or not _is_control(ch):
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])
    return "".join(out)
