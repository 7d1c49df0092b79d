"""Weight prefetch into the L2 cache beside the attention call of a whole-step CUDA graph.

Decode attention at small batch is latency-bound: while it runs, HBM is mostly idle. In a full
graph the step forks a side branch at each attention call that asks the L2 cache to fetch the
weights read next (the o projection, then gate/up, down and the next layer's qkv while each fits
the budget whole), so those kernels read them from L2 instead of HBM. Piecewise graphs must join
their branches before each piece ends, which is before the eager attention starts; where every
layer's weights fit the budget they fork the same prefetch at the
layer's first stage instead (the kernel only issues requests, so the join does not wait for the
fills).

In graphs of several rows (fused_step.LEAD_MIN_ROWS), a gate/up too large to fit whole gets its
leading K columns (whole tiles of its kernel) as well: every program of that kernel reads those
first, so they are used before later reads evict them, where a whole-row prefix of the weight is
read by a few programs over the kernel's whole run (design.md V94).

Invariants:
- a prefetch never writes memory and never changes a result; it is a hint the hardware may drop;
- only whole chunks of CHUNK bytes (a row's leading part: a multiple of 16 bytes) at
  16-byte-aligned addresses are requested (the bulk prefetch instruction's contract), so a
  range's tail shorter than a chunk is left out;
- sm_90+ only (`cp.async.bulk.prefetch.L2`); elsewhere `supported` is False and nothing runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fgchat.engine.kernels.pdl import sm90_or_newer

CHUNK = 4096  # bytes per bulk prefetch: one 1B weight row, and a multiple of 16
BLOCK = 32  # chunks per program: one warp, one chunk per thread, spread over many SMs


@dataclass(frozen=True)
class Range:
    addr: int  # device address, 16-byte aligned
    chunks: int  # CHUNK-byte chunks from addr


@dataclass(frozen=True)
class Rows:
    """The first `row_bytes` of each of `rows` rows that start `stride` bytes apart."""
    addr: int  # device address of row 0, 16-byte aligned, as is the stride
    rows: int
    stride: int
    row_bytes: int  # a multiple of 16


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, or of a quantized weight's planes (both have .nbytes)."""
    return t.nbytes


def fitting(tensors: list[torch.Tensor], budget_bytes: int) -> list[torch.Tensor]:
    """The tensors from the front of `tensors` whose bytes together fit `budget_bytes`, up to the
    first that does not (the ones `plan` covers)."""
    out: list[torch.Tensor] = []
    left = budget_bytes
    for t in tensors:
        if nbytes(t) > left:
            break
        left -= nbytes(t)
        out.append(t)
    return out


def leading_tiles(w: torch.Tensor, tile_cols: int, budget_bytes: int) -> Rows | None:
    """The most leading tiles of `tile_cols` columns of every row of the 2-D weight `w` that fit
    `budget_bytes`, at most half of its columns (the part every program reads early); None where
    no tile fits or the rows cannot be prefetched (not row-contiguous, unaligned)."""
    rows, cols = w.shape
    tile_bytes = tile_cols * w.element_size()
    tiles = min(budget_bytes // (rows * tile_bytes), cols // tile_cols // 2)
    stride = w.stride(0) * w.element_size()
    if tiles < 1 or w.stride(1) != 1 or w.data_ptr() % 16 or stride % 16 or tile_bytes % 16:
        return None
    return Rows(w.data_ptr(), rows, stride, tiles * tile_bytes)


def plan(tensors: list[torch.Tensor], budget_bytes: int) -> list[Range]:
    """Ranges covering `tensors` in order, each one whole, while they fit in `budget_bytes`.

    The first tensor that does not fit ends the plan: the part of a large weight that its kernel
    reads late is evicted before use (H200, 1B: budgets that took part of gate/up were slower).
    """
    return ranges(fitting(tensors, budget_bytes))


def ranges(tensors: list[torch.Tensor]) -> list[Range]:
    """A Range of whole chunks for each tensor the bulk prefetch can take (contiguous, 16-byte
    aligned, at least one chunk); the others are left out."""
    return [Range(t.data_ptr(), nbytes(t) // CHUNK) for t in tensors
            if t.is_contiguous() and t.data_ptr() % 16 == 0 and nbytes(t) >= CHUNK]


@triton.jit
def _prefetch_kernel(a_addr, a_chunks, b_addr, b_chunks, CHUNK_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_a = i < a_chunks
    addr = tl.where(in_a, a_addr + i.to(tl.int64) * CHUNK_BYTES,
                    b_addr + (i - a_chunks).to(tl.int64) * CHUNK_BYTES)
    live = (i < a_chunks + b_chunks).to(tl.int32)
    size = tl.full([BLOCK], CHUNK_BYTES, tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, live], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows_kernel(addr, rows, stride, ROW_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = (i < rows).to(tl.int32)
    row_addr = addr + tl.where(i < rows, i, 0).to(tl.int64) * stride
    size = tl.full([BLOCK], ROW_BYTES, tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [row_addr, size, live], dtype=tl.int32, is_pure=False, pack=1)


def issue(ranges: list[Range | Rows]) -> None:
    """Request every range into L2 from the current stream: the whole ranges first (one launch per
    two), then each Rows (one launch each)."""
    whole = [r for r in ranges if isinstance(r, Range)]
    for j in range(0, len(whole), 2):
        a = whole[j]
        b = whole[j + 1] if j + 1 < len(whole) else Range(a.addr, 0)
        total = a.chunks + b.chunks
        _prefetch_kernel[(triton.cdiv(total, BLOCK),)](a.addr, a.chunks, b.addr, b.chunks,
                                                       CHUNK_BYTES=CHUNK, BLOCK=BLOCK, num_warps=1)
    for r in ranges:
        if isinstance(r, Rows):
            _prefetch_rows_kernel[(triton.cdiv(r.rows, BLOCK),)](r.addr, r.rows, r.stride,
                                                                 ROW_BYTES=r.row_bytes, BLOCK=BLOCK, num_warps=1)


def supported(device: torch.device) -> bool:
    """The bulk L2 prefetch needs an NVIDIA GPU of compute capability 9.0 or newer."""
    return sm90_or_newer(device)
