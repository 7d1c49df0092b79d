"""Full mode: the whole decode step of batch size B as one CUDA graph.

Invariants:
- the graph's tokens and logits stay referenced here for the graph's lifetime, so the pool never
  reuses them;
- nothing inside the captured region syncs with the host or branches on tensor values;
- the graph may fork a side branch at each attention call (Decoder.side_work, an L2 prefetch);
  the branch depends on everything launched before that call and joins the main stream at the
  step's end, so it runs beside attention and never outlives the replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fgchat.engine.model.decoder import StepState
from fgchat.engine.modes.capture import GraphMode
from fgchat.engine.step import StepOutputs, run_pieces
from fgchat.protocol.events import Mode


@dataclass
class FullGraph:
    graph: torch.cuda.CUDAGraph
    out: StepOutputs

    def replay(self) -> StepOutputs:
        self.graph.replay()
        return self.out


class FullMode(GraphMode):
    mode = Mode.FULL

    def _capture(self, b: int, variant: int, block: int = 1) -> FullGraph:
        cap = self.cap
        pieces, attends = cap.program.pieces(b, variant, block=block)
        g = torch.cuda.CUDAGraph()
        st = StepState()
        with torch.cuda.graph(g, pool=cap.pool, stream=cap.stream):
            forked = self._beside(attends, b * block)
            run_pieces(st, pieces, forked)
            if forked is not attends:
                cap.stream.wait_stream(cap.side)
        return FullGraph(g, StepOutputs(st.tokens, st.logits))

    def _beside(self, attends: list[Callable[[StepState], None]], b: int) -> list[Callable[[StepState], None]]:
        """attends with the decoder's side work for `b` rows forked off just before each call."""
        work = self.cap.program.dec.side_work(b)
        if work is None:
            return attends
        cap = self.cap

        def fork(i: int, attend: Callable[[StepState], None]) -> Callable[[StepState], None]:
            def run(st: StepState) -> None:
                cap.fork(work, i)
                attend(st)

            return run

        return [fork(i, a) for i, a in enumerate(attends)]
