"""CPU: an engine that is never idle, as a loaded server's is, from an empty package cache: `clients`
requests always in flight (a new one submitted as soon as one ends), for `seconds`. Prints, per
window of `window` seconds, the median decode step (ms), the batch sizes seen and the engine's
compiled-step state, then when that state changed. The engine loads a package only while idle,
and its niced build gets little CPU beside steps that use every core: this measures what such an
engine serves meanwhile, and what a change to that policy costs or gains.

The converted model is taken from the usual cache; packages go to a fresh directory (`--cache`,
emptied of `cpu-step/` first), so each run builds them. Run it with PYTHONPATH pointing at the
tree to measure:
    python tools/busy_cpu_step.py [--clients 2] [--seconds 420] [--window 30] [--prompt 64]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=420.0)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--cache", default="/tmp/fgchat-busy-cache", help="FGCHAT_CACHE_DIR for this run")
    a = ap.parse_args()

    from fgchat.engine.model.resolve import default_cache_root

    cache = Path(a.cache)
    shutil.rmtree(cache / "cpu-step", ignore_errors=True)
    usual = default_cache_root()  # read before FGCHAT_CACHE_DIR points at `cache` below
    for entry in usual.iterdir() if usual.is_dir() else ():  # the converted model, not its packages
        if entry.name != "cpu-step" and not (cache / entry.name).exists():
            cache.mkdir(parents=True, exist_ok=True)
            (cache / entry.name).symlink_to(entry.resolve())
    os.environ["FGCHAT_CACHE_DIR"] = str(cache)

    import torch

    from fgchat.engine.core import Engine
    from fgchat.engine.process import engine_process_config
    from fgchat.protocol.config import EngineConfig
    from fgchat.protocol.events import RequestFinished, SamplingParams

    eng = Engine(engine_process_config(EngineConfig(model=a.model, device="cpu", dtype="auto",
                                                    max_context=a.prompt + a.tokens + 16)))
    print(f"engine: {eng.info().model_name}, {eng.dtype_name}, {eng.info().cpu_step}", flush=True)
    g = torch.Generator().manual_seed(0)
    in_flight = 0
    start = time.monotonic()
    window: list[float] = []
    sizes: set[int] = set()
    states: list[tuple[float, str]] = [(0.0, eng.info().cpu_step)]
    idle_steps = 0
    next_report = start + a.window
    while time.monotonic() - start < a.seconds:
        while in_flight < a.clients:
            prompt = torch.randint(3, eng.cfg.vocab_size, (a.prompt,), generator=g).tolist()
            eng.submit(prompt, SamplingParams(max_tokens=a.tokens, ignore_eos=True))
            in_flight += 1
        idle_steps += not eng.has_work()
        running = len(eng.scheduler.running)
        t = time.perf_counter()
        events = eng.step()
        dt = time.perf_counter() - t
        if running:
            window.append(dt * 1e3)
            sizes.add(running)
        in_flight -= sum(isinstance(e, RequestFinished) for e in events)
        state = eng.info().cpu_step
        if state != states[-1][1]:
            states.append((time.monotonic() - start, state))
        if time.monotonic() >= next_report:
            med = statistics.median(window) if window else float("nan")
            print(f"{next_report - start:6.0f} s  step median {med:7.2f} ms  over {len(window):4d} steps  "
                  f"batch {sorted(sizes)}  {state}", flush=True)
            window, sizes = [], set()
            next_report += a.window
    print("state changes (s since start): " + ", ".join(f"{t:.1f} {s}" for t, s in states))
    print(f"steps taken while idle: {idle_steps}")
    sys.exit(0)


if __name__ == "__main__":
    main()
