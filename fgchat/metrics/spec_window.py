"""Speculative decoding's figures over the latest speculated steps of a latency log.

A step is one decode step of one request: its token records share (request_id, step_id). A step
is speculated when its records carry a method (TokenRecord.spec_method); steps of plain decoding
are not in the window.

Invariants:
- Each record is read once (`tokens_since`), so a call costs O(records added since the last) in
  Python plus O(window) in numpy, however long the log.
- The window holds the latest `limit` speculated steps in the order their first token arrived.
- acceptance_rate = accepted / proposed summed over the window's steps (each step counted once,
  with the figures of its latest record); tokens_per_step = the window's tokens / its steps.
- A step's time is the sum of its tokens' inter-token latencies (its first token waits for the
  step, the accepted drafts behind it arrive together), so the per-step times and the per-token
  ITLs of one window are the two humps of the bimodal ITL.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from fgchat.metrics.records import LatencyLog

_EMPTY = np.empty(0, dtype=np.float64)


@dataclass(frozen=True)
class SpecFigures:
    method: str  # the method of the latest step
    draft_len: int  # tokens proposed in the latest step (k; adaptive, so it may change)
    steps: int
    proposed: int
    accepted: int
    tokens: int
    acceptance_rate: float | None  # None when nothing was proposed
    tokens_per_step: float
    step_ms_mean: float | None
    step_ms: np.ndarray = field(default_factory=lambda: _EMPTY)  # per step, oldest first
    token_itl_ms: np.ndarray = field(default_factory=lambda: _EMPTY)  # per token of those steps


@dataclass
class _Step:
    method: str
    draft_len: int
    accepted: int
    itl: list[float]


class SpecWindow:
    """The latest `limit` speculated steps of `log`; `figures()` is None before any."""

    def __init__(self, log: LatencyLog, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the window must hold at least one step, got {limit}")
        self.log = log
        self.limit = limit
        self.tokens_seen = 0
        self._steps: OrderedDict[tuple[int, int], _Step] = OrderedDict()
        self._figures: SpecFigures | None = None

    def figures(self) -> SpecFigures | None:
        new = self.log.tokens_since(self.tokens_seen)
        self.tokens_seen += len(new)
        changed = False
        for t in new:
            if t.is_first_token or not t.spec_method or t.step_id < 0:
                continue
            key = (t.request_id, t.step_id)
            step = self._steps.get(key)
            if step is None:
                step = self._steps[key] = _Step(t.spec_method, t.draft_len, t.accepted_in_step, [])
                if len(self._steps) > self.limit:
                    self._steps.popitem(last=False)
            step.method, step.draft_len, step.accepted = t.spec_method, t.draft_len, t.accepted_in_step
            step.itl.append(t.itl_ms if t.itl_ms is not None else float("nan"))
            changed = True
        if changed or (self._figures is None and self._steps):
            self._figures = self._compute()
        return self._figures

    def _compute(self) -> SpecFigures | None:
        steps = list(self._steps.values())
        if not steps:
            return None
        proposed = sum(s.draft_len for s in steps)
        accepted = sum(s.accepted for s in steps)
        tokens = sum(len(s.itl) for s in steps)
        itl = np.asarray([v for s in steps for v in s.itl], dtype=np.float64)
        step_ms = np.asarray([np.nansum(s.itl) if np.isfinite(s.itl).any() else np.nan for s in steps],
                             dtype=np.float64)
        finite = step_ms[np.isfinite(step_ms)]
        last = steps[-1]
        return SpecFigures(
            method=last.method, draft_len=last.draft_len, steps=len(steps), proposed=proposed,
            accepted=accepted, tokens=tokens,
            acceptance_rate=accepted / proposed if proposed else None,
            tokens_per_step=tokens / len(steps),
            step_ms_mean=float(finite.mean()) if finite.size else None,
            step_ms=finite, token_itl_ms=itl[np.isfinite(itl)],
        )
