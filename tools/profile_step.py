"""H200 profile: CUDA kernel time per decode step (eager launches the same kernels as the graphs)
and per 512-token prefill, grouped by kernel. Usage: python tools/profile_step.py [preset]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import SamplingParams


def table(prof, per: int, title: str, top: int = 14) -> None:
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in rows) / per
    print(f"\n{title}: {total:.1f} us of kernels per call")
    for e in rows[:top]:
        print(f"  {e.device_time_total / per:8.1f} us  {e.count / per:5.1f}x  {e.key[:90]}")


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    eng = Engine(EngineConfig(preset=preset, mode="eager", lazy_capture=True, max_context=4096))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, eng.cfg.vocab_size, (512,), generator=g).tolist()
    eng.submit(ids, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    table(prof, 10, f"{preset} eager decode step, batch 1")
    dec, cache = eng.decoder, eng.cache
    x = torch.tensor(ids, device=eng.device)
    for _ in range(3):
        dec.prefill(x, 1, cache.k, cache.v)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            dec.prefill(x, 1, cache.k, cache.v)
        torch.cuda.synchronize()
    table(prof, 5, f"{preset} prefill of 512 tokens")


if __name__ == "__main__":
    main()
