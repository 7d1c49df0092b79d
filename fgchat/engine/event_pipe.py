"""The engine child's end of the event pipe: room to write, and the backlog that gates sends.

The UI reads the pipe on a poll thread that shares the GIL with a busy UI thread, so it can fall
behind the engine for tens of milliseconds. A write into a full pipe would then stall the engine's
step loop, and the lag would show up as inter-token latency that the engine did not cause.

Invariants:
- `grow` asks the kernel for PIPE_BYTES of buffer (Linux; capped by /proc/sys/fs/pipe-max-size);
  elsewhere, or when refused, the pipe keeps its size and nothing fails.
- `unread` is the bytes written and not yet read (FIONREAD works on either end of a Linux pipe);
  where it cannot be read it is 0, so the caller sends as it would without a gate.
"""

from __future__ import annotations

import array
from collections.abc import Callable

PIPE_BYTES = 1 << 20  # the buffer asked for: ~40 batches of 8 replies at the 8 ms send interval
BACKLOG_BYTES = 64 << 10  # more unread than this: keep gathering token events instead of sending


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


def backlog_check(fd: int) -> Callable[[], bool]:
    """Grow the pipe; a callable that says whether the reader lags by more than BACKLOG_BYTES."""
    grow(fd)
    return lambda: unread(fd) > BACKLOG_BYTES
