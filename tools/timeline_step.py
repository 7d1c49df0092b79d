"""Kernel timeline of decode steps on the GPU: per kernel of the step, its mean duration and the
gap since the previous kernel ended (negative: it overlapped, as PDL allows), grouped by kernel.

Usage: python tools/timeline_step.py [preset] [modes] [batch]   e.g. llama-3.2-1b full,piecewise 1
Profiling (CUPTI) adds its own delays; compare modes within one run, never with benchmark figures.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import SamplingParams

STEP_MARK = "_step_inputs_kernel"


def kernels(prof) -> list[tuple[str, float, float]]:
    evs = [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
           and "memset" not in e.name.lower()]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.start, e.time_range.end) for e in evs]


def steps(ks: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    out: list[list[tuple[str, float, float]]] = []
    for k in ks:
        if STEP_MARK in k[0] or not out:
            out.append([])
        out[-1].append(k)
    return out[1:-1]  # whole steps only


def short(name: str) -> str:
    for key in ("_proj_kernel", "_split_kernel", "_combine_kernel", "_add_rms_norm", "_prefetch", "argmax",
                STEP_MARK, "gemv", "gemm", "splitKreduce"):
        if key in name:
            return key
    return name[:40]


def report(eng: Engine, mode: str, batch: int) -> None:
    eng.set_mode(mode)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(10, eng.cfg.vocab_size, (512,), generator=g).tolist()
        eng.submit(ids, SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(15):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(12):
            eng.step()
        torch.cuda.synchronize()
    while eng.has_work():
        eng.step()
    sts = steps(kernels(prof))
    if not sts:
        print(f"{mode}: no kernels recorded")
        return
    spans = [s[-1][2] - s[0][1] for s in sts]
    starts = [s[0][1] for s in sts]
    period = (starts[-1] - starts[0]) / max(1, len(starts) - 1)
    mid = sts[len(sts) // 2]
    heads = [i for i, k in enumerate(mid) if "argmax" in k[0]]
    tail = mid[heads[-1] + 1:] if heads else []
    print(f"\n{mode} batch {batch}: step start to step start {period:.1f} us; kernels after the LM head: "
          + ", ".join(f"{short(n)} {t1 - t0:.1f}" for n, t0, t1 in tail))
    dur: dict[str, list[float]] = defaultdict(list)
    gap: dict[str, list[float]] = defaultdict(list)
    for s in sts:
        prev_end = s[0][1]
        for name, t0, t1 in s:
            dur[short(name)].append(t1 - t0)
            gap[short(name)].append(t0 - prev_end)
            prev_end = max(prev_end, t1) if "_prefetch" not in name else prev_end
    n = len(sts)
    print(f"\n{eng.cfg.name if hasattr(eng.cfg, 'name') else ''} {mode} batch {batch}: {n} steps, "
          f"span {sum(spans) / n:.1f} us, kernels per step {sum(len(s) for s in sts) / n:.0f}")
    print(f"  {'kernel':28} {'per step':>8} {'mean us':>8} {'sum us':>8} {'gap us':>8} {'gap sum':>8}")
    for k in sorted(dur, key=lambda k: -sum(dur[k])):
        c = len(dur[k]) / n
        print(f"  {k:28} {c:8.1f} {sum(dur[k]) / len(dur[k]):8.2f} {sum(dur[k]) / n:8.1f} "
              f"{sum(gap[k]) / len(gap[k]):8.2f} {sum(gap[k]) / n:8.1f}")
    mid = sts[len(sts) // 2]
    print("  one layer of the middle step (name, start us, duration, gap):")
    marks = [i for i, k in enumerate(mid) if "_add_rms_norm" in k[0]]
    lo, hi = (marks[4], marks[6]) if len(marks) > 6 else (0, min(len(mid), 12))
    prev = mid[lo - 1][2] if lo > 0 else mid[lo][1]
    for name, t0, t1 in mid[lo:hi]:
        print(f"    {short(name):26} {t0 - mid[0][1]:8.1f} {t1 - t0:7.2f} {t0 - prev:7.2f}")
        prev = max(prev, t1)


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    modes = (sys.argv[2] if len(sys.argv) > 2 else "full,piecewise").split(",")
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    eng = Engine(EngineConfig(preset=preset, mode="full", max_context=4096))
    for mode in modes:
        report(eng, mode, batch)


if __name__ == "__main__":
    main()
