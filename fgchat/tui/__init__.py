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

    mode None picks "full" when a CUDA device will be used, else "eager". Errors the user can fix
    before start-up (unwritable --log-csv, data directory) raise FgchatError (one line); a model
    that fails to load is shown inside the UI instead.
    """
    from fgchat.engine.core import EngineConfig
    from fgchat.engine.events import SamplingParams
    from fgchat.metrics import CsvAppender
    from fgchat.tui.app import FgchatApp

    if mode is None:
        mode = _default_mode(device)
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


def _default_mode(device: str | None) -> str:
    if device is not None and not str(device).startswith(("cuda", "auto")):
        return "eager"
    import torch

    return "full" if torch.cuda.is_available() else "eager"


__all__ = ["run_tui"]
