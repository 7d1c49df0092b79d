"""Mega mode: every decoder layer of a step in one persistent kernel (kernels.megakernel), then the
fused path's final norm, LM head and pick, all in one CUDA graph per (batch size, variant).

Invariants:
- the graph's tokens and logits stay referenced here for the graph's lifetime (as in full mode);
- the kernel runs once eagerly on the capture stream before each capture (compiles, and checks
  that the persistent launch returns: a grid that cannot be resident at once would hang there,
  so the grid is one program per SM, or more only where the driver's occupancy count allows);
- its sums run in another order than the other modes' kernels: its self-check compares it and
  eager each with the float32 reference step over a sink context (ModeSet, as_close_as_eager).
"""

from __future__ import annotations

import torch

from fgchat.engine.kernels.megakernel import DecodeLayers
from fgchat.engine.model.decoder import StepState
from fgchat.engine.modes.capture import GraphCapture, GraphMode
from fgchat.engine.modes.full import FullGraph
from fgchat.engine.step import StepOutputs, run_pieces
from fgchat.protocol.events import Mode


class MegaMode(GraphMode):
    mode = Mode.MEGA

    def __init__(self, cap: GraphCapture) -> None:
        """Raises ValueError where the model is outside what the kernel handles (its reason)."""
        super().__init__(cap)
        prog = cap.program
        self.layers = DecodeLayers(prog.dec, prog.cache)

    def has(self, b: int, variant: int, block: int = 1) -> bool:
        return block == 1 and super().has(b, variant)

    def _warm(self, b: int, variant: int, block: int = 1) -> None:
        """The mega step itself, not the stages the other modes capture."""
        _one_row_each(block)
        cap = self.cap
        with torch.cuda.stream(cap.stream):
            run_pieces(StepState(), cap.program.mega_pieces(b, variant, self.layers), [])
        cap.stream.synchronize()

    def _capture(self, b: int, variant: int, block: int = 1) -> FullGraph:
        _one_row_each(block)
        cap = self.cap
        pieces = cap.program.mega_pieces(b, variant, self.layers)
        g = torch.cuda.CUDAGraph()
        st = StepState()
        with torch.cuda.graph(g, pool=cap.pool, stream=cap.stream):
            run_pieces(st, pieces, [])
        return FullGraph(g, StepOutputs(st.tokens, st.logits))


def _one_row_each(block: int) -> None:
    """The mega kernel decodes one row per sequence: a verification step (block > 1) runs in
    another mode (ModeSet.verify_mode)."""
    if block != 1:
        raise ValueError("the mega kernel runs no verification step")
