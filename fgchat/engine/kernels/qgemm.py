"""The prefill projection y = x @ w^T (+ bias) on quantized weights (qweight's planes) for x
[M, K] past qgemv's skinny rows: one tiled Triton GEMM per weight part, no dequantized copy of w.

A program owns a BLOCK_M x BLOCK_N tile of y and runs over K a tile of BLOCK_K columns at a time:
qtiles.weight_tile dequantizes the tile's weight rows in registers (exact float32; fp8 times its
row's scale), rounds them once to x's dtype and feeds its two halves, with x's matching columns,
to two tensor-core dots of the whole tile into a float32 accumulator. The bias is added to the
float32 sums and the result rounded once to x's dtype.

Invariants: the weight values entering the dots are exactly those qtiles.dequantize writes in
x's dtype (the same float32 expression rounded once), so the product is a GEMM over today's
dequantized weights; the config comes from shapes and the SM count only (no autotune) and the K
tiles run in order, so a result depends only on (format, shape, config); no host sync and no
allocation but the output (graph-safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fgchat.engine.intmath import cdiv
from fgchat.engine.kernels.launch import fast
from fgchat.engine.kernels.qtiles import CODES, NIBBLE_PAIR, pick_block_k, plane_args, weight_tile
from fgchat.engine.quant.qweight import QuantStack, QuantWeight, row_parts


@triton.jit
def _qgemm_kernel(
    x_ptr, y_ptr, bias_ptr, M, stride_xm, stride_ym,
    p0, p1, p2, p3, p4, p5,
    FMT: tl.constexpr, N: tl.constexpr, K: tl.constexpr, PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PREC: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Program pid owns y[m tile, n tile]; programs run GROUP_M row tiles down each column of
    tiles before the next column (a group's programs share x's rows and w's tiles in L2)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    TILES_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * TILES_N
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + pid % per_group % group_rows
    pid_n = pid % per_group // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    dtype = x_ptr.dtype.element_ty
    if FMT == 6:  # fp8: the row's scale, multiplied in before rounding (as qtiles.dequantize)
        scale = tl.load(p1 + rows, mask=n_mask[:, None], other=0.0).to(tl.float32)
    H: tl.constexpr = BLOCK_K // 2
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_lo, w_hi, c_lo, c_hi = weight_tile(FMT, p0, p1, p2, p3, p4, p5, rows, n_mask[:, None], k0, K, H, PAIR)
        if FMT == 6:
            w_lo = w_lo * scale
            w_hi = w_hi * scale
        x_lo = tl.load(x_rows + c_lo[None, :], mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_rows + c_hi[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(x_lo, tl.trans(w_lo.to(dtype)), acc, input_precision=PREC)
        acc = tl.dot(x_hi, tl.trans(w_hi.to(dtype)), acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    # the K tile: pick_block_k's widest up to this, or the format's least (two nibble pairs:
    # int4 and Q6_K 128); 64 keeps a 128 x 128 tile's float32 weight halves within registers
    widest_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8


def pick_config(m: int, n: int, sm_count: int) -> GemmConfig:
    """Shapes and SM count only: 128 x 128 tiles on 8 warps; 64 rows when M fits in 64 or when
    128-row tiles give fewer programs than SMs (1B's o and down at M = 512: 64 -> 128 programs),
    then 64 columns for N below 128; 8 warps for 128 weight rows (their float32 tile halves
    spill on 4), else 4."""
    bm = 64 if m <= 64 or cdiv(m, 128) * cdiv(n, 128) < sm_count else 128
    bn = 128 if n >= 128 else 64
    warps = 8 if bn >= 128 else 4
    return GemmConfig(block_m=bm, block_n=bn, num_warps=warps)


def _launch(x: torch.Tensor, w: QuantWeight, y: torch.Tensor, bias: torch.Tensor | None,
            cfg: GemmConfig) -> None:
    """y [M, N] (row stride y.stride(0)) = x @ w^T (+ bias [N]), x [M, K] with unit column stride."""
    m, k = x.shape
    n = w.shape[0]
    if w.fmt not in CODES:
        raise ValueError(f"no prefill kernel for weight format {w.fmt!r}")
    bk = pick_block_k(w.fmt, k, widest=max(cfg.widest_k, 2 * NIBBLE_PAIR.get(w.fmt, 16)))
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    fast(_qgemm_kernel)[grid](
        x, y, bias, m, x.stride(0), y.stride(0), *plane_args(w),
        FMT=CODES[w.fmt], N=n, K=k, PAIR=NIBBLE_PAIR.get(w.fmt, 1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gemm(x: torch.Tensor, w: QuantWeight | QuantStack, bias: torch.Tensor | None = None,
         config: GemmConfig | None = None, sm_count: int = 132) -> torch.Tensor:
    """x [..., K] @ w^T (+ bias) -> [..., N] in x's dtype: float32 sums over w's values rounded
    to x's dtype, bias added to the sums. A stack: one launch per part into its columns."""
    k = w.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"qgemm needs x [..., {k}], got {tuple(x.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = w.shape[0]
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        cfg = config or pick_config(x2.shape[0], n, sm_count)
        for at, p in row_parts(w):
            part_bias = bias[at:at + p.shape[0]] if bias is not None else None
            _launch(x2, p, y[:, at:at + p.shape[0]], part_bias, cfg)
    return y.reshape(*x.shape[:-1], n)
