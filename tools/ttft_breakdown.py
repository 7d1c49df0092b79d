"""Where a full-mode TTFT goes (CUDA): the engine's TTFT of one prompt against its prefill graph's
replay alone, and from a profiler trace of one admission, the kernels' own time against their
span (the gaps between kernels inside the graph) and the host time before the first kernel and
after the last one.

Rows printed (medians over --rounds, ms):
  engine ttft   submit -> Engine.step() returning the first token (the bench stamps the token
                when it is emitted, before that step launches the first decode step: ~0.1 ms earlier)
  graph wall    prefill_logits(FULL, greedy) + synchronize, ids already on the device
  graph gpu     CUDA events around the replay alone
then, from one traced admission: kernels (count, sum of durations), the span from the first
kernel's start to the last one's end, the gaps inside it, and the time the host spends before
the first kernel and after the last (the first token's pick and read included); then the largest
kernels, the widest gaps between kernels (which two) and the slowest CUDA runtime calls.

Usage: python tools/ttft_breakdown.py [--preset llama-3.2-1b | --model PATH] [--tokens 512]
       [--rounds 20] [--k 1 (prompts admitted together; engine ttft = the last first token)]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def _first_token_ms(eng, prompts: list[list[int]]) -> float:  # noqa: ANN001
    """Submit -> the last of the prompts' first tokens (they are admitted together)."""
    from fgchat.protocol.events import SamplingParams, TokenEvent

    t0 = time.perf_counter()
    for ids in prompts:
        eng.submit(ids, SamplingParams(max_tokens=2, ignore_eos=True))
    firsts = 0
    last = 0.0
    while eng.has_work():
        for ev in eng.step():
            if isinstance(ev, TokenEvent) and ev.is_first_token:
                firsts += 1
                last = (time.perf_counter() - t0) * 1e3
    assert firsts == len(prompts)
    return last


def _trace_admission(eng, prompts: list[list[int]]) -> dict[str, float]:  # noqa: ANN001
    """One admission under torch's profiler: kernel count, sum and span, host time around them."""
    from torch.profiler import ProfilerActivity, profile

    from fgchat.protocol.events import SamplingParams, TokenEvent

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("admission"):
            for ids in prompts:
                eng.submit(ids, SamplingParams(max_tokens=1, ignore_eos=True))
            firsts = 0
            while firsts < len(prompts):
                firsts += sum(isinstance(ev, TokenEvent) and ev.is_first_token for ev in eng.step())
    while eng.has_work():
        eng.step()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = json.load(f)["traceEvents"]
    kernels = sorted((e for e in evs if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    outer = next(e for e in evs if e.get("name") == "admission" and e.get("ph") == "X")
    start, end = kernels[0]["ts"], max(k["ts"] + k["dur"] for k in kernels)
    busy = sum(k["dur"] for k in kernels)
    return {
        "kernels": len(kernels), "kernel_sum_ms": busy / 1e3, "span_ms": (end - start) / 1e3,
        "gaps_ms": (end - start - busy) / 1e3, "host_before_ms": (start - outer["ts"]) / 1e3,
        "host_after_ms": (outer["ts"] + outer["dur"] - end) / 1e3, "admission_ms": outer["dur"] / 1e3,
        "largest": sorted(((k["dur"], k["name"][:60]) for k in kernels), reverse=True)[:6],
        "widest_gaps": sorted(((b["ts"] - a["ts"] - a["dur"], f"{a['name'][:40]} -> {b['name'][:40]}")
                               for a, b in zip(kernels, kernels[1:])), reverse=True)[:8],
        "slowest_runtime_calls": sorted(((e["dur"], e["name"][:60]) for e in evs if e.get("cat") == "cuda_runtime"
                                         and e["ts"] >= outer["ts"]), reverse=True)[:8],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--k", type=int, default=1, help="distinct prompts admitted together")
    a = ap.parse_args()

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.heap import freeze_heap
    from fgchat.protocol.events import Mode

    eng = Engine(EngineConfig(model=a.model, preset=None if a.model else a.preset, device="cuda",
                              mode=Mode.FULL, max_context=max(1024, a.tokens + 64)))
    freeze_heap(collect=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, eng.cfg.vocab_size - 100, (a.tokens,), generator=g).tolist() for _ in range(a.k)]
    dev_ids = torch.tensor(prompts[0], device="cuda")
    for _ in range(3):
        _first_token_ms(eng, prompts)
    ttft, wall, gpu = [], [], []
    for _ in range(a.rounds):
        ttft.append(_first_token_ms(eng, prompts))
        if a.k > 1:
            continue
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            t0 = time.perf_counter()
            e0.record()
            eng.modes.prefill_logits(Mode.FULL, dev_ids, 0, greedy=True)
            e1.record()
            torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        gpu.append(e0.elapsed_time(e1))
    name = a.model or a.preset
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; {name}, full mode, {a.tokens}-token prompt, "
          f"x {a.k}, {a.rounds} rounds")
    for label, xs in (("engine ttft", ttft), ("graph wall", wall), ("graph gpu", gpu)) if a.k == 1 else (("engine ttft", ttft),):
        print(f"  {label:<12} median {statistics.median(xs):7.3f} ms  min {min(xs):7.3f}")
    tr = _trace_admission(eng, prompts)
    print("one traced admission (profiler on: host times inflate):")
    lists = ("largest", "widest_gaps", "slowest_runtime_calls")
    for k, v in tr.items():
        if k not in lists:
            print(f"  {k:<15} {v:8.3f}" if isinstance(v, float) else f"  {k:<15} {v}")
    for k in lists:
        print(f"  {k.replace('_', ' ')}:")
        for dur, what in tr[k]:
            print(f"    {dur / 1e3:7.3f} ms  {what}")


if __name__ == "__main__":
    main()
