"""CUDA microbenchmark: what the first SDPA call at a new shape costs, by backend.

The fused prefill pads prompts to buckets (engine.model.prefill.PREFILL_BUCKETS), so its causal
SDPA sees a few shapes, warmed at start-up. Prompts past the last bucket run at their own length,
and a prefill after cached rows (prefix reuse) attends its new rows over a K/V length that grows
every turn: each call is a shape SDPA has not seen. A backend that builds a plan per shape (cuDNN
attention builds a graph) pays that on every such call.

For each case, torch's default choice and the same call with cuDNN attention excluded
(flash, memory-efficient, math) each get a shape of their own; printed: the first call's wall time
(synchronized), the median of the next five, and the attention kernels one call launched.
Usage: python tools/bench_sdpa_shapes.py [--heads 32,8 --head-dim 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def qkv(hq: int, hkv: int, t: int, n: int, d: int):
    q = torch.randn(1, hq, t, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def call(kind: str, q, k, v):
    t, n = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if kind == "causal":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if kind == "bool mask":
        mask = torch.arange(n, device="cuda")[None, :] <= torch.arange(n - t, n, device="cuda")[:, None]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    bias = causal_lower_right(t, n)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)


def kernels(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    keep = [x for x in names if any(s in x.lower() for s in ("cudnn", "flash", "fmha", "attention", "sm90", "softmax", "gemm"))]
    return ", ".join(sorted(x[:48] for x in keep)[:3]) or ", ".join(sorted(x[:40] for x in names)[:3])


def timed(fn, backends) -> tuple[float, float, str]:
    def run():
        if backends is None:
            return fn()
        with sdpa_kernel(backends):
            return fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    later = []
    for _ in range(5):
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        later.append((time.perf_counter() - t0) * 1e3)
    return first, statistics.median(later), kernels(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="32,8", help="query heads, K/V heads (1B: 32,8; SmolLM2: 9,3)")
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    hq, hkv = (int(x) for x in a.heads.split(","))
    d = a.head_dim
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  cudnn {torch.backends.cudnn.version()}"
          f"  heads {hq}/{hkv} dim {d}")
    torch.manual_seed(0)
    warm = qkv(hq, hkv, 64, 64, d)
    for backends in (None, NO_CUDNN):
        timed(call("causal", *warm), backends)  # each backend's own first use, outside the table
    cases = [("causal", t, t) for t in (2100, 2404, 3000)] + \
            [(kind, 20, n) for kind in ("bool mask", "lower-right bias") for n in (249, 467, 905)]
    print(f"{'case':<18}{'q rows':>7}{'kv rows':>8} | {'default: first':>15}{'next':>8}  kernels"
          f" | {'no cuDNN: first':>16}{'next':>8}  kernels")
    for kind, t, n in cases:
        cells = []
        for shift, backends in ((0, None), (8, NO_CUDNN)):  # a shape of its own for each
            tt, nn = (t + shift, n + shift) if kind == "causal" else (t, n + shift)
            first, later, names = timed(call(kind, *qkv(hq, hkv, tt, nn, d)), backends)
            cells.append(f"{first:15.2f}{later:8.3f}  {names}")
        print(f"{kind:<18}{t:>7}{n:>8} | {cells[0]} | {cells[1]}")


if __name__ == "__main__":
    main()
