"""What every decode mode offers the engine: run a step of batch size B (capturing what it needs
on first use), capture ahead of time, drop what it holds, and report what capture cost.

Invariants every mode keeps:
- a mode runs `StepProgram.pieces(B)` and the attention calls between them, in that order, over
  the step buffers, so all modes compute the same bits;
- `run` returns the step's outputs in tensors that stay valid (and are rewritten in place) until
  the next step of the same size in the same mode;
- `drop` releases everything the mode captured; the mode may capture again later;
- `block` > 1 is a verification step over B x block rows (step.StepProgram.pieces), prepared and
  held apart from the decode step of batch size B.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from fgchat.engine.step import StepOutputs
from fgchat.protocol.events import CaptureReport, Mode


class StepMode(ABC):
    mode: Mode

    def __init__(self) -> None:
        self.reports: list[CaptureReport] = []

    @abstractmethod
    def run(self, b: int, variant: int, block: int = 1) -> StepOutputs:
        """Launch one decode step over lanes [0, b * block) of the step buffers; `variant` is a
        step.Variant (what the last piece does with the logits; False / True: greedy / sampled)."""

    def capture(self, b: int, variant: int, block: int = 1) -> None:
        """Prepare batch size b ahead of its first step (nothing to do for eager)."""

    def has(self, b: int, variant: int, block: int = 1) -> bool:
        """Whether batch size b is prepared (a step of it captures nothing)."""
        return True

    def drop(self) -> None:
        """Release what the mode captured."""
