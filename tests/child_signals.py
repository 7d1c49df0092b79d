"""The signal state a CLI child of a test starts with, whatever the test runner's own is."""

from __future__ import annotations

import signal

# the signals the CLI tests send or the CLI handles on exit
EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def default_signals() -> None:
    """A `preexec_fn`: default handlers for EXIT_SIGNALS, unblocked. A background job of a
    non-interactive shell starts with SIGINT ignored, and the CLI keeps a signal that is ignored on
    entry ignored, so without this a test's signal would do nothing there."""
    for sig in EXIT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(EXIT_SIGNALS))
