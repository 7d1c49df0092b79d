"""H200 microbenchmark: our skinny projection kernel vs cuBLAS (F.linear) on the same weights.

Each variant runs 50 times inside one CUDA graph (launch overhead excluded); prints us per call
and effective weight bandwidth. Usage: python tools/bench_proj.py [--sweep] [--pdl]
--pdl adds our kernel launched with programmatic dependent launch (each call may start loading
its weights while the previous call drains), the way the decode step launches it, and for the
projections that feed a norm (o, down) the split-K variants (partial sums) with PDL.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from fgchat.engine.kernels.gemv import ProjConfig, pick_split, project, project_partials, wins_over_cublas

REPS = 50
# name -> (N, K, kind); every variant is the plain product x @ w^T at that shape (gate_up: both halves)
SHAPES = {
    "1b": [("qkv", 3072, 2048, "norm"), ("o", 2048, 2048, "plain"), ("gate_up", 16384, 2048, "gated"),
           ("down", 2048, 8192, "plain"), ("head", 128256, 2048, "head")],
    "135m": [("qkv", 960, 576, "norm"), ("o", 576, 576, "plain"), ("gate_up", 3072, 576, "gated"),
             ("down", 576, 1536, "plain"), ("head", 49152, 576, "head")],
    "8b": [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "plain"), ("gate_up", 28672, 4096, "gated"),
           ("down", 4096, 14336, "plain"), ("head", 128256, 4096, "head")],
}


# (BLOCK_N, BLOCK_K, warps, stages): narrow and wide column tiles, for small and large matrices
SWEEP = [(16, 512, 4, 4), (16, 256, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (64, 128, 4, 4),
         (64, 256, 4, 3), (64, 256, 8, 4), (128, 128, 8, 4), (128, 64, 4, 4), (32, 256, 8, 4)]


def graph_time_us(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / REPS)
    return best


def variants(m: int, n: int, k: int):
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()  # gate_up: both halves, N = 2 * I

    def ours(cfg: ProjConfig | None = None, pdl: bool = False, split: int = 1):
        if split > 1:
            return lambda: project_partials(x, w, split, cfg, pdl=pdl)
        return lambda: project(x, w, cfg, pdl=pdl)

    return w.numel() * 2, lambda: F.linear(x, w), ours


def main() -> None:
    sweep = "--sweep" in sys.argv
    pdl = "--pdl" in sys.argv
    print(f"{'model':5} {'proj':8} {'M':>2} {'cublas us':>10} {'ours us':>8} {'ours GB/s':>9} {'ratio':>6} "
          f"{'pdl us':>7}  best sweep")
    for model, shapes in SHAPES.items():
        for (name, n, k, kind), m in itertools.product(shapes, (1, 8)):
            nbytes, cublas, ours = variants(m, n, k)
            t_ref = graph_time_us(cublas)
            t_ours = graph_time_us(ours())
            t_pdl = graph_time_us(ours(pdl=True)) if pdl else float("nan")
            best = ""
            if pdl and name in ("o", "down"):
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                picked = pick_split(n, k, sms)
                cells = []
                for split in sorted({2, 3, 4, picked}):
                    try:
                        cells.append(f"split{split}{'*' if split == picked else ''} "
                                     f"{graph_time_us(ours(pdl=True, split=split)):.1f}")
                    except ValueError:
                        pass
                best = " ".join(cells)
            if sweep and m == 1 and model == "1b" and name != "o":
                res = []
                for bn, bk, nw, st in SWEEP:
                    cfg = ProjConfig(bn, bk, nw, st)
                    try:
                        res.append((graph_time_us(ours(cfg, pdl)), cfg))
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                        print(f"  skip {cfg}: {type(exc).__name__}", file=sys.stderr)
                if res:
                    t, c = min(res, key=lambda r: r[0])
                    best = f"{t:.1f} us bn={c.block_n} bk={c.block_k} w={c.num_warps} s={c.num_stages}"
            print(f"{model:5} {name:8} {m:2d} {t_ref:10.1f} {t_ours:8.1f} {nbytes / t_ours / 1e3:9.0f} "
                  f"{t_ref / t_ours:6.2f} {t_pdl:7.1f}  {best}  used={wins_over_cublas(torch.empty(n, k, device='meta'))}",
                  flush=True)


if __name__ == "__main__":
    main()
