"""`fgchat --endpoint URL`: the chat console over a remote server instead of a local engine.

The TUI takes an engine factory (FgchatApp's `engine_factory`); `run_tui` is used with it when it
accepts one. Until it does, the factory is put where FgchatApp's default factory looks up
EngineProcess, for the duration of the run only.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from fgchat.protocol.errors import FgchatError

# main-command options that configure a local engine: meaningless with --endpoint
_ENGINE_ONLY = (("attention", "auto", "--attention"), ("max_context", None, "--max-context"),
                ("device", None, "--device"), ("dtype", None, "--dtype"), ("lazy_capture", False, "--lazy-capture"))


def check_endpoint_args(args: argparse.Namespace) -> None:
    for name, default, option in _ENGINE_ONLY:
        if getattr(args, name, default) != default:
            raise FgchatError(f"{option} configures a local engine; it does not apply with --endpoint")


@contextlib.contextmanager
def _default_engine(factory: Any) -> Iterator[None]:
    import fgchat.tui.app as app_module

    saved = app_module.EngineProcess
    app_module.EngineProcess = factory
    try:
        yield
    finally:
        app_module.EngineProcess = saved


def run_endpoint_tui(args: argparse.Namespace) -> int:
    """Run the console against args.endpoint; returns the exit status."""
    from fgchat.client.handle import endpoint_factory
    from fgchat.tui import run_tui

    check_endpoint_args(args)
    factory = endpoint_factory(args.endpoint, model=args.model, api_key=args.api_key)
    kw: dict[str, Any] = dict(model=args.model, mode=args.mode, log_csv=args.log_csv)
    if "engine_factory" in inspect.signature(run_tui).parameters:
        return run_tui(engine_factory=factory, **kw)
    with _default_engine(factory):
        return run_tui(**kw)
