"""SIGTERM and SIGHUP end fgchat like an interrupt: in the TUI, handlers that only schedule the
app's exit on its event loop (as ctrl+q); `generate` turns them into its ctrl+c path.

Invariants: handlers are Python-level and installed from the main thread only (under a test
runner the app may run elsewhere: the process's handling then stays). CPython runs them in
signal-number order, so a hangup's SIGHUP (1) is seen before the SIGCONT (18) the kernel sends
with it, and Textual's SIGCONT handler (which would resume the dead terminal and can block) is
disarmed first.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # handled like ctrl+q; exit status 128 + signum


def _ignore_signal(signum, frame) -> None:
    pass


def install(on_exit: Callable[[int], None]) -> dict[int, object]:
    """Route EXIT_SIGNALS to `on_exit(signum)` on the running loop; returns the handlers they
    replaced (for `restore`), {} where nothing could be installed."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return {}

    def on_signal(signum: int, frame) -> None:
        if signum == signal.SIGHUP:
            try:
                signal.signal(signal.SIGCONT, _ignore_signal)
            except (ValueError, OSError):
                pass
        try:
            loop.call_soon_threadsafe(on_exit, signum)
        except RuntimeError:  # the loop is closed: the app already flushed
            pass

    return set_handlers(on_signal)


def set_handlers(handler: Callable[[int, object], None], keep_ignored: bool = False) -> dict[int, object]:
    """Route EXIT_SIGNALS to `handler`; returns the handlers they replaced (for `restore`).
    keep_ignored: a signal ignored now stays ignored (`nohup`)."""
    previous: dict[int, object] = {}
    for sig in EXIT_SIGNALS:
        try:
            if keep_ignored and signal.getsignal(sig) is signal.SIG_IGN:
                continue
            previous[int(sig)] = signal.signal(sig, handler)
        except (ValueError, OSError):
            continue
    return previous


def restore(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        try:
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        except (ValueError, OSError, TypeError):
            pass
    previous.clear()
