"""The quantized projection as it was before the exact integer dots (kernels.qgemv at the
commit before it): each tile dequantized to float32 in registers (scales gathered per element),
then hi + lo bf16 products. Kept only for tests/gpu/test_gpu_qgemv.py's old-vs-new timing print;
delete once measured. Single-format weights, project() only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fgchat.engine.intmath import cdiv
from fgchat.engine.kernels.gemv import MAX_ROWS, SampleArgs, finish_tile, tile_product
from fgchat.engine.kernels.launch import fast
from fgchat.engine.kernels.pdl import pdl_enter
from fgchat.engine.kernels.qtiles import (
    CODES, NIBBLE_PAIR, pick_block_k, plane_args, weight_tile,
)
from fgchat.engine.kernels.sampling_triton import LIBDEVICE
from fgchat.engine.quant.qweight import QuantStack, QuantWeight

QWeight = QuantWeight | QuantStack


@triton.jit
def _mac(acc, x_rows, m_mask, c, w, SWAP: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """acc + x[:, c] . w^T for a float32 weight half w [BLOCK_N, H] (SPLIT: as hi + lo parts)."""
    x = tl.load(x_rows + c[None, :], mask=m_mask[:, None], other=0.0)
    hi = w.to(x_rows.dtype.element_ty)
    acc += tile_product(x, hi, SWAP, PREC)
    if SPLIT:
        acc += tile_product(x, (w - hi.to(tl.float32)).to(x_rows.dtype.element_ty), SWAP, PREC)
    return acc


@triton.jit
def _qproj_kernel(
    x_ptr, y_ptr, M, stride_y, stride_split,
    p0, p1, p2, p3, p4, p5,
    pmax_ptr, pidx_ptr, stride_p,  # ARGMAX outputs (None without)
    temp_ptr, seed_ptr, pos_ptr,  # SAMPLE: per row temperature, seed, position (None without)
    FMT: tl.constexpr, N: tl.constexpr, K: tl.constexpr, PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr, USE_PDL: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
    ARGMAX: tl.constexpr = False, GLU: tl.constexpr = False, SWAP: tl.constexpr = False,
    ROUND: tl.constexpr = True, SAMPLE: tl.constexpr = False, LIBDEVICE: tl.constexpr = True,
    SPLIT_W: tl.constexpr = True,
):
    """Program (pid, ks) owns columns [pid*BLOCK_N, +BLOCK_N) over K slice ks of SPLIT_K; the
    outputs as gemv._proj_kernel's (SPLIT_K > 1: float32 partials in slab ks; GLU: w rows gate |
    up, N the gate's; ARGMAX / SAMPLE: per-program maxima). The first tile is dequantized before
    the PDL wait (weights are never written by a kernel); the sum runs tile 0, 1, ... either way."""
    pid = tl.program_id(0)
    K_PART: tl.constexpr = K // SPLIT_K
    H: tl.constexpr = BLOCK_K // 2
    k_base = tl.program_id(1) * K_PART
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    row_mask = n_mask[:, None]
    x_rows = x_ptr + offs_m[:, None] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_lo, w_hi, c_lo, c_hi = weight_tile(FMT, p0, p1, p2, p3, p4, p5, rows, row_mask, k_base, K, H, PAIR)
    if GLU:
        u_lo, u_hi, _, _ = weight_tile(FMT, p0, p1, p2, p3, p4, p5, rows + N, row_mask, k_base, K, H, PAIR)
    pdl_enter(USE_PDL)
    acc = _mac(acc, x_rows, m_mask, c_lo, w_lo, SWAP, SPLIT_W, PREC)
    acc = _mac(acc, x_rows, m_mask, c_hi, w_hi, SWAP, SPLIT_W, PREC)
    if GLU:
        acc_u = _mac(acc_u, x_rows, m_mask, c_lo, u_lo, SWAP, SPLIT_W, PREC)
        acc_u = _mac(acc_u, x_rows, m_mask, c_hi, u_hi, SWAP, SPLIT_W, PREC)
    for kk in range(BLOCK_K, K_PART, BLOCK_K):
        k0 = k_base + kk
        w_lo, w_hi, c_lo, c_hi = weight_tile(FMT, p0, p1, p2, p3, p4, p5, rows, row_mask, k0, K, H, PAIR)
        acc = _mac(acc, x_rows, m_mask, c_lo, w_lo, SWAP, SPLIT_W, PREC)
        acc = _mac(acc, x_rows, m_mask, c_hi, w_hi, SWAP, SPLIT_W, PREC)
        if GLU:
            u_lo, u_hi, _, _ = weight_tile(FMT, p0, p1, p2, p3, p4, p5, rows + N, row_mask, k0, K, H, PAIR)
            acc_u = _mac(acc_u, x_rows, m_mask, c_lo, u_lo, SWAP, SPLIT_W, PREC)
            acc_u = _mac(acc_u, x_rows, m_mask, c_hi, u_hi, SWAP, SPLIT_W, PREC)
    if FMT == 6:  # fp8: the per-channel scale of each column's sum
        acc = acc * tl.load(p1 + offs_n, mask=n_mask, other=0.0)[None, :]
        if GLU:
            acc_u = acc_u * tl.load(p1 + N + offs_n, mask=n_mask, other=0.0)[None, :]
    finish_tile(acc, acc_u, x_ptr, y_ptr, stride_y, stride_split, offs_m, offs_n, m_mask, n_mask, pid, BLOCK_N,
                pmax_ptr, pidx_ptr, stride_p, temp_ptr, seed_ptr, pos_ptr,
                SPLIT_K, ARGMAX, GLU, ROUND, SAMPLE, LIBDEVICE)


@dataclass(frozen=True)
class QConfig:
    block_n: int = 16
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2
    swap: bool = False  # weight rows as the MMA's M dimension (gemv.tile_product)


def pick_config(fmt: str, n: int, k: int, split: int = 1) -> QConfig:
    """Shape and format only (eager and captured launches match): vocabulary-sized N takes
    64-row tiles with the weight rows as the MMA's M; weights past 4M elements 32-row tiles; the
    rest 16. K tiles of up to 256 columns that divide the K slice."""
    bk = pick_block_k(fmt, k // split)
    if n >= 32768:
        return QConfig(block_n=64, block_k=bk, swap=True)
    if n * k > 2048 * 2048:
        return QConfig(block_n=32, block_k=bk)
    return QConfig(block_n=16, block_k=bk)


@functools.lru_cache(maxsize=1024)
def _kwargs(fmt: str, n: int, k: int, x_dtype: torch.dtype, split: int, glu: bool, argmax: bool,
            sample: bool, rounded: bool, pdl: bool, exact: bool, config: QConfig | None) -> tuple[tuple, dict]:
    """(grid, launch options) of one call signature (validated once)."""
    if fmt not in CODES:
        raise ValueError(f"no projection kernel for weight format {fmt!r}")
    cfg = config or pick_config(fmt, n, k, split)
    if k % split or (k // split) % cfg.block_k or cfg.block_k % (2 * NIBBLE_PAIR.get(fmt, 8)):
        raise ValueError(f"{fmt}: split {split} and tile {cfg.block_k} do not cut K={k} into whole tiles")
    kw = dict(
        FMT=CODES[fmt], N=n, K=k, PAIR=NIBBLE_PAIR.get(fmt, 1),
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PREC="ieee" if x_dtype == torch.float32 else "tf32", USE_PDL=pdl,
        SPLIT_K=split, ARGMAX=argmax, GLU=glu, SWAP=cfg.swap, ROUND=rounded, SAMPLE=sample,
        LIBDEVICE=LIBDEVICE, SPLIT_W=exact and fmt != "fp8" and x_dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return (cdiv(n, cfg.block_n), split), kw


def _launch(x: torch.Tensor, w: QuantWeight, y: torch.Tensor, split: int = 1, glu: bool = False,
            argmax: tuple[torch.Tensor, torch.Tensor] | None = None, sample: SampleArgs | None = None,
            rounded: bool = True, pdl: bool = False, exact: bool = True, config: QConfig | None = None) -> None:
    """Write x @ w^T into y ([M, N] with row stride y.stride(0), or [split, M, N] partials)."""
    m, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]
    if m > MAX_ROWS or w.shape[1] != k or not x.is_contiguous():
        raise ValueError(f"qgemv needs contiguous x [M <= {MAX_ROWS}, {w.shape[1]}], got {tuple(x.shape)}")
    grid, kw = _kwargs(w.fmt, n, k, x.dtype, split, glu, argmax is not None, sample is not None, rounded, pdl,
                       exact, config)
    pmax, pidx = argmax if argmax is not None else (None, None)
    temp, seeds, positions = sample if sample is not None else (None, None, None)
    stride_split = y.stride(0) if split > 1 else 0
    stride_y = y.stride(-2)
    fast(_qproj_kernel)[grid](x, y, m, stride_y, stride_split, *plane_args(w),
                              pmax, pidx, pmax.stride(0) if pmax is not None else 0,
                              temp, seeds, positions, **kw)


def project(x: torch.Tensor, w: QWeight, pdl: bool = False, exact: bool = True,
            config: QConfig | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M <= 16, K] @ w^T -> [M, N], float32 sums rounded to x's dtype (stored as out_dtype,
    default x's). A stack: one launch per part into its columns of one output."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    _launch(x, w, y, pdl=pdl, exact=exact, config=config)
    return y
