"""H200 microbenchmark: the prefill's projections (M rows of prompt at once) on cuBLAS (F.linear,
what the fused prefill runs) against a tiled Triton GEMM swept over tiles, stages, warps, weight
loads (pointers or host TMA descriptors) and split-K, plus gate/up with SiLU-and-multiply in the
GEMM's epilogue against F.linear followed by the engine's silu_mul kernel.

Each variant runs REPS times inside one CUDA graph (tools/bench_proj's timing); prints us per call,
TFLOP/s and the largest error against a float32 product (relative to the reference's largest
magnitude). Split-K rows time the partial sums alone ("parts": what a reduce fused into the next
add + RMSNorm would leave) and with a separate sum to bf16 ("+sum").
Usage: python tools/bench_prefill_gemm.py [1b|8b ...] [--rows 512,4096] [--quick]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench_proj import graph_time_us  # tools/ is the script's directory

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

# name -> [(role, N, K)]; gate_up: N = both halves (gate rows, then up rows)
SHAPES = {
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}
# (BM, BN, BK, warps, stages, group_m)
TILES = [(128, 128, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8), (128, 256, 64, 8, 3, 8), (64, 128, 64, 4, 4, 8),
         (128, 64, 64, 4, 4, 8), (64, 256, 64, 8, 3, 8), (128, 128, 128, 8, 3, 8), (256, 128, 64, 8, 3, 8),
         (64, 64, 128, 4, 4, 8)]
QUICK = TILES[:4]
SPLITS = (1, 2, 4)


@triton.jit
def _tile_ids(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


@triton.jit
def _mm_ptr(a_ptr, w_ptr, c_ptr, M, N, KPER, sam, swn, scm, scs,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
            SPLIT: tl.constexpr, GLU: tl.constexpr):
    """C = A @ W^T over K = SPLIT * KPER (tiles divide M, N, KPER). SPLIT > 1: float32 partials at
    c + split * scs.
    GLU: W is [2N, K] (gate rows, then up rows) and C = silu(A Wg^T) * (A Wu^T)."""
    pm, pn = _tile_ids(tl.program_id(0), M, N, BM, BN, GROUP_M)
    ks = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = ks * KPER + tl.arange(0, BK)
    a = a_ptr + rm[:, None] * sam + rk[None, :]
    w = w_ptr + rn[:, None] * swn + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, KPER, BK):
        x = tl.load(a)
        acc = tl.dot(x, tl.trans(tl.load(w)), acc)
        if GLU:
            acc_u = tl.dot(x, tl.trans(tl.load(w + N * swn)), acc_u)
        a += BK
        w += BK
    c = c_ptr + rm[:, None] * scm + rn[None, :]
    if GLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u
    if SPLIT == 1:
        tl.store(c, acc.to(c_ptr.dtype.element_ty))
    else:
        tl.store(c + ks * scs, acc)


@triton.jit
def _mm_tma(a_desc, w_desc, c_desc, M, N, K,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
            GLU: tl.constexpr):
    """C = A @ W^T with every tile by bulk copy (host descriptors); GLU as in _mm_ptr."""
    pm, pn = _tile_ids(tl.program_id(0), M, N, BM, BN, GROUP_M)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        x = a_desc.load([pm * BM, k])
        acc = tl.dot(x, w_desc.load([pn * BN, k]).T, acc)
        if GLU:
            acc_u = tl.dot(x, w_desc.load([N + pn * BN, k]).T, acc_u)
    if GLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u
    c_desc.store([pm * BM, pn * BN], acc.to(tl.bfloat16))


def triton_call(x: torch.Tensor, w: torch.Tensor, tile: tuple, split: int, tma: bool, glu: bool,
                reduce: bool):
    """A closure running one variant (output allocated once), or None where the tile does not fit."""
    bm, bn, bk, warps, stages, group = tile
    m, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]
    if m % bm or n % bn or k % (bk * split) or (split > 1 and (tma or glu)):
        return None
    grid = (m // bm * (n // bn), split)
    if tma:
        if TensorDescriptor is None:
            return None
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        ad = TensorDescriptor.from_tensor(x, [bm, bk])
        wd = TensorDescriptor.from_tensor(w, [bn, bk])
        cd = TensorDescriptor.from_tensor(out, [bm, bn])

        def run_tma():
            _mm_tma[grid[:1]](ad, wd, cd, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=group, GLU=glu,
                              num_warps=warps, num_stages=stages)
            return out
        return run_tma
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    scs = out.stride(0) if split > 1 else 0
    scm = out.stride(-2)

    def run():
        _mm_ptr[grid](x, w, out, m, n, k // split, x.stride(0), w.stride(0), scm, scs, BM=bm, BN=bn, BK=bk,
                      GROUP_M=group, SPLIT=split, GLU=glu, num_warps=warps, num_stages=stages)
        if split > 1 and reduce:
            return out.sum(0).to(x.dtype)
        return out if split == 1 else out.sum(0)
    return run


def reference(x: torch.Tensor, w: torch.Tensor, glu: bool) -> torch.Tensor:
    y = x.float() @ w.float().T
    if glu:
        g, u = y.chunk(2, dim=1)
        return F.silu(g) * u
    return y


def cublas(x: torch.Tensor, w: torch.Tensor, glu: bool):
    if not glu:
        return lambda: F.linear(x, w)
    from fgchat.engine.kernels import fused as fk
    return lambda: fk.silu_mul(F.linear(x, w))


def err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max())


def row(label: str, us: float, flop: float, e: float, base: float) -> str:
    return f"  {label:<44} {us:9.1f} us {flop / us / 1e6:7.0f} TFLOP/s  err {e:.2e}  x{base / us:5.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["1b"])
    ap.add_argument("--rows", default="512,4096")
    ap.add_argument("--quick", action="store_true", help="the first four tiles only")
    args = ap.parse_args()
    tiles = QUICK if args.quick else TILES
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    for model, m in itertools.product(args.models, [int(r) for r in args.rows.split(",")]):
        for role, n, k in SHAPES[model]:
            x = torch.randn(m, k, device="cuda").bfloat16()
            w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
            roles = [(role, False)] + ([("gate_up+silu", True)] if role == "gate_up" else [])
            for name, glu in roles:
                ref = reference(x, w, glu)
                flop = 2.0 * m * n * k
                base_fn = cublas(x, w, glu)
                base = graph_time_us(base_fn)
                print(f"{model} {name} M={m} N={n} K={k}")
                print(row("cuBLAS" + (" + silu_mul" if glu else ""), base, flop, err(base_fn(), ref), base))
                results = []
                for tile, split, tma in itertools.product(tiles, SPLITS, (False, True)):
                    for reduce in ((False, True) if split > 1 else (True,)):
                        fn = triton_call(x, w, tile, split, tma, glu, reduce)
                        if fn is None:
                            continue
                        try:
                            e = err(fn(), ref)
                            us = graph_time_us(fn)
                        except Exception as exc:  # a tile that does not compile or fit shared memory
                            print(f"  {tile} split {split} tma {int(tma)}: {type(exc).__name__}")
                            break
                        tag = f"{'tma' if tma else 'ptr'} {tile[:3]} w{tile[3]} s{tile[4]}"
                        if split > 1:
                            tag += f" split{split} {'+sum' if reduce else 'parts'}"
                        results.append((us, tag, e))
                for us, tag, e in sorted(results)[:6]:
                    print(row(tag, us, flop, e, base))


if __name__ == "__main__":
    main()
