"""The choices of one completion request: engine events in, OpenAI deltas out.

Invariants:
- Each choice ends exactly once, with finish_reason "stop", "length" or "error"; after that its
  events are ignored, except that the engine's last word on it (RequestFinished, also for the
  cancel a stop string asked for, or an EngineError) sets `settled` and the engine's numbers
  (summary, prompt and cached tokens).
- The text a choice releases, concatenated, is the engine's text cut at the first stop string
  (the tail the detokenizer flushes at the end is released from RequestFinished's text).
- `timing` is fgchat's per-token extension: the engine's own numbers for the token.
- A choice's engine error ends that choice alone (finish_reason "error", `error` its message);
  `failure` is the request's error only once every choice ended that way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fgchat.protocol.events import EngineError, RequestFinished, TokenEvent
from fgchat.serve.stops import StopMatcher


@dataclass
class Delta:
    index: int
    text: str = ""
    timing: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Choice:
    stops: StopMatcher
    raw: list[str] = field(default_factory=list)  # the engine's text so far
    text: list[str] = field(default_factory=list)  # released text
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine did not prefill again (engine.prefix_reuse)
    finish_reason: str | None = None
    error: str | None = None
    summary: dict[str, Any] | None = None
    settled: bool = False  # the engine sent its last event for this choice


def timing(ev: TokenEvent) -> dict[str, Any]:
    return {"token_index": ev.token_index, "token_id": ev.token_id, "position": ev.position, "itl_ms": ev.itl_ms,
            "gpu_step_ms": ev.gpu_step_ms, "launch_ms": ev.launch_ms, "mode": str(ev.mode),
            "batch_size": ev.batch_size, "graph": ev.graph}


class Choices:
    """`on_stop(index)` is called when a stop string ends choice `index` (the caller cancels it
    and keeps routing its events until it is settled)."""

    def __init__(self, n: int, stops: list[str], on_stop: Callable[[int], None]) -> None:
        self.items = [Choice(StopMatcher(stops)) for _ in range(n)]
        self._on_stop = on_stop

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.items)

    @property
    def settled(self) -> bool:
        return all(c.settled for c in self.items)

    @property
    def failure(self) -> str | None:
        """The first choice's error when every choice ended with an engine error, else None."""
        if all(c.error is not None for c in self.items):
            return self.items[0].error
        return None

    def feed(self, index: int, ev: Any) -> list[Delta]:
        c = self.items[index]
        if isinstance(ev, (RequestFinished, EngineError)):
            c.settled = True
        if isinstance(ev, RequestFinished):
            s = ev.summary
            c.prompt_tokens = s.prompt_tokens
            c.cached_tokens = s.cached_tokens
            c.summary = {"ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms, "e2e_ms": s.e2e_ms,
                         "mode_counts": s.mode_counts}
        if c.finish_reason is not None:
            return []
        if isinstance(ev, TokenEvent):
            c.tokens += 1
            c.prompt_tokens = ev.position - ev.token_index
            c.raw.append(ev.text)
            return self._release(index, c, ev.text, timing(ev))
        if isinstance(ev, RequestFinished):
            s = ev.summary
            raw = "".join(c.raw)
            tail = s.text[len(raw):] if s.text.startswith(raw) else ""
            out = self._release(index, c, tail, None) if tail else []
            if c.finish_reason is None:
                rest = c.stops.flush()
                c.text.append(rest)
                c.finish_reason = "length" if s.finish_reason == "length" else "stop"
                out.append(Delta(index, rest, finish_reason=c.finish_reason))
            return out
        if isinstance(ev, EngineError):
            c.finish_reason, c.error = "error", ev.message
            return [Delta(index, finish_reason="error", error=ev.message)]
        return []

    def _release(self, index: int, c: Choice, delta: str, tm: dict[str, Any] | None) -> list[Delta]:
        text = c.stops.feed(delta)
        c.text.append(text)
        out = [Delta(index, text, tm)] if (text or tm is not None) else []
        if c.stops.matched:
            c.finish_reason = "stop"
            out.append(Delta(index, finish_reason="stop"))
            self._on_stop(index)
        return out

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object; `prompt_tokens_details.cached_tokens` where a prefill skipped some."""
        prompt = max((c.prompt_tokens for c in self.items), default=0)
        completion = sum(c.tokens for c in self.items)
        out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                               "total_tokens": prompt + completion}
        cached = max((c.cached_tokens for c in self.items), default=0)
        if cached:
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out
