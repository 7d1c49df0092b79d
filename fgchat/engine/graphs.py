"""CUDA-graph capture and replay of the decode step: `full` (one graph per batch size) and
`piecewise` (one graph per segment between attention calls, attention launched eagerly).

Invariants:
- All graphs share one memory pool; a replay of any graph only ever follows the complete
  previous step, so pool memory reused across batch sizes is never live twice.
- Tensors a graph hands to the outside (piecewise: each segment's q and residual; both: tokens,
  logits) stay referenced here for the graph's lifetime, so the pool never reuses them.
- Nothing inside a captured region syncs with the host or branches on tensor values.
- A full graph may fork a side branch at each attention call (Decoder.side_work); the branch
  depends on everything launched before that call and joins the main stream at the step's end,
  so it runs beside attention and never outlives the replay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from fgchat.protocol.events import CaptureReport
from fgchat.engine.model.decoder import StepState
from fgchat.engine.step import StepOutputs, StepProgram, run_pieces


@dataclass
class FullGraph:
    graph: torch.cuda.CUDAGraph
    out: StepOutputs

    def replay(self) -> StepOutputs:
        self.graph.replay()
        return self.out


@dataclass
class PiecewiseGraph:
    graphs: list[torch.cuda.CUDAGraph]
    states: list[StepState]  # state after each piece: holds that piece's q (read by attention)
    attends: list[Callable[[StepState], None]]
    out: StepOutputs
    keep: list[torch.Tensor] = field(default_factory=list)

    def replay(self) -> StepOutputs:
        for j, g in enumerate(self.graphs):
            g.replay()
            if j < len(self.attends):
                self.attends[j](self.states[j])
        return self.out


Key = tuple[str, int, bool]  # (mode, batch size, sampling variant)


class GraphRunner:
    """Captures graphs lazily or eagerly and replays them; reports capture time and pool MiB."""

    def __init__(self, program: StepProgram) -> None:
        self.program = program
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Key, FullGraph | PiecewiseGraph] = {}
        self.reports: list[CaptureReport] = []
        self.stream = torch.cuda.Stream()
        self.side = torch.cuda.Stream()

    def has(self, key: Key) -> bool:
        return key in self.graphs

    def get(self, key: Key) -> FullGraph | PiecewiseGraph:
        g = self.graphs.get(key)
        if g is None:
            g = self.capture(*key)
        return g

    @torch.inference_mode()
    def warm_kernels(self, batch_sizes: range) -> float:
        """One eager step per batch size before any capture; returns its seconds.

        This is where Triton compiles the step's kernels (only on a machine whose Triton cache
        lacks them) and cuBLAS picks its kernels, so capture times measure capture alone.
        """
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.stream.wait_stream(torch.cuda.current_stream())
        for b in batch_sizes:
            self._warmup(b, False)
        return time.perf_counter() - t0

    def _warmup(self, b: int, do_sample: bool) -> None:
        """Run the step eagerly on the side stream: compiles kernels, creates cuBLAS handles."""
        work = self.program.dec.side_work()
        with torch.cuda.stream(self.stream):
            self.program.run_eager(b, do_sample)
            if work is not None:  # loads the side work's kernels before any capture
                work(0)
        self.stream.synchronize()

    @torch.inference_mode()
    def capture(self, mode: str, b: int, do_sample: bool) -> FullGraph | PiecewiseGraph:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # graph capture empties the cache too; measure only pool growth
        before = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        self.stream.wait_stream(torch.cuda.current_stream())
        self._warmup(b, do_sample)
        pieces, attends = self.program.pieces(b, do_sample)
        if mode == "full":
            g = torch.cuda.CUDAGraph()
            st = StepState()
            with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                forked = self._beside(attends)
                run_pieces(st, pieces, forked)
                if forked is not attends:
                    self.stream.wait_stream(self.side)
            result: FullGraph | PiecewiseGraph = FullGraph(g, StepOutputs(st.tokens, st.logits))
        elif mode == "piecewise":
            # only the pieces are captured; attends[j] runs eagerly between replays
            graphs, states = [], []
            st = StepState()
            for piece in pieces:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                    piece(st)
                graphs.append(g)
                snap = StepState()
                snap.__dict__.update(st.__dict__)
                states.append(snap)
            attends = self.program.bound_attends(b, states, attends)
            result = PiecewiseGraph(graphs, states, attends, StepOutputs(st.tokens, st.logits))
        else:
            raise ValueError(f"no graphs for mode {mode}")
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        pool_mib = (torch.cuda.memory_reserved() - before) / 2**20
        self.graphs[(mode, b, do_sample)] = result
        self.reports.append(CaptureReport(mode, b, seconds, pool_mib))  # type: ignore[arg-type]
        return result

    def _beside(self, attends: list[Callable[[StepState], None]]) -> list[Callable[[StepState], None]]:
        """attends with the decoder's side work forked off just before each call."""
        work = self.program.dec.side_work()
        if work is None:
            return attends

        def fork(i: int, attend: Callable[[StepState], None]) -> Callable[[StepState], None]:
            def run(st: StepState) -> None:
                self.side.wait_stream(self.stream)
                with torch.cuda.stream(self.side):
                    work(i)
                attend(st)

            return run

        return [fork(i, a) for i, a in enumerate(attends)]

    def drop_mode(self, mode: str) -> None:
        for key in [k for k in self.graphs if k[0] == mode]:
            del self.graphs[key]
