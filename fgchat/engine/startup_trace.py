"""Start-up trace: with $FGCHAT_STARTUP_TRACE set, every process of fgchat (the UI and the engine
child) appends "label<TAB>time.monotonic()" lines to that file at each start-up phase
(tools/startup_time.py reads them); unset, nothing is written. Imports nothing from fgchat."""

from __future__ import annotations

import os
import time

STARTUP_TRACE_ENV = "FGCHAT_STARTUP_TRACE"


def startup_mark(label: str) -> None:
    """Append `label` and the monotonic time (one clock for every process of the machine) to the
    file $FGCHAT_STARTUP_TRACE names; a no-op when it is unset. Never raises."""
    path = os.environ.get(STARTUP_TRACE_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{label}\t{time.monotonic():.6f}\n")
    except OSError:
        pass
