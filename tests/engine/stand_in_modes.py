"""A graph mode on CPU for tests (no CUDA graphs there): it runs a shape only once captured."""

from __future__ import annotations

from fgchat.engine.core import Engine
from fgchat.engine.modes.eager import EagerMode
from fgchat.protocol.events import CaptureReport, Mode


class StandInGraphMode(EagerMode):
    """A graph mode on CPU: a (batch size, variant, block) runs only once captured; `fail_blocks`
    makes a verification capture raise as a failed CUDA graph capture does."""

    def __init__(self, eng: Engine, mode: Mode, fail_blocks: bool = False) -> None:
        super().__init__(eng.program, False, eng.notes.append)
        # a graph mode's KV cache is CUDA's, zeroed at allocation; the CPU's is torch.empty, whose
        # rows no request wrote may hold NaN, and the self-check reads such rows
        eng.cache.all.zero_()
        self.mode = mode
        self.captured: set[tuple[int, int, int]] = set()
        self.log: list[tuple[str, int, int]] = []
        self.fail_blocks = fail_blocks

    def has(self, b: int, variant: int, block: int = 1) -> bool:
        return (b, int(variant), block) in self.captured

    def capture(self, b: int, variant: int, block: int = 1) -> None:
        self.log.append(("capture", b, block))
        if self.fail_blocks and block > 1:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.captured.add((b, int(variant), block))
        self.reports.append(CaptureReport(self.mode, b, 0.0, 1.0, kind="decode" if block == 1 else "verify"))

    def run(self, b: int, variant: int, block: int = 1):
        assert (b, int(variant), block) in self.captured, f"b{b} block {block} ran without its graph"
        self.log.append(("run", b, block))
        return super().run(b, variant, block)
