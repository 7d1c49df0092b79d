"""The mega mode's kernel settings side by side with full mode, in one process per preset: per
batch size, ms per decode step (graph replays back to back, CUDA events) of full and of mega under
each setting (warps, pipeline stages, largest K tile, or one per phase kind). Under each
setting, each phase kind of one layer launched on its own (microseconds and
weight GB/s) and one grid barrier alone. Random weights of the preset's shape; each position 512
(the bench's prompt length).

Usage: python tools/sweep_mega.py PRESET[,PRESET] BATCHES CONFIGS [--no-phases]   e.g.
       python tools/sweep_mega.py llama-3.2-1b,smollm2-135m 1,8 4x4x256,2x4x256,4x4x256/512/1024
       python tools/sweep_mega.py llama-3.2-1b 1 4x4x256/512/512,4x4x128/512/512:64   (gate/up items of 64)
       python tools/sweep_mega.py llama-3.2-1b 1,8 4x4x256/512/512,4x4x256/512/512+rows   (V46 off / on)
       ... 4x4x256/512/512+rows+xrows,4x4x256/512/512+sleep200   (V47, the barrier's nanosleep)
       ... 4x4x256/512/512+splits4   (at most 4 attention splits per row and kv head)
       ... 4x4x256/512/512+pps2   (two programs per SM, where both fit)
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.kernels import megakernel as mk
from fgchat.protocol.events import Mode
from profile_prefill import time_cuda_ms  # tools/ is on sys.path when run as a script

REPLAYS = 300
PHASE_NAMES = ("qkv+rope", "attention", "o+add", "gate/up+silu", "down+add")


def ms_per_step(eng: Engine, mode: Mode, b: int) -> float:
    """Mean device time of one replay of `mode`'s graph of batch size b (captured on first use)."""
    return time_cuda_ms(lambda: eng.modes.run(mode, b, 0), REPLAYS)


def stage_at_512(eng: Engine, b: int) -> None:
    """Rows [0, b) of the step's inputs: distinct tokens at position 512, one slot each, greedy."""
    eng.bufs.stage([(31 * r + 7) % eng.cfg.vocab_size for r in range(b)], [512] * b, list(range(b)),
                   [0.0] * b, [1.0] * b, [0] * b, [0] * b)


def graph_us(fn, n: int = 50) -> float:
    """Device microseconds per call of fn, n calls captured in one CUDA graph (launch gaps included)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return time_cuda_ms(g.replay, 20) * 1e3 / n


def phase_table(eng: Engine, b: int) -> None:
    """Layer 1's five phases, each its own launch of the mega kernel (no barrier), after a whole step."""
    layers = eng.modes.modes[Mode.MEGA].layers
    ids = torch.arange(7, 7 + b, device="cuda")
    pos = torch.full((b,), 512, device="cuda")
    slots = torch.arange(b, device="cuda")
    layers.run(ids, pos, slots)
    lw = eng.decoder.w.layers[1]
    nbytes = (lw.wqkv.nbytes, 0, lw.wo.nbytes, lw.w_gate_up.nbytes, lw.w_down.nbytes)
    cells = []
    for k, name in enumerate(PHASE_NAMES):
        p = 1 + mk.PHASES_PER_LAYER + k
        us = graph_us(lambda: layers.run(ids, pos, slots, phases=(p, p + 1)))
        bw = f" {nbytes[k] / us / 1e3:.0f} GB/s" if nbytes[k] else ""
        cells.append(f"{name} {us:.1f} us{bw}")
    print(f"  phases b{b}: " + " | ".join(cells), flush=True)


@triton.jit
def _barriers_kernel(bar_ptr, n):
    nprog = tl.num_programs(0)
    i = tl.program_id(0) * 0
    while i < n:
        i += 1
        mk._grid_barrier(bar_ptr, i * nprog, True)
    tl.debug_barrier()
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == (n + 1) * nprog - 1:
        tl.atomic_xchg(bar_ptr, 0)


def barrier_us(programs: int, warps: int) -> float:
    """Microseconds per grid barrier of `programs` programs (1,000 barriers in one launch)."""
    bar = torch.zeros(1, dtype=torch.int32, device="cuda")
    n = 1000
    return time_cuda_ms(lambda: _barriers_kernel[(programs,)](bar, n, num_warps=warps), 10) * 1e3 / n


def configure(layers: mk.DecodeLayers, cfg, conf: str) -> None:
    """conf WARPSxSTAGESxK[:BNI][+FLAG...], K the largest K tile of every projection or KQKV/KO/KDOWN
    one per phase kind (gate/up takes qkv's: both run over the hidden size), BNI the gate/up item
    width (default 16). Flags: +rows / +norows normalise the batch's rows only / every padded row
    (megakernel.NORM_BATCH_ROWS_ONLY; neither: that constant, the engine's default), +xrows loads
    o / down's x for those rows only (OUT_BATCH_ROWS_ONLY), +sleepN sleeps N ns between polls of a
    grid barrier (BARRIER_SLEEP_NS), +splitsN caps the attention splits per (row, kv head) at N
    (DecodeLayers.max_splits, 1..16), +ppsN launches N programs per SM (PROGRAMS_PER_SM; refused
    where the driver says they cannot all be resident)."""
    conf, *flags = conf.split("+")
    known = ("rows", "norows", "xrows")
    unknown = [f for f in flags if f not in known and not re.fullmatch(r"(sleep|splits|pps)\d+", f)]
    if unknown:
        raise SystemExit(f"unknown setting flag(s) {unknown} in {conf}")
    rows = True if "rows" in flags else False if "norows" in flags else mk.NORM_BATCH_ROWS_ONLY
    layers.norm_batch_rows_only = rows
    layers.out_batch_rows_only = "xrows" in flags
    layers.barrier_sleep_ns = next((int(f[5:]) for f in flags if f.startswith("sleep")), 0)
    layers.max_splits = next((int(f[6:]) for f in flags if f.startswith("splits")), mk.MAX_SPLITS)
    if not 1 <= layers.max_splits <= mk.MAX_SPLITS:
        raise SystemExit(f"+splits takes 1..{mk.MAX_SPLITS}")
    layers.set_programs(layers.sm_count * next((int(f[3:]) for f in flags if f.startswith("pps")), 1))
    conf, _, bni = conf.partition(":")
    warps, stages, ks = conf.split("x")
    kh, kq, ki = (ks.split("/") * 3)[:3]
    layers.num_warps, layers.num_stages = int(warps), int(stages)
    t = mk.pick_tiles(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size, cfg.head_dim,
                      layers.programs, int(kh), bni=int(bni or 16))
    layers.set_tiles(dataclasses.replace(t, bkq=mk._k_tile(cfg.num_heads * cfg.head_dim, int(kq)),
                                         bki=mk._k_tile(cfg.intermediate_size, int(ki))))


def sweep(preset: str, batches: list[int], configs: list[str], phases: bool) -> None:
    eng = Engine(EngineConfig(preset=preset, device="cuda", dtype="bfloat16", max_context=2048, mode="full"))
    mega = eng.modes.modes[Mode.MEGA]
    layers, cfg = mega.layers, eng.cfg
    for b in batches:
        stage_at_512(eng, b)
        row = [f"{preset:14} b{b}  full {ms_per_step(eng, Mode.FULL, b):.3f}"]
        for name in configs:
            configure(layers, cfg, name)
            mega.drop()
            t0 = time.perf_counter()
            try:
                eng.modes.run(Mode.MEGA, b, 0)  # capture (and compile) outside the timing
            except (OutOfResources, ValueError) as exc:  # ValueError: programs that cannot be resident
                row.append(f"mega {name} does not fit ({str(exc)[:80]})")
                continue
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            row.append(f"mega {name} {ms_per_step(eng, Mode.MEGA, b):.3f} (first {first:.1f} s)")
            print(" | ".join(row), flush=True)
            if phases:
                phase_table(eng, b)
    print(f"  grid barrier, {layers.programs} programs: {barrier_us(layers.programs, 4):.2f} us", flush=True)


def main() -> None:
    presets = sys.argv[1].split(",")
    batches = [int(x) for x in sys.argv[2].split(",")]
    configs = sys.argv[3].split(",")
    print(torch.cuda.get_device_name(), flush=True)
    for p in presets:
        sweep(p, batches, configs, "--no-phases" not in sys.argv)


if __name__ == "__main__":
    main()
