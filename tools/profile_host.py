"""Host-side profile of eager decode steps: where the Python time of one step goes.

Eager mode is bound by the host (it launches every kernel of the step from Python); this prints
the functions with the most own time over 40 steps of batch 1, and the host ms per step.
Usage: python tools/profile_host.py [preset]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import SamplingParams


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    eng = Engine(EngineConfig(preset=preset, mode="eager", lazy_capture=True, max_context=4096))
    g = torch.Generator().manual_seed(0)
    eng.submit(torch.randint(10, eng.cfg.vocab_size, (512,), generator=g).tolist(),
               SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    steps = 40
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    print(f"{preset} eager batch 1: {(time.perf_counter() - t0) / steps * 1e3:.2f} ms per step (no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
