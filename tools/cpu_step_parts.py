"""CPU decode step taken apart: how much of a step its packed products and LM-head pick take when
timed inside the step, what is left for everything else, and what one small op costs right after
a product or a large memory sweep against on its own (the cache state it finds).

Usage: python tools/cpu_step_parts.py [--model GGUF|DIR] [--dtype bfloat16] [--steps 40]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch


def step_parts(eng, steps: int) -> None:  # noqa: ANN001
    from fgchat.protocol.events import SamplingParams, TokenEvent

    dec = eng.decoder
    packed, pick = dec._packed, dec._cpu_pick
    if packed is None or pick is None:
        raise SystemExit("this engine has no packed projections or no CPU head pick")
    acc: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            out = fn(*a, **k)
            acc[name] += time.perf_counter() - t
            calls[name] += 1
            return out
        return run

    linear, pick_fn = packed.linear, pick.pick
    packed.linear = lambda x, i, role, bias=None: timed(role, linear)(x, i, role, bias)
    pick.pick = timed("head pick", pick_fn)
    ids = list(range(100, 164))
    try:
        for n in (4, steps + 1):
            acc.clear()
            calls.clear()
            eng.submit(ids, SamplingParams(max_tokens=n, ignore_eos=True))
            t0 = time.perf_counter()
            itl = [e.itl_ms for e in eng.run_until_done() if isinstance(e, TokenEvent) and not e.is_first_token]
            wall = time.perf_counter() - t0
    finally:
        packed.linear, pick.pick = linear, pick_fn
    per = calls["head pick"]  # one pick per step (the prefill's first token included)
    print(f"step: median {statistics.median(itl):.2f} ms between tokens, {wall / per * 1e3:.2f} ms wall per step")
    for name in acc:
        print(f"  {name:10s} {acc[name] / per * 1e3:6.2f} ms a step, {acc[name] / calls[name] * 1e6:7.1f} us a call")
    inside = sum(acc.values()) / per * 1e3
    print(f"  the rest   {wall / per * 1e3 - inside:6.2f} ms a step (norms, RoPE, cache writes, attention, Python)")


def after_what(eng) -> None:  # noqa: ANN001
    """One RMSNorm (a few small ops) timed alone and right after other work."""
    from fgchat.engine.model.ops import rms_norm

    dec = eng.decoder
    lw = dec.w.layers[0]
    h = torch.randn(1, dec.cfg.hidden_size).to(dec.dtype)
    x = torch.randn(1, dec.cfg.hidden_size).to(dec.dtype)
    sweep = torch.ones(64 << 20, dtype=torch.uint8)
    layer = [0]

    def product() -> None:
        layer[0] = (layer[0] + 1) % len(dec.w.layers)
        dec._packed.linear(x, layer[0], "gate_up")

    def sum_mb() -> None:
        layer[0] = (layer[0] + 1) % 64
        sweep[layer[0] << 20:(layer[0] + 1) << 20].sum()

    def spin() -> None:
        t = time.perf_counter() + 50e-6
        while time.perf_counter() < t:
            pass

    for name, before in (("nothing", lambda: None), ("a gate/up product", product),
                         ("a sum over 1 MB elsewhere", sum_mb), ("50 us of Python", spin)):
        rounds = []
        for _ in range(5):
            total = 0.0
            for _ in range(600):
                before()
                t = time.perf_counter()
                rms_norm(h, lw.attn_norm, dec.cfg.rms_eps)
                total += time.perf_counter() - t
            rounds.append(total / 600 * 1e6)
        print(f"  RMSNorm after {name:26s} {statistics.median(rounds):6.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF or model directory (default: the embedded model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    from fgchat.engine.core import Engine, EngineConfig

    eng = Engine(EngineConfig(model=a.model, device="cpu", dtype=a.dtype))
    print(f"{torch.get_num_threads()} threads, {a.dtype}")
    step_parts(eng, a.steps)
    after_what(eng)


if __name__ == "__main__":
    main()
