"""Server-sent events: lines in, `data` payloads out (the only field OpenAI streams use)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """Each event's data (its `data:` lines joined by newlines); comments and other fields are
    skipped; an event still open when the lines end is yielded too."""
    data: list[str] = []
    for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)
