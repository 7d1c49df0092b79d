"""`fgchat --endpoint URL`: the chat console over a remote server instead of a local engine.

The TUI takes the endpoint client as its engine factory (`run_tui(engine_factory=...)`).
"""

from __future__ import annotations

import argparse

from fgchat.protocol.errors import FgchatError

# main-command options that configure a local engine: meaningless with --endpoint
_ENGINE_ONLY = (("attention", "auto", "--attention"), ("max_context", None, "--max-context"),
                ("device", None, "--device"), ("dtype", "auto", "--dtype"), ("lazy_capture", False, "--lazy-capture"),
                ("quantize", "none", "--quantize"), ("dequantize", False, "--dequantize"))


def check_endpoint_args(args: argparse.Namespace) -> None:
    for name, default, option in _ENGINE_ONLY:
        if getattr(args, name, default) != default:
            raise FgchatError(f"{option} configures a local engine; it does not apply with --endpoint")


def run_endpoint_tui(args: argparse.Namespace) -> int:
    """Run the console against args.endpoint; returns the exit status."""
    from fgchat.client.handle import endpoint_factory
    from fgchat.tui import run_tui

    check_endpoint_args(args)
    factory = endpoint_factory(args.endpoint, model=args.model, api_key=args.api_key)
    return run_tui(engine_factory=factory, model=args.model, mode=args.mode, log_csv=args.log_csv)
