"""Piecewise mode: one CUDA graph per segment between attention calls; attention launched from
the host between the replays (as vLLM's piecewise graphs leave attention out).

Each attention call runs as a launch list (engine.launch_list) recorded once per batch size and
layer, right after capture, from a real step: the same launches with the same arguments as the
eager call, without its Python. A call the recorder cannot capture whole runs eagerly. Where
Decoder.piecewise_prefetch holds (every layer's weights fit the L2 budget) the piece that ends at
attention i forks the decoder's side work for layer i (the L2 prefetch full graphs run beside
attention i) at layer i's first stage and joins it before the piece ends: the prefetch kernel only
issues requests, so the join waits for the issuing, not for the fills.

Invariants:
- each piece writes its outputs (q / qkv, residual) to the same tensors on every replay; the
  states after each piece hold them, and the recorded attention reads exactly those tensors;
- tensors a graph hands to the outside stay referenced here for the graph's lifetime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fgchat.engine.launch_list import record, replay_in_order
from fgchat.engine.model.decoder import StepState
from fgchat.engine.modes.capture import GraphMode
from fgchat.engine.step import StepOutputs
from fgchat.protocol.events import Mode


@dataclass
class PiecewiseGraph:
    graphs: list[torch.cuda.CUDAGraph]
    attends: list[list[Callable[[], object]]]  # attention call j's launches, on the state after piece j
    out: StepOutputs
    _run: Callable[[], None] | None = field(default=None, init=False, repr=False)

    def replay(self) -> StepOutputs:
        """Piece 0, attention 0, piece 1, ...: one replay of them all in that order."""
        if self._run is None:
            seq: list[Callable[[], object]] = []
            for j, g in enumerate(self.graphs):
                seq.append(g.replay)
                if j < len(self.attends):
                    seq += self.attends[j]
            self._run = replay_in_order(seq)
        self._run()
        return self.out


class PiecewiseMode(GraphMode):
    mode = Mode.PIECEWISE

    def _capture(self, b: int, variant: int, block: int = 1) -> PiecewiseGraph:
        cap = self.cap
        work = cap.program.dec.side_work(b * block) if cap.program.dec.piecewise_prefetch else None
        forked: list[int] = []

        def fork(i: int) -> None:
            cap.fork(work, i)
            forked.append(i)

        pieces, attends = cap.program.pieces(b, variant, fork if work is not None else None, block)
        graphs, states = [], []
        st = StepState()
        for piece in pieces:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=cap.pool, stream=cap.stream):
                forked.clear()
                piece(st)
                if forked:  # the side branch joins inside this piece's graph
                    cap.stream.wait_stream(cap.side)
            graphs.append(g)
            snap = StepState()
            snap.__dict__.update(st.__dict__)
            states.append(snap)
        # one real step: each piece replayed, each attention recorded on the state it reads
        bound: list[list[Callable[[], object]]] = []
        with torch.cuda.stream(cap.stream):
            for j, g in enumerate(graphs[: len(attends)]):
                g.replay()
                call = _bind(attends[j], states[j])
                _, lst, _ = record(call)
                bound.append(lst.calls if lst is not None else [call])
            graphs[-1].replay()
        return PiecewiseGraph(graphs, bound, StepOutputs(st.tokens, st.logits))


def _bind(attend: Callable[[StepState], None], st: StepState) -> Callable[[], None]:
    def call() -> None:
        attend(st)

    return call
