"""Eager mode: every kernel of the step launched from the host.

With the fused stages on CUDA, a step at batch size B and variant V (greedy, sampled, penalized)
replays the launch list recorded from the first such step (engine.launch_list): the same launches
with the same arguments, without the stages' Python. A step the recorder cannot capture whole runs
through the stages every time.
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
        # (batch size, variant) -> its list, None where the step cannot be recorded; a
        # verification step's key is (batch size, variant, block)
        self.launch_lists: dict[tuple[int, ...], LaunchList[StepOutputs] | None] = {}

    def run(self, b: int, variant: int, block: int = 1) -> StepOutputs:
        shape = (b, variant) if block == 1 else (b, variant, block)
        if not self.launch_lists_on:
            return self.program.run_eager(*shape)
        key = (b, int(variant)) if block == 1 else (b, int(variant), block)
        if key in self.launch_lists:
            lst = self.launch_lists[key]
            return lst.replay() if lst is not None else self.program.run_eager(*shape)
        out, lst, why = record(lambda: self.program.run_eager(*shape))
        self.launch_lists[key] = lst
        if lst is None:
            shape = f"batch {b}" if block == 1 else f"verification b{b}k{block - 1}"
            self.note(f"eager {shape} ({Variant(variant).name.lower()}) runs through the stages: {why}")
        return out

    def drop(self) -> None:
        self.launch_lists.clear()
