"""Profile of the decode step on a CUDA GPU, random weights of a preset's shape. Three views:
`kernels` (default): CUDA kernel time per eager decode step and per 512-token prefill, grouped by
kernel (eager launches the kernels the graphs hold); `timeline`: per kernel of captured steps in
each --modes, its mean duration and the gap since the previous kernel ended (negative: it
overlapped, as programmatic dependent launch allows), and one layer of the middle step kernel by
kernel; `host`: where the Python time of an eager step goes (cProfile over 40 steps). Profilers add
their own delays: compare within one run, never with benchmark figures.

    python tools/profile_step.py --preset llama-3.2-1b
    python tools/profile_step.py --view timeline --modes full,piecewise --batch 8
    python tools/profile_step.py --view host --preset smollm2-135m
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import defaultdict

STEP_MARK = "_step_inputs_kernel"  # the first kernel of every step
Kernel = tuple[str, float, float]  # name, start us, end us


def engine(preset: str, mode: str, batch: int, prompt: int = 512, tokens: int = 400):
    """An engine of `preset` with `batch` requests of random `prompt`-token prompts admitted."""
    import torch

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.events import SamplingParams

    eng = Engine(EngineConfig(preset=preset, mode=mode, max_context=4096, lazy_capture=mode == "eager"))
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        ids = torch.randint(10, eng.cfg.vocab_size, (prompt,), generator=g).tolist()
        eng.submit(ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
    for _ in range(15):
        eng.step()
    torch.cuda.synchronize()
    return eng


def kernel_table(prof, per: int, title: str, top: int = 14) -> None:  # noqa: ANN001
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in rows) / per
    print(f"\n{title}: {total:.1f} us of kernels per call")
    for e in rows[:top]:
        print(f"  {e.device_time_total / per:8.1f} us  {e.count / per:5.1f}x  {e.key[:90]}")


def view_kernels(a: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    eng = engine(a.preset, "eager", a.batch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    kernel_table(prof, 10, f"{a.preset} eager decode step, batch {a.batch}")
    while eng.has_work():
        eng.step()
    ids = torch.randint(10, eng.cfg.vocab_size, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    dec, cache = eng.decoder, eng.cache
    x = torch.tensor(ids, device=eng.device)
    for _ in range(3):
        dec.prefill(x, 1, cache.k, cache.v)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            dec.prefill(x, 1, cache.k, cache.v)
        torch.cuda.synchronize()
    kernel_table(prof, 5, f"{a.preset} prefill of 512 tokens")


def split_steps(prof) -> list[list[Kernel]]:  # noqa: ANN001
    """The profiled kernels (copies and memsets left out) cut into whole decode steps."""
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"
           and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    evs.sort(key=lambda e: e.time_range.start)
    steps: list[list[Kernel]] = []
    for e in evs:
        if STEP_MARK in e.name or not steps:
            steps.append([])
        steps[-1].append((e.name, e.time_range.start, e.time_range.end))
    return steps[1:-1]


def short(name: str) -> str:
    for key in ("_proj_kernel", "_split_kernel", "_combine_kernel", "_add_rms_norm", "_prefetch", "argmax",
                STEP_MARK, "gemv", "gemm", "splitKreduce"):
        if key in name:
            return key
    return name[:40]


def view_timeline(a: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for mode in a.modes.split(","):
        eng = engine(a.preset, mode, a.batch)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(12):
                eng.step()
            torch.cuda.synchronize()
        steps = split_steps(prof)
        if not steps:
            print(f"{mode}: no kernels recorded")
            continue
        n = len(steps)
        period = (steps[-1][0][1] - steps[0][0][1]) / max(1, n - 1)
        span = sum(s[-1][2] - s[0][1] for s in steps) / n
        dur: dict[str, list[float]] = defaultdict(list)
        gap: dict[str, list[float]] = defaultdict(list)
        for s in steps:
            prev_end = s[0][1]
            for name, t0, t1 in s:
                dur[short(name)].append(t1 - t0)
                gap[short(name)].append(t0 - prev_end)
                if "_prefetch" not in name:  # the L2 prefetch runs beside the step's kernels
                    prev_end = max(prev_end, t1)
        print(f"\n{a.preset} {mode} batch {a.batch}: {n} steps, step start to step start {period:.1f} us, "
              f"span {span:.1f} us, kernels per step {sum(len(s) for s in steps) / n:.0f}")
        print(f"  {'kernel':28} {'per step':>8} {'mean us':>8} {'sum us':>8} {'gap us':>8} {'gap sum':>8}")
        for k in sorted(dur, key=lambda k: -sum(dur[k])):
            print(f"  {k:28} {len(dur[k]) / n:8.1f} {sum(dur[k]) / len(dur[k]):8.2f} {sum(dur[k]) / n:8.1f} "
                  f"{sum(gap[k]) / len(gap[k]):8.2f} {sum(gap[k]) / n:8.1f}")
        mid = steps[n // 2]
        marks = [i for i, k in enumerate(mid) if "_add_rms_norm" in k[0]]
        lo, hi = (marks[4], marks[6]) if len(marks) > 6 else (0, min(len(mid), 12))
        print("  one layer of the middle step (kernel, start us, duration, gap):")
        prev = mid[lo - 1][2] if lo > 0 else mid[lo][1]
        for name, t0, t1 in mid[lo:hi]:
            print(f"    {short(name):26} {t0 - mid[0][1]:8.1f} {t1 - t0:7.2f} {t0 - prev:7.2f}")
            prev = max(prev, t1)


def view_host(a: argparse.Namespace) -> None:
    import torch

    eng = engine(a.preset, "eager", a.batch)
    steps = 40
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    print(f"{a.preset} eager batch {a.batch}: {(time.perf_counter() - t0) / steps * 1e3:.2f} ms per step "
          "(no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)


VIEWS = {"kernels": view_kernels, "timeline": view_timeline, "host": view_host}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--view", choices=tuple(VIEWS), default="kernels")
    ap.add_argument("--preset", default="llama-3.2-1b", help="model shape, random weights (default %(default)s)")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together (default 1)")
    ap.add_argument("--modes", default="full,piecewise", help="timeline: the modes, comma separated")
    a = ap.parse_args()
    if a.batch < 1:
        ap.error("--batch must be >= 1")
    import torch

    if not torch.cuda.is_available():
        sys.exit("profile_step: needs a CUDA GPU")
    VIEWS[a.view](a)


if __name__ == "__main__":
    main()
