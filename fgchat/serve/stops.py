"""Stop strings, applied by the server to a streamed text (the engine stops on token ids only).

Invariants:
- The text released is always a prefix of the generated text, and never contains a stop string
  nor any part of the one that matched: text that could be the start of a stop string is held
  back until the next delta decides it.
- After a match nothing more is released; `flush()` at the natural end releases what was held.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched = False

    def feed(self, delta: str) -> str:
        """Add a delta; return the text that can be released now (may be "")."""
        if self.matched:
            return ""
        if not self.stops:
            return delta
        buf = self._held + delta
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.matched = True
            self._held = ""
            return buf[:cut]
        keep = 0
        for s in self.stops:  # the longest tail of buf that a stop string starts with
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if s.startswith(buf[-k:]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, at the end of a generation that did not match."""
        out, self._held = ("" if self.matched else self._held), ""
        return out
