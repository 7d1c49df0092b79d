"""Progress bar on stderr for long benchmark work (rich), or nothing."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    if not enabled or total == 0:
        yield lambda label: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=sys.stderr)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as prog:
        task = prog.add_task("bench", total=total)
        started = [False]

        def advance(label: str) -> None:
            if started[0]:
                prog.advance(task)
            started[0] = True
            prog.update(task, description=label)

        yield advance
        prog.advance(task)
