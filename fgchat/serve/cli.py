"""Options of `fgchat serve`; checked while parsing, like every other fgchat option."""

from __future__ import annotations

import argparse
from collections.abc import Callable

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 32


def port_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535 (0: any free port), got {value}")
    return value


def add_serve_parser(sub: argparse._SubParsersAction,
                     add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """The `serve` subcommand; add_engine_args adds the engine options the main command has."""
    from fgchat.cli_args import int_at_least

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the engine (chat, completions, metrics)",
                       description="Serve the model over an OpenAI-compatible HTTP API: /v1/chat/completions, "
                       "/v1/completions, /v1/models, /health, Prometheus /metrics, and /fgchat/mode to switch "
                       "the decode mode. Streamed chunks carry fgchat's per-token timing in an 'fgchat' field.")
    add_engine_args(s)
    s.add_argument("--host", default=DEFAULT_HOST,
                   help="address to listen on; anything but loopback needs --api-key")
    s.add_argument("--port", type=port_arg, default=DEFAULT_PORT, help="TCP port (0: any free port)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $FGCHAT_API_KEY, else no key)")
    s.add_argument("--max-queue", type=int_at_least(0), default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="requests that may wait beyond the 8 the engine runs at once; past it: HTTP 429")
