"""The skinny projection y = x @ w^T (decode and verification: 16-row tiles, up to MAX_TILED_ROWS
rows) on quantized weights (qweight's planes), as one Triton kernel per call: one program owns
BLOCK_N output columns of one row tile and streams their weight rows over all of K (or its K
slice), a tile of BLOCK_K columns at a time. Each tile's product is kernels.qdot's: the stored
integers enter tensor-core dots as they are, one per scale group, and each group's float32 sum is
scaled (and its min term added) in float32, so the weights are carried exactly and only float32
sums round. fp8's per-channel scale multiplies each column's sum. Prefill rows (`linear`) past
MAX_TILED_ROWS run on kernels.qgemm's GEMM, which dequantizes each weight tile in registers into
tensor-core dots, up to GEMM_MAX_ROWS; past those, a dequantized copy and cuBLAS.

Variants as engine.gemv's: plain (rounded to x's dtype), split-K float32 partials (the norm adds
them), GLU (w rows gate | up: silu(x.gate) * (x.up) with gemv's roundings), float32 logits and a
per-program argmax (LM head, optionally the Gumbel-max sampled pick).

Invariants: the reduction order depends only on (format, K, BLOCK_K) and each row's result only
on that row (BLOCK_M is fixed), so a row's output is identical at every batch size and in every
graph mode; the config comes from shapes and the device's SM count only (pick_config's rule:
at least two programs per SM); no host sync (graph-safe).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fgchat.engine.intmath import cdiv, next_pow2
from fgchat.engine.kernels.gemv import MAX_ROWS, MAX_TILED_ROWS, SampleArgs, argmax_finish_kernel, finish_tile
from fgchat.engine.kernels.launch import fast
from fgchat.engine.kernels.pdl import pdl_enter
from fgchat.engine.kernels import qgemm
from fgchat.engine.kernels.qdot import PAIR, UNIT, prefetch_rows, tile_dot, tile_width
from fgchat.engine.kernels.qtiles import CODES, PLANES, dequantize, is_quantized, plane_args
from fgchat.engine.kernels.sampling_triton import LIBDEVICE
from fgchat.engine.quant.qweight import QuantStack, QuantWeight, row_parts

QWeight = QuantWeight | QuantStack


@triton.jit
def _qproj_kernel(
    x_ptr, y_ptr, M, stride_y, stride_split,
    p0, p1, p2, p3, p4, p5,
    pmax_ptr, pidx_ptr, stride_p,  # ARGMAX outputs (None without)
    temp_ptr, seed_ptr, pos_ptr,  # SAMPLE: per row temperature, seed, position (None without)
    FMT: tl.constexpr, N: tl.constexpr, K: tl.constexpr, PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr, USE_PDL: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
    ARGMAX: tl.constexpr = False, GLU: tl.constexpr = False,
    ROUND: tl.constexpr = True, SAMPLE: tl.constexpr = False, LIBDEVICE: tl.constexpr = True,
    PREFETCH: tl.constexpr = False, GELU: tl.constexpr = False,
):
    """Program (pid, ks, mt) owns columns [pid*BLOCK_N, +BLOCK_N) of row tile mt (rows
    [mt*BLOCK_M, +BLOCK_M)) over K slice ks of SPLIT_K; the outputs as gemv._proj_kernel's (SPLIT_K > 1: float32 partials in slab ks; GLU: w rows gate |
    up, N the gate's; ARGMAX / SAMPLE: per-program maxima). PREFETCH (with PDL, sm_90+): before
    the PDL wait the program asks L2 for its first tile's bytes of the first plane (weights are
    never written by a kernel); the sum runs tile 0, 1, ... either way."""
    pid = tl.program_id(0)
    K_PART: tl.constexpr = K // SPLIT_K
    k_base = tl.program_id(1) * K_PART
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    rows_u = rows + N  # GLU: the up row of each gate row
    if PREFETCH:
        ROW_BYTES: tl.constexpr = K if FMT == 0 or FMT == 6 else K // 2
        TILE_BYTES: tl.constexpr = BLOCK_K if FMT == 0 or FMT == 6 else BLOCK_K // 2
        byte0 = k_base * TILE_BYTES // BLOCK_K
        prefetch_rows(p0, rows, n_mask, ROW_BYTES, byte0, TILE_BYTES)
        if GLU:
            prefetch_rows(p0, rows_u, n_mask, ROW_BYTES, byte0, TILE_BYTES)
    pdl_enter(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_PART, BLOCK_K):
        acc, acc_u = tile_dot(FMT, acc, acc_u, x_ptr, offs_m, m_mask, p0, p1, p2, p3, p4, p5,
                              rows, rows_u, n_mask, k_base + kk, K, BLOCK_K, PAIR, GLU, PREC)
    if FMT == 6:  # fp8: the per-channel scale of each column's sum
        acc = acc * tl.load(p1 + offs_n, mask=n_mask, other=0.0)[None, :]
        if GLU:
            acc_u = acc_u * tl.load(p1 + N + offs_n, mask=n_mask, other=0.0)[None, :]
    finish_tile(acc, acc_u, x_ptr, y_ptr, stride_y, stride_split, offs_m, offs_n, m_mask, n_mask, pid, BLOCK_N,
                pmax_ptr, pidx_ptr, stride_p, temp_ptr, seed_ptr, pos_ptr,
                SPLIT_K, ARGMAX, GLU, ROUND, SAMPLE, LIBDEVICE, GELU)


@dataclass(frozen=True)
class QConfig:
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 2


# the widest tile per format: about 256 bytes of each weight row per tile (4-bit: 512 columns)
WIDEST = {"Q8_0": 256, "Q4_0": 512, "Q4_1": 512, "Q4_K": 512, "Q5_K": 512, "Q6_K": 256, "fp8": 256, "int4": 512}
# The launch rule: at least PROGRAMS_PER_SM programs per SM. At batch 1-8 a projection is a read
# of its weight; few programs leave SMs idle and give each a long chain of dependent tiles (H100,
# SmolLM2's Q4_1 blocks: 36-108 programs, 1.638 ms a step against bf16's 0.503).
PROGRAMS_PER_SM = 2
NARROWEST = 8  # rows of the narrowest tile (tl.dot pads N below the MMA's 8)
# Warps of a row tile: one below 32 rows. A 16-row tile on 2 or 4 warps repeats the tile's work
# in each (sm_90 SASS, tools/compile_check.py: 2-4x the instructions per weight of one warp,
# every format); 32 and 64 rows keep 4 (within 15% of the fewest per weight, half the chain).
WIDE_ROWS_WARPS = 4
SPLITS = (1, 2, 3, 4, 6, 8)
MIN_SLICE = 128  # columns of the narrowest K slice of a split
DEFAULT_SMS = 132  # a CPU launch (Triton's interpreter) picks as on an H100 / H200


def tile_k(fmt: str, k: int) -> int:
    """The widest K tile up to WIDEST that divides k and is whole units (qdot.UNIT): any multiple
    of the unit (a tile's units are a static loop), for fp8 a power of two (one dot spans its
    tile). ValueError if none."""
    if fmt != "fp8":
        unit = UNIT[fmt]
        for bk in range(WIDEST[fmt] // unit * unit, 0, -unit):
            if k % bk == 0:
                return bk
    return tile_width(fmt, k, WIDEST[fmt])


def _class_rows(n: int, k: int) -> int:
    """The row tile of the weight's size class: vocabulary-sized N 64, past 4M elements 32, else 16."""
    return 64 if n >= 32768 else 32 if n * k > 2048 * 2048 else 16


def pick_config(fmt: str, n: int, k: int, split: int = 1, sm_count: int = DEFAULT_SMS) -> QConfig:
    """Shape, format and SM count only (eager and captured launches match): the size class's row
    tile, halved down to NARROWEST while the launch (its `split` K slices included) has fewer than
    PROGRAMS_PER_SM programs per SM, on one warp below 32 rows; the K tile is tile_k of the K slice."""
    bn = _class_rows(n, k)
    while bn > NARROWEST and cdiv(n, bn) * split < PROGRAMS_PER_SM * sm_count:
        bn //= 2
    return QConfig(block_n=bn, block_k=tile_k(fmt, k // split), num_warps=WIDE_ROWS_WARPS if bn >= 32 else 1)


def pick_split(w: QWeight, sm_count: int) -> int:
    """Split of K for a norm-fed projection (the norm adds the partials), taken before pick_config
    narrows the rows: the smallest of SPLITS whose programs at the size class's row tiles reach
    PROGRAMS_PER_SM per SM, else the largest; each slice whole tiles of at least MIN_SLICE columns.
    Every part of a stack takes the same split (shapes and SM count only)."""
    parts = w.parts if isinstance(w, QuantStack) else [w]
    k = w.shape[1]
    programs = sum(cdiv(p.shape[0], _class_rows(p.shape[0], k)) for p in parts)
    fits = [s for s in SPLITS if k % s == 0 and (s == 1 or k // s >= MIN_SLICE)
            and not any(_no_tile(p.fmt, k // s) for p in parts)]
    reach = [s for s in fits if programs * s >= PROGRAMS_PER_SM * sm_count]
    return min(reach) if reach else max(fits, default=1)


def _no_tile(fmt: str, k: int) -> bool:
    try:
        tile_k(fmt, k)
    except ValueError:
        return True
    return False


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int | None) -> int:
    """SMs of CUDA device `device_index` (None: a CPU launch, DEFAULT_SMS)."""
    if device_index is None:
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_config(fmt: str, n: int, k: int, device: torch.device, split: int = 1) -> QConfig:
    """pick_config for a launch on `device` (its SM count)."""
    return pick_config(fmt, n, k, split, _sm_count(device.index if device.type == "cuda" else None))


@functools.lru_cache(maxsize=1024)
def _kwargs(fmt: str, n: int, k: int, x_dtype: torch.dtype, split: int, glu: bool, argmax: bool,
            sample: bool, rounded: bool, pdl: bool, prefetch: bool, config: QConfig | None,
            gelu: bool = False, sm_count: int = DEFAULT_SMS) -> tuple[tuple, dict]:
    """(grid, launch options) of one call signature (validated once)."""
    if fmt not in CODES:
        raise ValueError(f"no projection kernel for weight format {fmt!r}")
    cfg = config or pick_config(fmt, n, k, split, sm_count)
    if k % split or (k // split) % cfg.block_k or cfg.block_k % UNIT[fmt] or \
            (fmt == "fp8" and cfg.block_k & (cfg.block_k - 1)):
        raise ValueError(f"{fmt}: split {split} and tile {cfg.block_k} do not cut K={k} into whole tiles")
    kw = dict(
        FMT=CODES[fmt], N=n, K=k, PAIR=PAIR.get(fmt, 1),
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PREC="ieee" if x_dtype == torch.float32 else "tf32", USE_PDL=pdl,
        SPLIT_K=split, ARGMAX=argmax, GLU=glu, ROUND=rounded, SAMPLE=sample,
        LIBDEVICE=LIBDEVICE, PREFETCH=prefetch, GELU=gelu,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return (cdiv(n, cfg.block_n), split), kw


def check_config(w: QWeight, config: QConfig, split: int = 1) -> None:
    """ValueError unless `config` and `split` cut every part of w into whole tiles."""
    for p in (w.parts if isinstance(w, QuantStack) else [w]):
        _kwargs(p.fmt, p.shape[0], p.shape[1], torch.bfloat16, split, False, False, False, True, False, False,
                config)


def _prefetchable(w: QuantWeight) -> bool:
    """The first plane's rows can take the L2 bulk prefetch: 16-byte aligned base and row stride."""
    p0 = w.planes[PLANES[w.fmt][0]]
    return p0.data_ptr() % 16 == 0 and (p0.stride(0) * p0.element_size()) % 16 == 0


def _launch(x: torch.Tensor, w: QuantWeight, y: torch.Tensor, split: int = 1, glu: bool = False,
            argmax: tuple[torch.Tensor, torch.Tensor] | None = None, sample: SampleArgs | None = None,
            rounded: bool = True, pdl: bool = False, config: QConfig | None = None, gelu: bool = False) -> None:
    """Write x @ w^T into y ([M, N] with row stride y.stride(0), or [split, M, N] partials)."""
    m, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]
    if m > MAX_TILED_ROWS or w.shape[1] != k or not x.is_contiguous():
        raise ValueError(f"qgemv needs contiguous x [M <= {MAX_TILED_ROWS}, {w.shape[1]}], got {tuple(x.shape)}")
    grid, kw = _kwargs(w.fmt, n, k, x.dtype, split, glu, argmax is not None, sample is not None, rounded, pdl,
                       pdl and _prefetchable(w), config, gelu, _sm_count(x.device.index if x.is_cuda else None))
    pmax, pidx = argmax if argmax is not None else (None, None)
    temp, seeds, positions = sample if sample is not None else (None, None, None)
    stride_split = y.stride(0) if split > 1 else 0
    stride_y = y.stride(-2)
    fast(_qproj_kernel)[(*grid, cdiv(m, MAX_ROWS))](x, y, m, stride_y, stride_split, *plane_args(w),
                              pmax, pidx, pmax.stride(0) if pmax is not None else 0,
                              temp, seeds, positions, **kw)


def project(x: torch.Tensor, w: QWeight, pdl: bool = False,
            config: QConfig | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M <= MAX_TILED_ROWS, K] @ w^T -> [M, N], float32 sums rounded to x's dtype (stored as out_dtype,
    default x's). A stack: one launch per part into its columns of one output."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    for at, p in row_parts(w):
        _launch(x, p, y[:, at:at + p.shape[0]], pdl=pdl, config=config)
    return y


def project_partials(x: torch.Tensor, w: QWeight, split: int, pdl: bool = False,
                     config: QConfig | None = None) -> torch.Tensor:
    """Split-K x @ w^T: float32 partial sums [split, M, N], slab s over K slice s (their sum in
    slab order, rounded to x's dtype, is the projection; fused.add_rms_norm takes them)."""
    if split < 2:
        raise ValueError("project_partials needs split >= 2 (use project)")
    y = torch.empty((split, x.shape[0], w.shape[0]), dtype=torch.float32, device=x.device)
    for at, p in row_parts(w):
        _launch(x, p, y[:, :, at:at + p.shape[0]], split=split, pdl=pdl, config=config)
    return y


def project_glu(x: torch.Tensor, w_gate_up: QWeight, pdl: bool = False,
                config: QConfig | None = None, gelu: bool = False) -> torch.Tensor:
    """x [M, K], w_gate_up [2I, K] (rows gate | up) -> silu(x @ gate^T) * (x @ up^T), [M, I], each
    product rounded to x's dtype before the activation (gemv.project_glu's roundings). One launch
    for a QuantWeight; a stack runs its products, then fused.silu_mul. gelu: gelu_tanh for silu."""
    if w_gate_up.shape[0] % 2:
        raise ValueError("project_glu needs an even number of weight rows (gate | up)")
    if isinstance(w_gate_up, QuantStack):
        from fgchat.engine.kernels.fused import silu_mul

        return silu_mul(project(x, w_gate_up, pdl=pdl), pdl, gelu=gelu)
    y = torch.empty((x.shape[0], w_gate_up.shape[0] // 2), dtype=x.dtype, device=x.device)
    _launch(x, w_gate_up, y, glu=True, pdl=pdl, config=config, gelu=gelu)
    return y


def project_logits(x: torch.Tensor, w: QWeight, pdl: bool = False, config: QConfig | None = None) -> torch.Tensor:
    """LM head: float32 logits [M, N], the float32 sums never rounded to x's dtype."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32, device=x.device)
    for at, p in row_parts(w):
        _launch(x, p, y[:, at:at + p.shape[0]], rounded=False, pdl=pdl, config=config)
    return y


def project_argmax(x: torch.Tensor, w: QuantWeight, pdl: bool = False, sample: SampleArgs | None = None,
                   config: QConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head + pick: float32 logits [M, N] as `project_logits` and per row the first index of
    its maximum as int64 [M] (sample: gemv.project_argmax's sampled pick). Two launches."""
    if not isinstance(w, QuantWeight):
        raise ValueError("the quantized LM head's pick needs one format")
    m, n = x.shape[0], w.shape[0]
    cfg = config or launch_config(w.fmt, n, w.shape[1], x.device)
    programs = cdiv(n, cfg.block_n)
    pmax = torch.empty((m, programs), dtype=torch.float32, device=x.device)
    pidx = torch.empty((m, programs), dtype=torch.int32, device=x.device)
    logits = torch.empty((m, n), dtype=torch.float32, device=x.device)
    _launch(x, w, logits, argmax=(pmax, pidx), sample=sample, rounded=False, pdl=pdl, config=cfg)
    tokens = torch.empty(m, dtype=torch.int64, device=x.device)
    fast(argmax_finish_kernel)[(m,)](pmax, pidx, tokens, programs, programs,
                                      BLOCK_P=max(16, next_pow2(programs)), USE_PDL=pdl,
                                      num_warps=4, launch_pdl=pdl)
    return logits, tokens


# most rows qgemm's GEMM takes: past it the product dwarfs a dequantized copy's fixed cost and
# cuBLAS runs the product (design.md V117; sm_90 SASS puts the GEMM's in-register dequantization
# at 1.7-3.4x its tensor-core time, the copy at about the 1B's product at 512 rows)
GEMM_MAX_ROWS = 2048


def linear(x: torch.Tensor, w: torch.Tensor | QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a dense or quantized weight. Quantized: a contiguous 2-D x of up to
    MAX_TILED_ROWS rows on the skinny kernel (a row's bits as in a decode step), up to
    GEMM_MAX_ROWS on qgemm's GEMM over w's planes, more through a dequantized copy and cuBLAS."""
    if not is_quantized(w):
        return F.linear(x, w, bias)
    if x.shape[0] <= MAX_TILED_ROWS and x.dim() == 2 and x.is_contiguous():
        y = project(x, w)
        return y if bias is None else y + bias
    if x.numel() // x.shape[-1] <= GEMM_MAX_ROWS:
        return qgemm.gemm(x, w, bias, sm_count=_sm_count(x.device.index if x.is_cuda else None))
    return F.linear(x, dequantize(w, x.dtype), bias)


def embedding(ids: torch.Tensor, w: torch.Tensor | QuantWeight) -> torch.Tensor:
    """F.embedding for a dense or quantized embedding (rows dequantized to w.dtype)."""
    if isinstance(w, QuantWeight):
        from fgchat.engine.kernels.qtiles import dequantize_rows

        return dequantize_rows(w, ids)
    return F.embedding(ids, w)
