"""What the graph modes share: one memory pool, the capture stream, a side stream, the eager
warm-up before capture, and the cost report of each capture.

Invariants:
- every decode and prefill graph is captured into `pool`; a replay of any graph only ever follows
  the complete previous step, so pool memory reused across graphs is never live twice;
- a capture is preceded by an eager run of the same step on the capture stream, so Triton has
  compiled and cuBLAS has chosen every kernel the graph will hold;
- a capture leaves the step's state as it found it: the runs it makes for warm-up and recording
  rewrite the current K/V rows with the same values, and the penalty counts they add are undone,
  so a capture on first use in the middle of a request changes none of its tokens.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from fgchat.engine.modes.base import StepMode
from fgchat.engine.step import StepOutputs, StepProgram
from fgchat.protocol.events import CaptureReport, Mode


class GraphCapture:
    def __init__(self, program: StepProgram, share: GraphCapture | None = None) -> None:
        """`share`: another program's capture whose pool and streams this one captures with (a
        draft model's graphs beside the target's: the two never replay at once, and the
        allocator reuses a pool's free blocks only for captures on the stream that freed them)."""
        self.program = program
        if share is not None:
            self.pool, self.stream, self.side = share.pool, share.stream, share.side
            return
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        self.side = torch.cuda.Stream()

    def fork(self, work: Callable[[int], None], i: int) -> None:
        """While capturing: work(i) on the side stream, after what the capture stream queued so far;
        the capture joins the side stream before it ends (`self.stream.wait_stream(self.side)`)."""
        self.side.wait_stream(self.stream)
        with torch.cuda.stream(self.side):
            work(i)

    @torch.inference_mode()
    def warm_kernels(self, batch_sizes: range) -> float:
        """One eager step per batch size before any capture; returns its seconds (where Triton
        compiles on a cold cache), so capture times measure capture alone."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.stream.wait_stream(torch.cuda.current_stream())
        for b in batch_sizes:
            self.warmup(b, False)
        return time.perf_counter() - t0

    def warmup(self, b: int, variant: int, block: int = 1) -> None:
        """The step eagerly on the capture stream: compiles kernels, creates cuBLAS handles."""
        work = self.program.dec.side_work(b * block)
        with torch.cuda.stream(self.stream):
            self.program.run_eager(b, variant, block)
            if work is not None:  # loads the side work's kernels before any capture
                work(0)
        self.stream.synchronize()

    @contextmanager
    def measured(self, mode: Mode, size: int, reports: list[CaptureReport], kind: str = "decode") -> Iterator[None]:
        """Times the capture inside and appends its report (seconds, pool growth in MiB)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # graph capture empties the cache too; measure only pool growth
        before = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        self.stream.wait_stream(torch.cuda.current_stream())
        yield
        torch.cuda.synchronize()
        reports.append(CaptureReport(mode, size, time.perf_counter() - t0,
                                     (torch.cuda.memory_reserved() - before) / 2**20, kind=kind))


class Replayable(Protocol):
    def replay(self) -> StepOutputs: ...


class GraphMode(StepMode):
    """A mode that captures graphs per (batch size, variant) on first use or ahead of time, and
    verification steps per (batch size, block, variant) on first use (their reports' kind is
    "verify")."""

    def __init__(self, cap: GraphCapture) -> None:
        super().__init__()
        self.cap = cap
        self.graphs: dict[tuple[int, bool], Replayable] = {}
        self.block_graphs: dict[tuple[int, int, int], Replayable] = {}

    def _held(self, b: int, variant: int, block: int) -> Replayable | None:
        return self.graphs.get((b, variant)) if block == 1 else self.block_graphs.get((b, block, int(variant)))

    def has(self, b: int, variant: int, block: int = 1) -> bool:
        return self._held(b, variant, block) is not None

    def run(self, b: int, variant: int, block: int = 1) -> StepOutputs:
        g = self._held(b, variant, block)
        if g is None:
            g = self._capture_measured(b, variant, block)
        return g.replay()

    def capture(self, b: int, variant: int, block: int = 1) -> None:
        self._capture_measured(b, variant, block)

    @torch.inference_mode()
    def _capture_measured(self, b: int, variant: int, block: int = 1) -> Replayable:
        counts = self.cap.program.counts
        saved = counts.clone()  # the warm-up (and piecewise's recording step) count tokens too
        with self.cap.measured(self.mode, b, self.reports, kind="decode" if block == 1 else "verify"):
            self._warm(b, variant, block)
            g = self._capture(b, variant, block)
            if block == 1:
                self.graphs[(b, variant)] = g
            else:
                self.block_graphs[(b, block, int(variant))] = g
            torch.cuda.synchronize()  # the recording runs on the capture stream
            counts.copy_(saved)
        return g

    def _warm(self, b: int, variant: int, block: int = 1) -> None:
        """What runs once eagerly before capturing (b, variant, block): the step's stages by default."""
        self.cap.warmup(b, variant, block)

    @abstractmethod
    def _capture(self, b: int, variant: int, block: int = 1) -> Replayable:
        """Capture the step of batch size b (b x block rows; the warm-up has run)."""

    def drop(self) -> None:
        self.graphs.clear()
        self.block_graphs.clear()
