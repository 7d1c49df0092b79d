"""Skinny projection y = x @ w^T for decode (M <= 16 rows) as one Triton kernel.

Used where it beats cuBLAS on the H200 (docs/notes/decode-step.md, V4): small weight matrices
(attention output, small models' MLP down), where cuBLAS's M=1 kernels leave bandwidth unused.
One program owns BLOCK_N output columns and streams its weight rows once over all of K.

Invariants: the reduction order depends only on (K, BLOCK_K) and each row's result only on
that row, so a row's output is identical at every batch size and in every graph mode; the
config is chosen from shapes only; no host sync, so it is safe under CUDA graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fgchat.engine.launch import fast
from fgchat.engine.pdl import pdl_enter

MAX_ROWS = 16
# Largest weight (elements) for which the kernel beat cuBLAS in the H200 sweep.
MAX_WEIGHT_ELEMENTS = 2048 * 2048


@triton.jit
def _proj_kernel(
    x_ptr, w_ptr, y_ptr, M, stride_y,
    N: tl.constexpr, K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k0 = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    # The first weight tile is loaded before waiting on the previous kernel (weights are never
    # written by a kernel); the K loop below starts at the second tile, so the sum's order is the
    # same with and without PDL: tile 0, tile 1, ...
    if EVEN_K and EVEN_N:
        w = tl.load(w_rows + offs_k0[None, :])
    else:
        w = tl.load(w_rows + offs_k0[None, :], mask=n_mask[:, None] & (offs_k0[None, :] < K), other=0.0)
    pdl_enter(USE_PDL)
    x = tl.load(x_ptr + offs_m[:, None] * K + offs_k0[None, :], mask=m_mask[:, None] & (offs_k0[None, :] < K),
                other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + offs_k0
        if EVEN_K:
            x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_rows + offs_k[None, :])
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = offs_k[None, :] < K
            x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    out_mask = m_mask[:, None] & n_mask[None, :]
    # rounded to the input dtype first (as F.linear does), then stored in y's dtype (f32 logits)
    y = acc.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], y, mask=out_mask)


@dataclass(frozen=True)
class ProjConfig:
    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4


def pick_config(n: int, k: int) -> ProjConfig:
    """Shape-only (eager and captured launches match). Narrow column tiles keep >= 1 program per
    SM for N >= 2048; wide K tiles keep 16 KiB of weights per stage in flight; vocabulary-sized N
    takes wide column tiles (LM head: 119 us vs cuBLAS 127 on the H200 sweep)."""
    if n >= 32768:
        return ProjConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
    return ProjConfig(block_k=512 if k % 512 == 0 else 128)


def wins_over_cublas(w: torch.Tensor, max_elements: int = MAX_WEIGHT_ELEMENTS) -> bool:
    return w.numel() <= max_elements


def project(x: torch.Tensor, w: torch.Tensor, config: ProjConfig | None = None,
            out_dtype: torch.dtype | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M <= 16, K] @ w[N, K]^T -> [M, N] (float32 accumulation, rounded to x's dtype, stored
    as out_dtype, default x's). pdl: launch with programmatic dependent launch (see engine.pdl)."""
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"project handles at most {MAX_ROWS} rows, got {m}")
    if w.shape[1] != k or not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("project needs contiguous x [M, K] and w [N, K]")
    n = w.shape[0]
    cfg = config or pick_config(n, k)
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    fast(_proj_kernel)[(triton.cdiv(n, cfg.block_n),)](
        x, w, y, m, y.stride(0), n, k,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if w.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return y
