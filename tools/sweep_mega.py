"""The mega mode's kernel settings side by side with full mode, in one process per preset: per
batch size, ms per decode step (graph replays back to back, CUDA events) of full and of mega under
each setting (warps, pipeline stages, largest K tile). Random weights of the preset's shape; each
position 512 (the bench's prompt length).

Usage: python tools/sweep_mega.py PRESET[,PRESET] BATCHES CONFIGS   e.g.
       python tools/sweep_mega.py llama-3.2-1b,smollm2-135m 1,8 4x3x128,8x4x256
"""

from __future__ import annotations

import sys
import time

import torch
from triton.runtime.errors import OutOfResources

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.kernels.megakernel import pick_tiles
from fgchat.protocol.events import Mode
from profile_prefill import time_cuda_ms  # tools/ is on sys.path when run as a script

REPLAYS = 300


def ms_per_step(eng: Engine, mode: Mode, b: int) -> float:
    """Mean device time of one replay of `mode`'s graph of batch size b (captured on first use)."""
    return time_cuda_ms(lambda: eng.modes.run(mode, b, 0), REPLAYS)


def sweep(preset: str, batches: list[int], configs: list[tuple[int, int, int]]) -> None:
    eng = Engine(EngineConfig(preset=preset, device="cuda", dtype="bfloat16", max_context=2048, mode="full"))
    mega = eng.modes.modes[Mode.MEGA]
    layers, cfg = mega.layers, eng.cfg
    for b in batches:
        eng.bufs.stage([(31 * r + 7) % cfg.vocab_size for r in range(b)], [512] * b, list(range(b)),
                       [0.0] * b, [1.0] * b, [0] * b, [0] * b)
        row = [f"{preset:14} b{b}  full {ms_per_step(eng, Mode.FULL, b):.3f}"]
        for warps, stages, max_k in configs:
            layers.num_warps, layers.num_stages = warps, stages
            layers.tiles = pick_tiles(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size,
                                      cfg.head_dim, layers.programs, max_k)
            mega.drop()
            t0 = time.perf_counter()
            try:
                eng.modes.run(Mode.MEGA, b, 0)  # capture (and compile) outside the timing
            except OutOfResources as exc:
                row.append(f"mega {warps}x{stages}x{max_k} does not fit ({str(exc)[:60]})")
                continue
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            row.append(f"mega {warps}x{stages}x{max_k} {ms_per_step(eng, Mode.MEGA, b):.3f} (first {first:.1f} s)")
            print(" | ".join(row), flush=True)
        print(" | ".join(row), flush=True)


def main() -> None:
    presets = sys.argv[1].split(",")
    batches = [int(x) for x in sys.argv[2].split(",")]
    configs = [tuple(int(v) for v in c.split("x")) for c in sys.argv[3].split(",")]
    print(torch.cuda.get_device_name(), flush=True)
    for p in presets:
        sweep(p, batches, configs)


if __name__ == "__main__":
    main()
