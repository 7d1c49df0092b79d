"""Terminal UI. `run_tui` is what the CLI calls; `build_app` is its start-up, on its own for
scripts that run the app headless (tools/startup_time.py).

Start-up order (invariant): the engine is started before Textual and the app are imported, so
the engine child's imports and model load (seconds) overlap the UI's own imports and
construction instead of following them. Nothing between the engine's start and `app.run()`
may leave the engine running if it fails: `build_app` stops it and re-raises.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fgchat.tui.app import FgchatApp

# a start time older than this is not believed (a clock or /proc oddity): the caller's "now" is used
MAX_LAUNCH_AGE_S = 600.0


def launch_time() -> float:
    """time.monotonic() at which this process started (Linux: /proc/self/stat, 10 ms steps),
    so "ready in X s" includes the interpreter's own start-up; elsewhere, now."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        after_name = stat[stat.rindex(b")") + 2:].split()
        started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age if 0.0 <= age <= MAX_LAUNCH_AGE_S else now


def _engine_log_path() -> Path:
    """Where the app's default engine writes its log (FgchatApp: <data dir>/engine.log)."""
    from fgchat.tui.store import usable_data_dir

    return usable_data_dir()[0] / "engine.log"  # a problem with it is the app's to report


def _in_data_dir(path: str | os.PathLike[str]) -> bool:
    """Whether a --log-csv path lies under the data directory (files there are 0600)."""
    from fgchat.tui.store import data_dir_path

    try:
        return Path(os.path.expanduser(os.fspath(path))).resolve().is_relative_to(data_dir_path().resolve())
    except (OSError, RuntimeError):  # a symlink loop: not known to be outside, keep it private
        return True


def build_app(
    *,
    model: str | None = None,
    mode: str | None = None,
    attention: str = "auto",
    max_context: int | None = None,
    log_csv: str | os.PathLike[str] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    lazy_capture: bool = False,
    quantize: str = "none",
    dequantize: bool = False,
    max_tokens: int = 1024,
    speculate: str = "off",
    draft: str | None = None,
    draft_len: int = 4,
    engine_factory: Callable[..., object] | None = None,
    launched_at: float | None = None,
) -> FgchatApp:
    """The app with its engine already started: an EngineProcess, or `engine_factory(config)`'s
    handle (e.g. a remote endpoint's client), started before the UI is imported.

    mode None lets the engine pick "full" where CUDA graphs work, else "eager". Errors the user
    can fix before start-up (an unwritable --log-csv, or one written by an older fgchat without
    the session_id column) raise FgchatError (one line), the engine stopped again; a model that
    fails to load and a chat store that cannot be opened are shown inside the UI instead.
    `launched_at` (time.monotonic()) is when "ready in X s" counts from; default this process's
    start."""
    from fgchat.engine.process import EngineProcess, terminal_signals_blocked
    from fgchat.engine.startup_trace import startup_mark
    from fgchat.protocol.config import EngineConfig
    from fgchat.protocol.errors import FgchatError

    if launched_at is None:
        launched_at = launch_time()
    config = EngineConfig(
        model=model, device=device, dtype=dtype, max_context=max_context, mode=mode,
        attention=attention or "auto", lazy_capture=lazy_capture, quantize=quantize, dequantize=dequantize,
        speculate=speculate, draft=draft, draft_len=draft_len,
    )
    engine = engine_factory(config) if engine_factory is not None else EngineProcess(
        config, log_path=_engine_log_path())
    try:
        with terminal_signals_blocked():
            engine.start()
    except OSError as exc:  # no process could be made (limits, memory)
        raise FgchatError(f"cannot start the engine: {exc.strerror or exc}") from None
    try:
        from fgchat.metrics import CsvAppender, new_session_id
        from fgchat.protocol.events import SamplingParams
        from fgchat.tui.app import FgchatApp

        startup_mark("ui: app imported")
        session_id = new_session_id()
        appender = CsvAppender(log_csv, session_id=session_id, private=_in_data_dir(log_csv)) if log_csv else None
        app = FgchatApp(config, engine_factory=engine_factory, engine=engine, launched_at=launched_at,
                        log_csv=appender, sampling=SamplingParams(max_tokens=max_tokens),
                        session_id=session_id)
    except BaseException:
        engine.shutdown(timeout=0.0)  # nothing to keep yet: stop it at once
        raise
    startup_mark("ui: app built")
    return app


def run_tui(*, engine_factory: Callable[..., object] | None = None, **options: Any) -> int:
    """Run the chat + latency console until the user quits; returns the exit status. `options`
    are build_app's (model, mode, attention, max_context, log_csv, device, dtype, lazy_capture,
    quantize, dequantize, max_tokens); engine_factory as there.

    SIGTERM / SIGHUP end the app like ctrl+q (partial replies stored as "interrupted", --log-csv
    flushed, engine stopped); the exit status is then 128 + the signal number (143 / 129).
    """
    import signal

    app = build_app(engine_factory=engine_factory, **options)
    from fgchat.tui.app import EXIT_SIGNALS

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
            for note in (app.unsaved_note, app.kept_log_note):
                if note:
                    _note(note)
    if app.return_code not in (None, 0):
        return int(app.return_code)
    if late:
        return 128 + late[0]
    return int(result or 0)


def _note(text: str) -> None:
    """One line on stderr after the UI has given the terminal back (a closed stderr: silent)."""
    import sys

    from fgchat.stdio import one_line

    try:
        print(f"fgchat: {one_line(text)}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


__all__ = ["build_app", "launch_time", "run_tui"]
