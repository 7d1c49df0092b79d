"""H200 microbenchmark: the decode projections with their weights loaded by Hopper's tensor
memory accelerator (TMA: one bulk copy per weight tile, described once on the host) against our
pointer-load kernel (engine.kernels.gemv) and cuBLAS, at 1 and 8 rows.

Each variant runs 50 times inside one CUDA graph (bench_proj's timing), cycling through enough
copies of the weight that they do not fit in L2 (every call reads HBM, as a decode step does);
prints us per call, weight GB/s and the largest error against a float32 product. A TMA variant is
BLOCK_N x BLOCK_K tiles, warps, stages. Usage: python tools/bench_tma_proj.py [1b|135m|8b ...]
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench_proj import graph_time_us  # tools/ is the script's directory

from fgchat.engine.kernels import gemv

L2_BYTES = 60 * 2**20
SHAPES = {  # name -> (N, K, GLU); gate_up: N = 2 x intermediate (rows gate | up)
    "1b": [("qkv", 3072, 2048, False), ("o", 2048, 2048, False), ("gate_up", 16384, 2048, True),
           ("down", 2048, 8192, False)],
    "135m": [("qkv", 960, 576, False), ("gate_up", 3072, 576, True), ("down", 576, 1536, False)],
    "8b": [("qkv", 6144, 4096, False), ("gate_up", 28672, 4096, True), ("down", 4096, 14336, False)],
}
# (BLOCK_N, BLOCK_K, warps, stages)
TMA_SWEEP = [(64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3), (64, 256, 4, 4), (128, 128, 4, 4),
             (128, 128, 8, 4), (32, 256, 4, 4), (32, 128, 4, 8), (64, 64, 4, 8), (128, 64, 4, 8)]


@triton.jit
def _tma_proj_kernel(x_ptr, w_desc, y_ptr, M, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    """Program pid owns output columns [pid*BLOCK_N, +BLOCK_N): weight tiles [BLOCK_N, BLOCK_K]
    by TMA (GLU: the up tile N rows further), x rows by pointer loads, the weight rows as the
    MMA's M dimension; float32 sums rounded to x's dtype (GLU: silu(gate) * up as gemv does)."""
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_ptr + offs_m[:, None] * K + k0 + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        w = w_desc.load([n0, k0])
        acc = tl.dot(w, tl.trans(x), acc)
        if GLU:
            wu = w_desc.load([N + n0, k0])
            acc_u = tl.dot(wu, tl.trans(x), acc_u)
    y = tl.trans(acc).to(x_ptr.dtype.element_ty)
    if GLU:
        g = y.to(tl.float32)
        u = tl.trans(acc_u).to(x_ptr.dtype.element_ty).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (s * u).to(x_ptr.dtype.element_ty)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], y, mask=m_mask[:, None] & (offs_n < N)[None, :])


def tma_call(x: torch.Tensor, w: torch.Tensor, glu: bool, bn: int, bk: int, warps: int, stages: int):
    """A closure launching the TMA kernel on x, w (descriptor built here, once)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n = w.shape[0] // 2 if glu else w.shape[0]
    k = w.shape[1]
    if n % bn or k % bk:
        raise ValueError("tiles must divide the shape")
    desc = TensorDescriptor.from_tensor(w, block_shape=[bn, bk])
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)

    def run():
        _tma_proj_kernel[(n // bn,)](x, desc, y, x.shape[0], N=n, K=k, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
                                     GLU=glu, NUM_STAGES=stages, num_warps=warps, num_stages=stages)
        return y

    return run


def reference(x: torch.Tensor, w: torch.Tensor, glu: bool) -> torch.Tensor:
    y = x.float() @ w.float().T
    if glu:
        g, u = y.chunk(2, dim=1)
        return F.silu(g) * u
    return y


def graph_us(calls: list) -> float:
    """us per call over bench_proj.REPS calls in one graph, cycling through `calls` (one per weight
    copy): bench_proj's timing with each captured call on the next copy."""
    turn = itertools.cycle(calls)
    return graph_time_us(lambda: next(turn)())


def main() -> None:
    models = sys.argv[1:] or ["1b"]
    print(f"{'model':5} {'proj':8} {'M':>2} {'cublas':>7} {'ours':>7} {'ours GB/s':>9} {'best TMA':>8} "
          f"{'GB/s':>5} {'TMA/ours':>8}  TMA tile  (us per call; max error vs float32: ours / TMA)")
    for model in models:
        for (name, n, k, glu), m in itertools.product(SHAPES[model], (1, 8)):
            nbytes = n * k * 2
            copies = max(2, -(-3 * L2_BYTES // nbytes))
            ws = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = reference(x, ws[0], glu)
            cub = [lambda w=w: F.linear(x, w) for w in ws]
            ours = [(lambda w=w: gemv.project_glu(x, w)) if glu else (lambda w=w: gemv.project(x, w)) for w in ws]
            err_ours = (ours[0]().float() - ref).abs().max().item()
            t_cub, t_ours = graph_us(cub), graph_us(ours)
            best = (float("inf"), None, float("nan"))
            for bn, bk, warps, stages in TMA_SWEEP:
                try:
                    calls = [tma_call(x, w, glu, bn, bk, warps, stages) for w in ws]
                    err = (calls[0]().float() - ref).abs().max().item()
                    t = graph_us(calls)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit is skipped
                    print(f"  skip {name} M={m} {bn}x{bk} w{warps} s{stages}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:100]}", file=sys.stderr)
                    continue
                if t < best[0]:
                    best = (t, f"{bn}x{bk} w{warps} s{stages}", err)
            t_tma, tile, err_tma = best
            print(f"{model:5} {name:8} {m:2d} {t_cub:7.1f} {t_ours:7.1f} {nbytes / t_ours / 1e3:9.0f} "
                  f"{t_tma:8.1f} {nbytes / t_tma / 1e3:5.0f} {t_tma / t_ours:8.3f}  {tile}  "
                  f"({err_ours:.2e} / {err_tma:.2e})", flush=True)
            del ws


if __name__ == "__main__":
    main()
