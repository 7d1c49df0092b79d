"""Decode-step projections as one Triton kernel each: skinny GEMM (M <= 16 rows) with the
residual add + RMSNorm fused in front and bias / SiLU-gate / float32 logits fused behind.

One program owns BLOCK_N output columns and streams its weight rows once over all of K, so the
weight matrix (the step's dominant byte cost) is read exactly once per step. The RMSNorm needs
the whole row before any column can be normalised; it is folded in by linearity instead:
    rmsnorm(h) * g @ W^T == ((h * g) @ W^T) * rsqrt(mean(h^2) + eps)
so a single pass accumulates both the dot products of (h * g) and the sum of squares of h.

Invariants:
- the residual stream h = x + delta is rounded to the model dtype (as torch's add would) and
  written by program 0 only, to a fresh buffer that no program reads;
- the reduction order depends only on (K, BLOCK_K) and each row's result only on that row, so
  a row's output is identical at every batch size and in every graph mode;
- no host sync, no Python branch on tensor values: safe under CUDA graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16


@triton.jit
def _proj_kernel(
    x_ptr, d_ptr, g_ptr, w_ptr, b_ptr, h_out_ptr, y_ptr,
    M, eps, stride_y,
    N: tl.constexpr, K: tl.constexpr,
    NORM: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k0 = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    if GATED:
        u_rows = w_ptr + (offs_n.to(tl.int64) + N)[:, None] * K  # rows [N, 2N) are the up half
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    ty = w_ptr.dtype.element_ty
    is_first = pid == 0
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_k0
        if EVEN_K:
            x_mask = m_mask[:, None]
        else:
            x_mask = m_mask[:, None] & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=x_mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + offs_m[:, None] * K + offs_k[None, :], mask=x_mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(ty)
            tl.store(h_out_ptr + offs_m[:, None] * K + offs_k[None, :], x, mask=x_mask & is_first)
        if NORM:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
            if EVEN_K:
                g = tl.load(g_ptr + offs_k)
            else:
                g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0)
            x = (xf * g.to(tl.float32)[None, :]).to(ty)
        if EVEN_K and EVEN_N:
            w = tl.load(w_rows + offs_k[None, :])
        elif EVEN_K:
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K and EVEN_N:
                u = tl.load(u_rows + offs_k[None, :])
            else:
                u = tl.load(u_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
            acc_u += tl.dot(x, tl.trans(u), input_precision=DOT_PRECISION)
    if NORM:
        inv = 1.0 / tl.sqrt(ss / K + eps)
        acc = acc * inv[:, None]
        acc_u = acc_u * inv[:, None]
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    # Round where torch would: the projection's output in the model dtype, then the epilogue.
    y = acc.to(ty).to(tl.float32)
    if GATED:
        u_out = acc_u.to(ty).to(tl.float32)
        s = (y / (1.0 + tl.exp(-y))).to(ty).to(tl.float32)
        y = (s * u_out).to(ty).to(tl.float32)
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class ProjConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def pick_config(n: int, k: int, gated: bool) -> ProjConfig:
    """Shape-only choice (so eager and captured launches match): enough programs to cover the
    SMs about twice, wide K tiles so each program keeps several KiB of weights in flight."""
    block_k = 256 if k >= 1024 else 128 if k >= 256 else 64
    for block_n in (64, 32):
        if n // block_n >= 256:
            return ProjConfig(block_n, block_k)
    return ProjConfig(16, block_k)


def project(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    delta: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    out_dtype: torch.dtype | None = None,
    config: ProjConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = [silu-gate](rmsnorm(x + delta) * norm_weight @ w^T + bias) for x [M <= 16, K].

    Returns (h, y): h = x + delta (x itself without delta); y [M, N] with N = w.shape[0], or
    N = w.shape[0] // 2 with gated (w rows are gate | up, y = silu(gate) * up).
    Without norm_weight no normalisation is applied.
    """
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"project handles at most {MAX_ROWS} rows, got {m}")
    if w.shape[1] != k or not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("project needs contiguous x [M, K] and w [N, K]")
    n = w.shape[0] // 2 if gated else w.shape[0]
    cfg = config or pick_config(n, k, gated)
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    h = torch.empty_like(x) if delta is not None else x
    _proj_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, delta if delta is not None else x, norm_weight if norm_weight is not None else x,
        w, bias if bias is not None else w, h, y,
        m, eps, y.stride(0), n, k,
        NORM=norm_weight is not None, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None,
        GATED=gated, EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if w.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return h, y
