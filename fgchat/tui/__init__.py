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
    before start-up (unwritable --log-csv, data directory) raise FgchatError (one line); a model
    that fails to load is shown inside the UI instead.
    """
    from fgchat.engine.config import EngineConfig
    from fgchat.engine.events import SamplingParams
    from fgchat.metrics import CsvAppender
    from fgchat.tui.app import FgchatApp

    config = EngineConfig(
        model=model, device=device, dtype=dtype, max_context=max_context, mode=mode,
        attention=attention or "auto", lazy_capture=lazy_capture,
    )
    appender = CsvAppender(log_csv) if log_csv else None
    app = FgchatApp(config, log_csv=appender, sampling=SamplingParams(max_tokens=max_tokens))
    try:
        result = app.run()
    finally:
        app.flush_on_exit()
    if app.return_code not in (None, 0):
        return int(app.return_code)
    return int(result or 0)


__all__ = ["run_tui"]
