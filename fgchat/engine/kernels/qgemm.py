"""The prefill projection y = x @ w^T + bias (M > 16 rows) on quantized weights (qweight's planes),
as one Triton kernel per call and no dequantized copy of the weight: program (pid_n, 0, pid_m)
owns output columns [pid_n*BLOCK_N, +BLOCK_N) of rows [pid_m*BLOCK_M, +BLOCK_M) and streams their
weight rows over all of K, a tile of BLOCK_K columns at a time. Each tile's product is
kernels.qdot's (as the skinny kernels.qgemv's): the stored integers enter tensor-core dots as
they are, one per scale group, and each group's float32 sum is scaled in float32, so the weights
are carried exactly and only float32 sums round. fp8's per-channel scale multiplies each
column's sum; the bias (float32) is added to the sums, which are then rounded once to x's dtype.

Invariants: the reduction order over K depends only on (format, K, BLOCK_K); each row's result
only on that row; the config comes from shapes only; no host sync (graph-safe).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fgchat.engine.intmath import cdiv
from fgchat.engine.kernels.launch import fast
from fgchat.engine.kernels.qdot import PAIR, UNIT, tile_dot, tile_width
from fgchat.engine.kernels.qtiles import CODES, plane_args
from fgchat.engine.quant.qweight import QuantStack, QuantWeight, row_parts


@triton.jit
def _qgemm_kernel(
    x_ptr, y_ptr, bias_ptr, M, stride_y,
    p0, p1, p2, p3, p4, p5,
    FMT: tl.constexpr, N: tl.constexpr, K: tl.constexpr, PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Rows [program_id(2)*BLOCK_M, +BLOCK_M) of x (contiguous [M, K]) times weight rows
    [program_id(0)*BLOCK_N, +BLOCK_N), plus bias, rounded to x's dtype, stored in y (row stride
    stride_y)."""
    pid_n = tl.program_id(0)
    m0 = tl.program_id(2) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = acc  # tile_dot's GLU accumulator, unused here
    for kk in range(0, K, BLOCK_K):
        acc, acc_u = tile_dot(FMT, acc, acc_u, x_ptr, offs_m, m_mask, p0, p1, p2, p3, p4, p5,
                              rows, rows, n_mask, kk, K, BLOCK_K, PAIR, False, PREC)
    if FMT == 6:  # fp8: the per-channel scale of each column's sum
        acc = acc * tl.load(p1 + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :]
    tl.store(out, acc.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


# the widest GEMM tile per format: about 128 bytes of each weight row per tile; formats with mins
# (their x group sums are a second [BLOCK_M, BLOCK_N] float32 operand per unit) take narrower
# tiles or 8 warps, which sm_90's compile fits without spilling registers (tools/compile_check.py --quant)
GEMM_WIDEST = {"Q8_0": 128, "Q4_0": 256, "Q4_1": 64, "Q4_K": 128, "Q5_K": 128, "Q6_K": 256, "fp8": 128,
               "int4": 256}
GEMM_WARPS = {"Q4_K": 8, "Q5_K": 8}


def pick_gemm_config(fmt: str, n: int, k: int) -> GConfig:
    """Shape and format only: 64 x 64 output tiles, the widest tile of whole units (qdot.UNIT) up
    to GEMM_WIDEST that divides K, 4 warps (GEMM_WARPS), 3 stages."""
    return GConfig(block_k=tile_width(fmt, k, GEMM_WIDEST[fmt]), num_warps=GEMM_WARPS.get(fmt, 4))


@functools.lru_cache(maxsize=1024)
def gemm_kwargs(fmt: str, n: int, k: int, x_dtype: torch.dtype, bias: bool, config: GConfig | None) -> dict:
    """Launch options of one call signature (validated once)."""
    if fmt not in CODES:
        raise ValueError(f"no projection kernel for weight format {fmt!r}")
    cfg = config or pick_gemm_config(fmt, n, k)
    if k % cfg.block_k or cfg.block_k % UNIT[fmt]:
        raise ValueError(f"{fmt}: tile {cfg.block_k} does not cut K={k} into whole tiles")
    return dict(FMT=CODES[fmt], N=n, K=k, PAIR=PAIR.get(fmt, 1),
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                PREC="ieee" if x_dtype == torch.float32 else "tf32", HAS_BIAS=bias,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch(x: torch.Tensor, w: QuantWeight, y: torch.Tensor, bias: torch.Tensor | None,
            config: GConfig | None) -> None:
    m, k = x.shape
    n = w.shape[0]
    kw = gemm_kwargs(w.fmt, n, k, x.dtype, bias is not None, config)
    grid = (cdiv(n, kw["BLOCK_N"]), 1, cdiv(m, kw["BLOCK_M"]))
    fast(_qgemm_kernel)[grid](x, y, bias, m, y.stride(0), *plane_args(w), **kw)


def project_rows(x: torch.Tensor, w: QuantWeight | QuantStack, bias: torch.Tensor | None = None,
                 config: GConfig | None = None) -> torch.Tensor:
    """x [..., K] @ w^T + bias -> [..., N] in x's dtype (float32 sums, bias added in float32,
    rounded once). A stack: one launch per part into its columns of one output."""
    k = w.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"qgemm needs x [..., {k}], got {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        for at, p in row_parts(w):
            rows = p.shape[0]
            b = None if bias is None else bias[at:at + rows].contiguous()
            _launch(x2, p, y[:, at:at + rows], b, config)
    return y.reshape(*lead, w.shape[0])
