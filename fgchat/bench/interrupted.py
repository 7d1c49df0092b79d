"""A benchmark stopped with Ctrl-C keeps what it measured (torch-free: the endpoint bench uses it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def keeping_finished_runs(result: dict[str, Any]) -> Iterator[None]:
    """Ctrl-C inside: result["runs"] keeps every measurement that finished and meta.interrupted
    says so, for the caller to report and save; with none finished, the interrupt goes on."""
    try:
        yield
    except KeyboardInterrupt:
        if not result["runs"]:
            raise
        result["meta"]["interrupted"] = True
