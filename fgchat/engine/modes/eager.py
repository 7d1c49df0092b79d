"""Eager mode: every kernel of the step launched from the host.

With the fused stages on CUDA, a greedy step at batch size B replays the launch list recorded from
the first such step (engine.launch_list): the same launches with the same arguments, without the
stages' Python. A step the recorder cannot capture whole runs through the stages every time.
"""

from __future__ import annotations

from collections.abc import Callable

from fgchat.engine.launch_list import LaunchList, record
from fgchat.engine.modes.base import StepMode
from fgchat.engine.step import StepOutputs, StepProgram, Variant
from fgchat.protocol.events import Mode


class EagerMode(StepMode):
    mode = Mode.EAGER

    def __init__(self, program: StepProgram, launch_lists: bool, note: Callable[[str], None]) -> None:
        super().__init__()
        self.program = program
        self.launch_lists_on = launch_lists
        self.note = note
        self.launch_lists: dict[int, LaunchList[StepOutputs] | None] = {}  # batch size -> list

    def run(self, b: int, variant: int) -> StepOutputs:
        if variant != Variant.GREEDY or not self.launch_lists_on:
            return self.program.run_eager(b, variant)
        if b in self.launch_lists:
            lst = self.launch_lists[b]
            return lst.replay() if lst is not None else self.program.run_eager(b, False)
        out, lst, why = record(lambda: self.program.run_eager(b, False))
        self.launch_lists[b] = lst
        if lst is None:
            self.note(f"eager batch {b} runs through the stages: {why}")
        return out

    def drop(self) -> None:
        self.launch_lists.clear()
