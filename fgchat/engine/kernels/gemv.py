"""Skinny projection y = x @ w^T for decode (16-row tiles, up to MAX_TILED_ROWS rows) as one Triton kernel.

Used where it beats cuBLAS (docs/design.md, V4, V18, V90, V92): small weight matrices,
the qkv projection under PDL, gate/up with SiLU in its epilogue, larger norm-fed projections split
along K into one wave of programs (1B's and 8B's o and down), and 8B's big() shapes, where
cuBLAS's M=1 kernels leave bandwidth unused. One program owns BLOCK_N output columns and streams
its weight rows once over all of K (or over its K slice) for one tile of MAX_ROWS activation rows;
more rows take more tiles (the grid's third axis), each running the same code.

Invariants: the reduction order depends only on (K, BLOCK_K) and each row's result only on
that row, so a row's output is identical at every batch size, in every graph mode and in a
verification step's rows (more than one tile); the config is chosen from shapes only, never
from the row count; no host sync, so it is safe under CUDA graph capture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fgchat.engine.intmath import cdiv, next_pow2
from fgchat.engine.kernels.activation import gate_activation
from fgchat.engine.kernels.launch import fast
from fgchat.engine.kernels.pdl import pdl_enter
from fgchat.engine.kernels.sampling_triton import LIBDEVICE, gumbel_scores, row_hash
MAX_ROWS = 16  # activation rows per program (one tile)
# most rows a call takes: a verification step's (engine.step.MAX_ROWS, 8 x 9) in whole tiles
MAX_TILED_ROWS = 5 * MAX_ROWS
# the sampled pick's per-row inputs: temperature float32 [M], seeds int64 [M], positions int64 [M]
SampleArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# Largest weight (elements) for which the kernel beat cuBLAS in the H200 sweep.
MAX_WEIGHT_ELEMENTS = 2048 * 2048


@triton.jit
def tile_product(x, w, SWAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] . w [BLOCK_N, BLOCK_K]^T, float32. SWAP: computed as (w . x^T)^T, so the
    weight rows fill the MMA's M dimension and the activation rows its N (same per-row order)."""
    if SWAP:
        return tl.trans(tl.dot(w, tl.trans(x), input_precision=DOT_PRECISION))
    return tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)


@triton.jit
def _proj_kernel(
    x_ptr, w_ptr, y_ptr, M, stride_y, stride_split,
    pmax_ptr, pidx_ptr, stride_p,  # ARGMAX outputs (None without)
    temp_ptr, seed_ptr, pos_ptr,  # SAMPLE: per row temperature, seed, position (None without)
    N: tl.constexpr, K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1, ARGMAX: tl.constexpr = False,
    GLU: tl.constexpr = False, SWAP: tl.constexpr = False, ROUND: tl.constexpr = True,
    SAMPLE: tl.constexpr = False, LIBDEVICE: tl.constexpr = True,
    PRE_TILES: tl.constexpr = 1, GELU: tl.constexpr = False,
):
    """Program (pid, ks) owns columns [pid*BLOCK_N, +BLOCK_N) over K slice ks of SPLIT_K. With
    SPLIT_K > 1 it stores its float32 partial sum in slab ks of y [SPLIT_K, M, N] (the consumer
    adds the slabs in order); else the sum rounded to x's dtype, stored in y's dtype. ARGMAX
    (SPLIT_K == 1): also the maximum of each row's stored values over the program's columns and
    its first column, at [row, pid] of pmax / pidx (finished by argmax_finish_kernel). SAMPLE
    (with ARGMAX): the maximum is over logit / T + Gumbel noise instead (rows with T > 0), the
    scores of sampling_triton.gumbel_scores, so the pick is sampling.sample's unfiltered token.
    GLU (SPLIT_K == 1): w is [2N, K], rows gate | up; y = silu(x.gate) * (x.up), each product
    rounded to x's dtype first, the activation as fused.silu_mul computes it (GELU: gelu_tanh).
    ROUND False (float32 y): the float32 sum is stored as it is (LM head logits: no bf16 ties).
    PRE_TILES 2 (pointer loads, EVEN_K and EVEN_N, not GLU, K_PART >= 2 BLOCK_K): the second weight
    tile is loaded before the PDL wait too (a slice of two tiles then reads all its weights while
    the previous kernel runs); same tiles, same sum order."""
    pid = tl.program_id(0)
    K_PART: tl.constexpr = K // SPLIT_K
    k_base = tl.program_id(1) * K_PART
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k0 = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K + k_base
    u_rows = w_rows + N * K  # GLU: the up row of each gate row
    x_rows = x_ptr + offs_m[:, None] * K + k_base
    # The first weight tile is loaded before waiting on the previous kernel (weights are never
    # written by a kernel); the K loop below starts at the second tile, so the sum's order is the
    # same with and without PDL: tile 0, tile 1, ...
    if EVEN_K and EVEN_N:
        w = tl.load(w_rows + offs_k0[None, :])
        if GLU:
            wu = tl.load(u_rows + offs_k0[None, :])
        if PRE_TILES == 2:
            w_1 = tl.load(w_rows + BLOCK_K + offs_k0[None, :])
    else:
        w0_mask = n_mask[:, None] & (offs_k0[None, :] < K_PART)
        w = tl.load(w_rows + offs_k0[None, :], mask=w0_mask, other=0.0)
        if GLU:
            wu = tl.load(u_rows + offs_k0[None, :], mask=w0_mask, other=0.0)
    pdl_enter(USE_PDL)
    x = tl.load(x_rows + offs_k0[None, :], mask=m_mask[:, None] & (offs_k0[None, :] < K_PART), other=0.0)
    acc = tile_product(x, w, SWAP, DOT_PRECISION)
    if GLU:
        acc_u = tile_product(x, wu, SWAP, DOT_PRECISION)
    if PRE_TILES == 2:
        x = tl.load(x_rows + BLOCK_K + offs_k0[None, :], mask=m_mask[:, None], other=0.0)
        acc += tile_product(x, w_1, SWAP, DOT_PRECISION)
    for k0 in range(BLOCK_K * PRE_TILES, K_PART, BLOCK_K):
        offs_k = k0 + offs_k0
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_rows + offs_k[None, :])
                if GLU:
                    wu = tl.load(u_rows + offs_k[None, :])
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
                if GLU:
                    wu = tl.load(u_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = offs_k[None, :] < K_PART
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
            if GLU:
                wu = tl.load(u_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
        acc += tile_product(x, w, SWAP, DOT_PRECISION)
        if GLU:
            acc_u += tile_product(x, wu, SWAP, DOT_PRECISION)
    if not GLU:
        acc_u = acc
    finish_tile(acc, acc_u, x_ptr, y_ptr, stride_y, stride_split, offs_m, offs_n, m_mask, n_mask, pid, BLOCK_N,
                pmax_ptr, pidx_ptr, stride_p, temp_ptr, seed_ptr, pos_ptr,
                SPLIT_K, ARGMAX, GLU, ROUND, SAMPLE, LIBDEVICE, GELU)


@triton.jit
def finish_tile(acc, acc_u, x_ptr, y_ptr, stride_y, stride_split, offs_m, offs_n, m_mask, n_mask, pid,
                BLOCK_N: tl.constexpr, pmax_ptr, pidx_ptr, stride_p, temp_ptr, seed_ptr, pos_ptr,
                SPLIT_K: tl.constexpr, ARGMAX: tl.constexpr, GLU: tl.constexpr, ROUND: tl.constexpr,
                SAMPLE: tl.constexpr, LIBDEVICE: tl.constexpr, GELU: tl.constexpr = False):
    """A projection program's epilogue (gemv's and qgemv's kernels). SPLIT_K > 1: its float32
    partial sums `acc` [BLOCK_M, BLOCK_N] go to slab program_id(1) of y (stride_split apart).
    Whole K: the sums are stored in y (rounded to x's dtype unless not ROUND, then to y's; GLU:
    silu (GELU: gelu_tanh) of them times acc_u's, each rounded first) and, with ARGMAX, each
    row's maximum over the stored values and its first column at [row, pid] of pmax / pidx
    (SAMPLE: of the Gumbel scores instead)."""
    out_mask = m_mask[:, None] & n_mask[None, :]
    out = y_ptr + offs_m[:, None] * stride_y + offs_n[None, :]
    if SPLIT_K > 1:
        tl.store(out + tl.program_id(1) * stride_split, acc, mask=out_mask)
    else:
        # rounded to the input dtype first (as F.linear does), then stored in y's dtype (f32 logits)
        if ROUND:
            y = acc.to(x_ptr.dtype.element_ty)
        else:
            y = acc
        if GLU:
            g = y.to(tl.float32)
            u = acc_u.to(x_ptr.dtype.element_ty).to(tl.float32)
            s = gate_activation(g, GELU, LIBDEVICE).to(x_ptr.dtype.element_ty).to(tl.float32)
            y = (s * u).to(x_ptr.dtype.element_ty)
        y = y.to(out.dtype.element_ty)
        tl.store(out, y, mask=out_mask)
        if ARGMAX:
            vals = y.to(tl.float32)
            if SAMPLE:
                t = tl.load(temp_ptr + offs_m, mask=m_mask, other=0.0)
                row = row_hash(tl.load(seed_ptr + offs_m, mask=m_mask, other=0),
                               tl.load(pos_ptr + offs_m, mask=m_mask, other=0))
                vals = gumbel_scores(vals, t[:, None], row[:, None], offs_n[None, :], LIBDEVICE)
            vals = tl.where(n_mask[None, :], vals, float("-inf"))
            best = tl.max(vals, axis=1)
            first = tl.argmax(vals, axis=1, tie_break_left=True)
            tl.store(pmax_ptr + offs_m * stride_p + pid, best, mask=m_mask)
            tl.store(pidx_ptr + offs_m * stride_p + pid, pid * BLOCK_N + first, mask=m_mask)


@triton.jit
def argmax_finish_kernel(pmax_ptr, pidx_ptr, out_ptr, P, stride_p, BLOCK_P: tl.constexpr,
                          USE_PDL: tl.constexpr = False):
    """Row r: the first column holding the row maximum, from the per-program maxima (programs
    cover increasing columns, so the first program with the maximum holds its first column)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    vals = tl.load(pmax_ptr + row * stride_p + offs, mask=offs < P, other=float("-inf"))
    at = tl.argmax(vals, axis=0, tie_break_left=True)
    tok = tl.load(pidx_ptr + row * stride_p + at)
    tl.store(out_ptr + row, tok.to(tl.int64))


@dataclass(frozen=True)
class ProjConfig:
    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = False  # weight rows as the MMA's M dimension (see tile_product)
    split: int = 0  # K slices of a norm-fed projection's partial sums (0: pick_split decides)

    @classmethod
    def parse(cls, text: str) -> ProjConfig:
        """"bn,bk,warps,stages[,swap[,split]]", e.g. "64,128,4,4,1" or "32,256,4,3,1,4" (tuning
        overrides; split 0: pick_split decides, else at least 2)."""
        try:
            parts = [int(p) for p in text.split(",")]
        except ValueError:
            parts = []
        if not 4 <= len(parts) <= 6 or min(parts[:4]) < 1 or min(parts) < 0 or parts[5:] == [1]:
            raise ValueError(f"projection config {text!r}: expected bn,bk,warps,stages[,swap[,split]] "
                             f"(split 0 or at least 2)")
        return cls(*parts[:4], *(bool(p) for p in parts[4:5]), *parts[5:])


def pick_config(n: int, k: int, glu: bool = False) -> ProjConfig:
    """Shape-only (eager and captured launches match). Narrow column tiles keep >= 1 program per
    SM for N >= 2048; wide K tiles keep 16 KiB of weights per stage in flight; vocabulary-sized N
    takes wide column tiles (LM head: 119 us vs cuBLAS 127 on the H200 sweep); the big() shapes
    and a large gate/up (two weight tiles per step of K) take 64 weight rows as the MMA's M."""
    if n >= 32768:
        return ProjConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
    # pointer loads (sweep_proj.py, H100): 8B qkv 19.0 us vs cuBLAS 20.9, o split 12.7 vs 16.3,
    # down split 39.9 vs 44.6; gate/up 23.2 / 79.9 vs cuBLAS + SiLU 26.6 / 86.9
    if big(n, k) or (glu and n * k >= 2048 * 2048 and k % 256 == 0):
        return ProjConfig(block_n=64, block_k=256, num_warps=4, num_stages=3, swap=True)
    # Mid-sized (1B's 3072 x 2048 qkv): 32-row tiles, 6 stages of 128 (H200 sweep: 5.5 us vs
    # cuBLAS 6.1 at M=1, 6.5 at M=8; the narrow-tile rule 7.6)
    if n * k > MAX_WEIGHT_ELEMENTS and max(n, k) <= 4096 and k % 128 == 0:
        return ProjConfig(block_n=32, block_k=128, num_warps=4, num_stages=6)
    return ProjConfig(block_k=512 if k % 512 == 0 else 128)


def big(n: int, k: int) -> bool:
    """Both sides >= 4096 (Llama-3.1-8B's qkv, o and down; not 1B's 2048 x 8192 down)."""
    return n >= 4096 and k >= 4096 and k % 256 == 0


def wins_over_cublas(w: torch.Tensor) -> bool:
    """Small weights, and the big() shapes with their swapped-operand tile (H200, one run:
    Llama-3.1-8B 4.461 ms on cuBLAS -> 4.239 with qkv, o, down on our kernel)."""
    return w.numel() <= MAX_WEIGHT_ELEMENTS or big(w.shape[0], w.shape[1])


# A norm-fed projection of at least MAX_WEIGHT_ELEMENTS (1B's and 8B's o and down): 64 weight rows
# as the MMA's M, split along K so its programs fill the SMs once (H100, 1B full, whole step, batch 1:
# down from cuBLAS + its reduce 1.091 -> 1.049 ms, split 2: 1.080, split 8: 1.101, the 16-row tile
# split 2: 1.075; o from the 16-row tile split 4 (512 programs) 1.034 -> 1.015; H200, 8B full: o
# from split 8 (512 programs) to split 2 (128) 4.351 -> 4.252; design.md V90, V92)
WIDE_K_TILE = ProjConfig(block_n=64, block_k=256, num_warps=4, num_stages=3, swap=True)


def wide_k_sized(w: torch.Tensor) -> bool:
    """At least MAX_WEIGHT_ELEMENTS: 1B's and 8B's o and down, not SmolLM2's."""
    return w.numel() >= MAX_WEIGHT_ELEMENTS


def wide_k_split(n: int, k: int, sm_count: int) -> int:
    """WIDE_K_TILE's split for an [n, k] weight: the most K slices of whole tiles (2..8) whose
    programs fit the SMs in one wave and fill at least 7/8 of it (the measured cases fill 91-97%);
    0 where none does, and the projection keeps its other route (shape and SM count only)."""
    tiles = cdiv(n, WIDE_K_TILE.block_n)
    fits = [s for s in range(2, 9) if 7 * sm_count <= 8 * tiles * s <= 8 * sm_count
            and k % (s * WIDE_K_TILE.block_k) == 0]
    return max(fits, default=0)


# gate/up whose 64-row tiles need more than one wave (8B: 224 programs on 132 SMs) in 128-row
# tiles, one wave (112 programs; H200, 8B full: 4.351 -> 4.257 ms at batch 1, 4.601 -> 4.533 at
# batch 8, design.md V92). Its three stages of two 128 x 128 weight tiles take 204 KB of shared memory
# (tools/compile_check.py, sm_90).
ONE_WAVE_GLU_TILE = ProjConfig(block_n=128, block_k=128, num_warps=8, num_stages=3, swap=True)
ONE_WAVE_GLU_SMEM = 208896


def one_wave_glu(n: int, k: int, sm_count: int, smem_per_block: int) -> bool:
    """ONE_WAVE_GLU_TILE for a gate/up of `n` outputs per half: where pick_config's 64-row GLU tile
    takes more than one wave, the 128-row one fits in one and fills at least 3/4 of the SMs (so
    Qwen2.5-1.5B's 8960, 70 programs on 132, keeps the 64-row tile), K is whole tiles, and a block
    may have the shared memory (shape, SM count and that limit only)."""
    if pick_config(n, k, glu=True).block_n != 64 or k % ONE_WAVE_GLU_TILE.block_k:
        return False
    wide = cdiv(n, ONE_WAVE_GLU_TILE.block_n)
    return cdiv(n, 64) > sm_count and 3 * sm_count <= 4 * wide <= 4 * sm_count \
        and smem_per_block >= ONE_WAVE_GLU_SMEM


def pick_split(n: int, k: int, sm_count: int, config: ProjConfig | None = None) -> int:
    """Split of K (shape and SM count only) for a projection whose consumer adds partial sums:
    the smallest split giving >= 2 programs per SM, with every slice whole tiles, of >= 512
    columns, and of >= 4096 where K allows (H200: 1B o 2048 wide best at 4 slices, 1B down
    8192 wide at 2, SmolLM2 down 1536 wide at 3)."""
    cfg = config or pick_config(n, k)
    programs = cdiv(n, cfg.block_n)
    min_slice = 4096 if k >= 8192 else 512
    split = 1
    for s in (2, 3, 4, 6, 8):
        if programs * split >= 2 * sm_count:
            break
        if k % (s * cfg.block_k) or k // s < min_slice:
            continue
        split = s
    return split


def project(x: torch.Tensor, w: torch.Tensor, config: ProjConfig | None = None,
            out_dtype: torch.dtype | None = None, pdl: bool = False, preload: int = 1) -> torch.Tensor:
    """x [M <= MAX_TILED_ROWS, K] @ w[N, K]^T -> [M, N] (float32 accumulation, rounded to x's dtype, stored
    as out_dtype, default x's). pdl: launch with programmatic dependent launch (see engine.pdl).
    preload: weight tiles loaded before the PDL wait, 1 or 2 (2 where the tiles allow it, see
    _proj_kernel's PRE_TILES; the same sums either way)."""
    return _launch(x, w, config, out_dtype, pdl, 1, preload=preload)


def project_logits(x: torch.Tensor, w: torch.Tensor, config: ProjConfig | None = None,
                   pdl: bool = False) -> torch.Tensor:
    """LM head: x [M <= MAX_TILED_ROWS, K] @ w[N, K]^T as float32 sums, never rounded to x's dtype (bf16
    logits near 25 step by 0.125, which turns near ties into exact ties that argmax breaks
    towards the lower token id)."""
    return _launch(x, w, config, torch.float32, pdl, 1, exact=True)


def project_argmax(x: torch.Tensor, w: torch.Tensor, config: ProjConfig | None = None,
                   pdl: bool = False, sample: SampleArgs | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head + greedy pick: float32 logits [M, N] as `project_logits` and, per row, the first
    index of its maximum (torch.argmax's choice) as int64 [M]. Two launches. With sample =
    (temperature float32 [M], seeds int64 [M], positions int64 [M]): per row the unfiltered
    sampled pick, sampling.sample(filtered=False)'s token (T <= 0 rows: the argmax)."""
    m, n = x.shape[0], w.shape[0]
    plan = _plan(m, n, x.shape[1], x.dtype, w.dtype, torch.float32, 1, True, pdl, config, exact=True,
                 sample=sample is not None)
    programs = plan.grid[0]
    pmax = torch.empty((m, programs), dtype=torch.float32, device=x.device)
    pidx = torch.empty((m, programs), dtype=torch.int32, device=x.device)
    logits = _launch(x, w, config, torch.float32, pdl, 1, argmax=(pmax, pidx), exact=True, sample=sample)
    tokens = torch.empty(m, dtype=torch.int64, device=x.device)
    fast(argmax_finish_kernel)[(m,)](pmax, pidx, tokens, programs, programs,
                                      BLOCK_P=max(16, next_pow2(programs)), USE_PDL=pdl,
                                      num_warps=4, launch_pdl=pdl)
    return logits, tokens


def project_glu(x: torch.Tensor, w_gate_up: torch.Tensor, config: ProjConfig | None = None,
                pdl: bool = False, gelu: bool = False) -> torch.Tensor:
    """x [M <= MAX_TILED_ROWS, K], w_gate_up [2I, K] (rows gate | up) -> silu(x @ gate^T) * (x @ up^T), [M, I],
    in one launch; each product rounded to x's dtype before the activation (as F.linear then
    fused.silu_mul). gelu: gelu_tanh in place of silu (Gemma)."""
    if w_gate_up.shape[0] % 2:
        raise ValueError("project_glu needs an even number of weight rows (gate | up)")
    return _launch(x, w_gate_up, config, None, pdl, 1, glu=True, gelu=gelu)


def project_partials(x: torch.Tensor, w: torch.Tensor, split: int, config: ProjConfig | None = None,
                     pdl: bool = False, preload: int = 1) -> torch.Tensor:
    """Split-K x @ w^T: float32 partial sums [split, M, N], slab s over K slice s. Their sum in
    slab order, rounded to x's dtype, is the projection (fused.add_rms_norm takes them as delta)."""
    if split < 2:
        raise ValueError("project_partials needs split >= 2 (use project)")
    return _launch(x, w, config, torch.float32, pdl, split, preload=preload)


@dataclass(frozen=True)
class _Plan:
    grid: tuple[int, int, int]  # (column blocks, K slices, row tiles)
    shape: tuple[int, ...]
    stride_y: int
    stride_split: int
    kw: dict


@functools.lru_cache(maxsize=1024)
def _plan(m: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype, out_dtype: torch.dtype,
          split: int, argmax: bool, pdl: bool, config: ProjConfig | None, glu: bool = False,
          exact: bool = False, sample: bool = False, preload: int = 1, gelu: bool = False) -> _Plan:
    """Grid, output shape and launch options of one call signature (validated once)."""
    if m > MAX_TILED_ROWS:
        raise ValueError(f"project handles at most {MAX_TILED_ROWS} rows, got {m}")
    cfg = config or pick_config(n, k, glu)
    if k % split or (split > 1 and (k // split) % cfg.block_k):
        raise ValueError(f"split {split} must cut K={k} into whole {cfg.block_k}-wide tiles")
    if preload not in (1, 2):
        raise ValueError(f"preload is 1 or 2 weight tiles, got {preload}")
    even_k, even_n = (k // split) % cfg.block_k == 0, n % cfg.block_n == 0
    pre = 2 if preload == 2 and even_k and even_n and not glu and k // split >= 2 * cfg.block_k else 1
    kw = dict(
        N=n, K=k, EVEN_K=even_k, EVEN_N=even_n, PRE_TILES=pre,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if w_dtype == torch.float32 else "tf32", USE_PDL=pdl,
        SPLIT_K=split, ARGMAX=argmax, GLU=glu, SWAP=cfg.swap, ROUND=not exact,
        SAMPLE=sample, LIBDEVICE=LIBDEVICE, GELU=gelu,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    shape = (split, m, n) if split > 1 else (m, n)
    return _Plan((cdiv(n, cfg.block_n), split, cdiv(m, MAX_ROWS)), shape, n, m * n if split > 1 else 0, kw)


def _launch(x: torch.Tensor, w: torch.Tensor, config: ProjConfig | None, out_dtype: torch.dtype | None,
            pdl: bool, split: int, argmax: tuple[torch.Tensor, torch.Tensor] | None = None,
            glu: bool = False, exact: bool = False,
            sample: SampleArgs | None = None, preload: int = 1, gelu: bool = False) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]
    if w.shape[1] != k or not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("project needs contiguous x [M, K] and w [N, K]")
    out_dtype = out_dtype or x.dtype
    if exact and out_dtype != torch.float32:
        raise ValueError("unrounded sums need a float32 output")
    if sample is not None and argmax is None:
        raise ValueError("sampling in the epilogue needs the argmax outputs")
    plan = _plan(m, n, k, x.dtype, w.dtype, out_dtype, split, argmax is not None, pdl, config, glu, exact,
                 sample is not None, preload, gelu)
    y = torch.empty(plan.shape, dtype=out_dtype, device=x.device)
    pmax, pidx = argmax if argmax is not None else (None, None)
    temp, seeds, positions = sample if sample is not None else (None, None, None)
    # non-constexpr arguments positionally: the fast launcher keys them cheaply
    fast(_proj_kernel)[plan.grid](x, w, y, m, plan.stride_y, plan.stride_split,
                                  pmax, pidx, pmax.stride(0) if pmax is not None else 0,
                                  temp, seeds, positions, **plan.kw)
    return y
