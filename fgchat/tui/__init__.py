"""Terminal UI. `run_tui` is what the CLI calls."""

from __future__ import annotations

import os


def run_tui(
    *,
    model: str | None = None,
    mode: str | None = None,
    attention: str = "auto",
    max_context: int | None = None,
    log_csv: str | os.PathLike[str] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    lazy_capture: bool = False,
    max_tokens: int = 1024,
) -> int:
    """Run the chat + latency console until the user quits; returns the exit status.

    mode None lets the engine pick "full" where CUDA graphs work, else "eager". Errors the user can fix
    before start-up (an unwritable --log-csv, or one written by an older fgchat without the
    session_id column) raise FgchatError (one line); a model that fails to load and a chat store
    that cannot be opened are shown inside the UI instead.

    SIGTERM / SIGHUP end the app like ctrl+q (partial replies stored as "interrupted", --log-csv
    flushed, engine stopped); the exit status is then 128 + the signal number (143 / 129).
    """
    import signal

    from fgchat.protocol.config import EngineConfig
    from fgchat.protocol.events import SamplingParams
    from fgchat.metrics import CsvAppender, new_session_id
    from fgchat.tui.app import EXIT_SIGNALS, FgchatApp

    config = EngineConfig(
        model=model, device=device, dtype=dtype, max_context=max_context, mode=mode,
        attention=attention or "auto", lazy_capture=lazy_capture,
    )
    session_id = new_session_id()
    appender = CsvAppender(log_csv, session_id=session_id) if log_csv else None
    app = FgchatApp(config, log_csv=appender, sampling=SamplingParams(max_tokens=max_tokens),
                    session_id=session_id)
    app.exit_watchdog = True
    late: list[int] = []
    try:
        result = app.run()
    finally:
        # the app's handlers are gone with its event loop: a signal from here on is only noted,
        # so the last flush (normally a no-op: the app flushed on unmount) always completes
        previous = {}
        for sig in EXIT_SIGNALS:
            try:
                previous[sig] = signal.signal(sig, lambda signum, frame: late.append(signum))
            except (ValueError, OSError):  # not the main thread
                pass
        try:
            app.flush_on_exit()
        finally:
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)
    if app.return_code not in (None, 0):
        return int(app.return_code)
    if late:
        return 128 + late[0]
    return int(result or 0)


__all__ = ["run_tui"]
