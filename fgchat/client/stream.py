"""One streamed completion request of EndpointClient: its choices' state and the events it makes.

Invariants:
- Every choice ends exactly once: RequestFinished (stop, length, cancelled, or error after
  EngineError), or only EngineError when the request failed before any token.
- A choice of a request with n > 1 ends at its own finish_reason: its RequestFinished and stats
  are final then, whatever its siblings do. A lone choice ends with the stream, so that the
  request's usage (which counts the request as a whole) can correct its token counts.
- A choice the server finished keeps its finish reason: a later cancel, or a stream cut after
  it, does not turn it into "cancelled" or "error".
- Timing is the client's: t_ns / itl_ms are taken when a chunk arrives here; gpu_step_ms,
  launch_ms, mode, graph and batch size come from fgchat's `fgchat` chunk field when the server
  sends it, else they are None / the handle's stand-ins (mode REMOTE_MODE for a server that does
  not report how it runs).
- A chunk is one token when it carries fgchat's field, else when it carries text (a server that
  packs several tokens in a chunk is counted per chunk; its usage corrects the total at the end).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fgchat.protocol.events import EngineError, Mode, RequestFinished, RequestSummary, TokenEvent

FINISH = {"stop": "stop", "length": "length"}  # other reasons (tool_calls, content_filter): "stop"


@dataclass
class ChoiceState:
    rid: int
    parts: list[str] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    mode_counts: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    prompt_tokens: int = 0
    t_first: int | None = None
    t_last: int | None = None
    finish: str | None = None  # the server's finish reason, mapped
    ended: bool = False  # its final event was emitted (or it was handed to another request)
    seen: bool = False  # a chunk of the stream named this choice's index


class RemoteRequest:
    """The K choices of one streamed request (K = its `n`); thread-safe through `lock`."""

    def __init__(self, rids: list[int], mode: Mode | str) -> None:
        self.choices = [ChoiceState(r) for r in rids]
        self.by_rid = {c.rid: c for c in self.choices}
        self.mode = mode
        self.lock = threading.Lock()
        self.t_submit = time.monotonic_ns()
        self.usage: dict[str, Any] | None = None

    @property
    def all_ended(self) -> bool:
        return all(c.ended for c in self.choices)

    def live(self) -> int:
        return sum(1 for c in self.choices if not c.ended and c.finish is None)

    def token(self, index: int, text: str, ext: dict[str, Any] | None, batch_guess: int) -> list:
        """A streamed choice delta; returns the TokenEvent it makes (or [])."""
        if not 0 <= index < len(self.choices):
            return []
        c = self.choices[index]
        if c.ended or c.finish is not None:
            return []
        c.parts.append(text)
        if ext is None and not text:
            return []
        now = time.monotonic_ns()
        itl = None if c.t_first is None else (now - (c.t_last or now)) / 1e6
        if c.t_first is None:
            c.t_first = now
        elif itl is not None:
            c.itl_ms.append(itl)
        c.t_last = now
        ext = ext or {}
        mode = _mode(ext.get("mode"), self.mode)
        c.mode_counts[str(mode)] = c.mode_counts.get(str(mode), 0) + 1
        token_id = int(ext.get("token_id", -1) if ext.get("token_id") is not None else -1)
        c.token_ids.append(token_id)
        index_in_reply = c.tokens
        c.tokens += 1
        position = ext.get("position")
        if isinstance(position, int) and isinstance(ext.get("token_index"), int):
            c.prompt_tokens = position - ext["token_index"]
        return [TokenEvent(
            request_id=c.rid, token_index=index_in_reply, token_id=token_id, text=text, mode=mode,
            batch_size=int(ext.get("batch_size") or batch_guess), t_ns=now, itl_ms=itl,
            gpu_step_ms=_num(ext.get("gpu_step_ms")), is_first_token=index_in_reply == 0,
            position=position if isinstance(position, int) else index_in_reply,
            graph=ext.get("graph") if isinstance(ext.get("graph"), str) else None,
            launch_ms=_num(ext.get("launch_ms")),
        )]

    def seen(self, index: int) -> None:
        if 0 <= index < len(self.choices):
            self.choices[index].seen = True

    def finished(self, index: int, reason: str) -> list:
        """The server finished choice `index`: its RequestFinished now when it has siblings."""
        if not 0 <= index < len(self.choices) or self.choices[index].finish is not None:
            return []
        c = self.choices[index]
        c.finish = FINISH.get(reason, "stop")
        return self.end(c.rid, c.finish) if len(self.choices) > 1 else []

    def take_unanswered(self) -> list[int]:
        """At the end of a stream that answered some choices: the rids of those it never named
        (a server that ignores `n`), now ended here without an event, for the caller to send
        again; [] when it answered every choice, or none."""
        if not any(c.seen for c in self.choices):
            return []
        out = [c.rid for c in self.choices if not c.seen and not c.ended]
        for rid in out:
            self.by_rid[rid].ended = True
        return out

    def end(self, rid: int, reason: str) -> list:
        """Choice rid's RequestFinished with `reason` (its server finish reason when it has one;
        once); [] when it already ended."""
        c = self.by_rid[rid]
        if c.ended:
            return []
        c.ended = True
        return [RequestFinished(self._summary(c, c.finish or reason))]

    def end_all(self) -> list:
        """At the end of the stream: every choice not ended yet, with its server finish reason."""
        if self.usage and len(self.choices) == 1:
            c = self.choices[0]
            c.prompt_tokens = int(self.usage.get("prompt_tokens") or c.prompt_tokens)
        out: list = []
        for c in self.choices:
            if c.finish is None and not c.ended:  # stream ended without a finish_reason
                out += self.fail(c.rid, "the stream ended before the reply finished")
            else:
                out += self.end(c.rid, c.finish or "stop")
        return out

    def fail(self, rid: int, message: str) -> list:
        """Choice rid failed: EngineError, then its partial text as a RequestFinished("error")
        when it had started; only the EngineError before any token (as the engine does)."""
        c = self.by_rid[rid]
        if c.ended or c.finish is not None:
            return self.end(rid, "error")
        if c.t_first is None:
            c.ended = True
            return [EngineError(message, rid)]
        return [EngineError(message, rid), *self.end(rid, "error")]

    def fail_all(self, message: str) -> list:
        return [ev for c in self.choices for ev in self.fail(c.rid, message)]

    def _summary(self, c: ChoiceState, reason: str) -> RequestSummary:
        end = c.t_last if c.t_last is not None else time.monotonic_ns()
        first = c.t_first if c.t_first is not None else end
        tokens = c.tokens
        if self.usage and len(self.choices) == 1 and self.usage.get("completion_tokens"):
            tokens = int(self.usage["completion_tokens"])
        return RequestSummary(
            request_id=c.rid, prompt_tokens=c.prompt_tokens, output_tokens=tokens,
            ttft_ms=(first - self.t_submit) / 1e6,
            tpot_ms=(c.t_last - c.t_first) / 1e6 / (c.tokens - 1) if c.tokens > 1 and c.t_last and c.t_first else None,
            e2e_ms=(end - self.t_submit) / 1e6, finish_reason=reason,  # type: ignore[arg-type]
            text="".join(c.parts), token_ids=list(c.token_ids), itl_ms=list(c.itl_ms),
            mode_counts=dict(c.mode_counts),
        )


def _mode(value: Any, default: Mode | str) -> Mode | str:
    try:
        return Mode(value)
    except ValueError:
        return default


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
