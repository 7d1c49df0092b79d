"""The engine child's end of the event pipe: room to write, backlog, and what writing cost.

The UI reads the pipe on a poll thread that shares the GIL with a busy UI thread, so it can fall
behind the engine for tens of milliseconds. A write into a full pipe would then stall the engine's
step loop, and the lag would show up as inter-token latency that the engine did not cause.

Invariants:
- `grow` asks the kernel for PIPE_BYTES of buffer (Linux; capped by /proc/sys/fs/pipe-max-size);
  elsewhere, or when refused, the pipe keeps its size and nothing fails.
- `unread` is the bytes written and not yet read (FIONREAD works on either end of a Linux pipe);
  where it cannot be read it is 0, so the caller sends as it would without a gate.
- With $FGCHAT_EVENT_GATE=0 the pipe is neither grown nor gated (the comparison run's baseline).
- `SendMeter` times every write; with $FGCHAT_SEND_TRACE set, `report` appends one line of totals
  to that file. Unset, nothing is written.
"""

from __future__ import annotations

import array
import os
import time
from collections.abc import Callable

PIPE_BYTES = 1 << 20  # the buffer asked for: ~40 batches of 8 replies at the 8 ms send interval
BACKLOG_BYTES = 64 << 10  # more unread than this: keep gathering token events instead of sending
GATE_ENV = "FGCHAT_EVENT_GATE"
SEND_TRACE_ENV = "FGCHAT_SEND_TRACE"


def gate_enabled() -> bool:
    return os.environ.get(GATE_ENV, "1").strip() != "0"


def grow(fd: int, size: int = PIPE_BYTES) -> int:
    """Ask for `size` bytes of pipe buffer on `fd`; the size the pipe has afterwards (0: unknown)."""
    try:
        import fcntl

        try:
            return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
        except OSError:  # above pipe-max-size: keep what it has
            return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    except (ImportError, AttributeError, OSError):
        return 0


def unread(fd: int) -> int:
    """Bytes in the pipe that the reader has not taken yet (0 where that cannot be asked)."""
    try:
        import fcntl
        import termios

        buf = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
        return int(buf[0])
    except (ImportError, AttributeError, OSError):
        return 0


def backlog_check(fd: int) -> Callable[[], bool] | None:
    """A callable that says whether the reader lags by more than BACKLOG_BYTES; None when the
    gate is off."""
    if not gate_enabled():
        return None
    grow(fd)
    return lambda: unread(fd) > BACKLOG_BYTES


class SendMeter:
    """Wall time spent in each write of the event pipe, and how often the gate held events back."""

    def __init__(self) -> None:
        self.sends = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.over_1ms = 0
        self.held = 0

    def timed(self, send: Callable[[list], None]) -> Callable[[list], None]:
        def wrapper(batch: list) -> None:
            t0 = time.perf_counter()
            send(batch)
            dt = time.perf_counter() - t0
            self.sends += 1
            self.total_s += dt
            self.max_s = max(self.max_s, dt)
            self.over_1ms += dt > 1e-3
        return wrapper

    def line(self) -> str:
        return (f"sends={self.sends} total_ms={1e3 * self.total_s:.1f} max_ms={1e3 * self.max_s:.2f} "
                f"over_1ms={self.over_1ms} held={self.held} gate={int(gate_enabled())}")

    def report(self) -> None:
        path = os.environ.get(SEND_TRACE_ENV)
        if not path:
            return
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(self.line() + "\n")
        except OSError:
            pass
