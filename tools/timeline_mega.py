"""Where a mega step's time goes, from clock stamps the kernel writes at each phase's start
(after the barrier that opens it) and end (before the program arrives at the next one).

Per phase kind, averaged over the layers: each program's work (its items, start to end) as the
median and the max over programs, its wait at the next barrier (median), and the release skew
(last start minus first start, global timer). The slowest program's work summed over phases is
the step's critical path of work; the rest of the step is barriers and imbalance. Random weights
of the preset's shape, every row at POSITION (512: the bench's prompt length). GPU only.

Usage: python tools/timeline_mega.py PRESET BATCH [POSITION]   e.g.
       python tools/timeline_mega.py llama-3.2-1b 1
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.kernels import megakernel as mk
from fgchat.protocol.events import Mode

KINDS = ("embed", "qkv+rope", "attention", "o+add", "gate/up+silu", "down+add")


def stamps_of_one_step(preset: str, b: int, position: int) -> tuple[np.ndarray, float]:
    """int64 [phases, programs, 2 (start, end), 2 (clock, ns)] of one persistent launch, and
    that launch's time in ms without stamps (CUDA events), for comparison."""
    eng = Engine(EngineConfig(preset=preset, device="cuda", dtype="bfloat16", max_context=2048, mode="full"))
    layers = eng.modes.modes[Mode.MEGA].layers
    ids = torch.arange(7, 7 + b, device="cuda")
    pos = torch.full((b,), position, device="cuda")
    slots = torch.arange(b, device="cuda")
    for _ in range(3):
        layers.run(ids, pos, slots)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    layers.run(ids, pos, slots)
    end.record()
    end.synchronize()
    plain_ms = start.elapsed_time(end)
    n_phases = 1 + mk.PHASES_PER_LAYER * eng.cfg.num_layers
    layers.stamps = torch.zeros((n_phases, layers.programs, 2, 2), dtype=torch.int64, device="cuda")
    for _ in range(3):  # the last launch's stamps are kept
        layers.run(ids, pos, slots)
    torch.cuda.synchronize()
    return layers.stamps.cpu().numpy(), plain_ms


def report(st: np.ndarray, plain_ms: float) -> None:
    clk, ns = st[..., 0].astype(np.float64), st[..., 1].astype(np.float64)
    # ns per SM cycle, per program, over the whole launch (the global timer is coarse, the span long)
    ns_per_clk = float(np.median((ns[-1, :, 1] - ns[0, :, 0]) / (clk[-1, :, 1] - clk[0, :, 0])))
    work = (clk[:, :, 1] - clk[:, :, 0]) * ns_per_clk / 1e3  # us [phases, programs]
    wait = np.zeros_like(work)
    wait[:-1] = (clk[1:, :, 0] - clk[:-1, :, 1]) * ns_per_clk / 1e3
    skew = (ns[:, :, 0].max(axis=1) - ns[:, :, 0].min(axis=1)) / 1e3
    span_ms = (ns[-1, :, 1].max() - ns[0, :, 0].min()) / 1e6
    print(f"one launch: {plain_ms:.3f} ms without stamps, {span_ms:.3f} ms first start to last end with them; "
          f"SM clock {1 / ns_per_clk:.2f} GHz; {st.shape[0]} phases x {st.shape[1]} programs")
    print(f"{'phase':14} {'n':>3} {'work med':>9} {'work max':>9} {'wait med':>9} {'skew':>7}  (us, mean over layers)")
    kind = np.array([0] + [1 + (p - 1) % mk.PHASES_PER_LAYER for p in range(1, st.shape[0])])
    for k, name in enumerate(KINDS):
        sel = kind == k
        print(f"{name:14} {int(sel.sum()):3d} {np.median(work[sel], axis=1).mean():9.2f} "
              f"{work[sel].max(axis=1).mean():9.2f} {np.median(wait[sel], axis=1).mean():9.2f} {skew[sel].mean():7.2f}")
    crit = work.max(axis=1).sum() / 1e3
    print(f"slowest program's work summed over phases: {crit:.3f} ms; the rest of the span "
          f"({span_ms - crit:.3f} ms) is barriers and waiting for the slowest program")


def main() -> None:
    preset, b = sys.argv[1], int(sys.argv[2])
    position = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    print(torch.cuda.get_device_name(), f"{preset} batch {b} position {position}", flush=True)
    report(*stamps_of_one_step(preset, b, position))


if __name__ == "__main__":
    main()
