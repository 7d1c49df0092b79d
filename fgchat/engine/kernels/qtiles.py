"""Dequantizing tiles of a QuantWeight in registers (Triton), and the kernels that write
dequantized rows: the embedding lookup of a quantized embedding and the prefill's scratch copy.

A tile is BLOCK_K consecutive columns k0 .. k0 + BLOCK_K of some weight rows, returned as two
halves of H = BLOCK_K / 2 columns each with their column indices: for a nibble plane (P the
format's pair distance) byte t of the tile gives the low half's column k0 + 2P*(t // P) + t % P
and the high half's that + P, so every byte is loaded once; byte formats (Q8_0, fp8) split the
tile into its first and second H columns. Values are float32, exact: every format's value (a
product of a 16-bit scale, 6-bit sub-scale and at most 8-bit integer, minus such a product) has at
most 22 significant bits. fp8's per-channel scale is not applied here (the projection applies it
to each output's sum).

Invariants: BLOCK_K divides K and is a multiple of 2P (pick_block_k), and a tile starts at a
multiple of BLOCK_K, so the columns of every scale group (powers of two, 16 to 256) fall on whole
runs of a half's bytes: each scale plane is loaded once per (row, group) and broadcast over its
run; a tile reads only the planes' bytes of its rows and columns; no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fgchat.engine.intmath import cdiv
from fgchat.engine.kernels.launch import fast
from fgchat.engine.quant.qweight import QuantStack, QuantWeight

# format codes the kernels branch on (constexpr)
CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5, "fp8": 6, "int4": 7}
# the order each format's planes are passed in (pointer arguments p0..p5)
PLANES = {
    "Q8_0": ("qs", "d"), "Q4_0": ("qs", "d"), "Q4_1": ("qs", "d", "m"),
    "Q4_K": ("qs", "d", "dmin", "sc", "mn"), "Q5_K": ("qs", "d", "dmin", "sc", "mn", "qh"),
    "Q6_K": ("ql", "d", "sc", "qh"), "fp8": ("w", "scale"), "int4": ("qs", "scale"),
}
# nibble pair distance of the first plane (Q6_K: its ql plane, as llama.cpp's dequantize_row_q6_K
# reads it); byte formats have none
NIBBLE_PAIR = {"Q4_0": 16, "Q4_1": 16, "Q4_K": 32, "Q5_K": 32, "Q6_K": 64, "int4": 64}
TILE_WIDTHS = (512, 256, 128, 64, 32)


def pick_block_k(fmt: str, k: int, widest: int = 256) -> int:
    """The widest tile (at most `widest`) that divides k, holds whole nibble pairs and gives
    halves of at least 16 columns (tl.dot's least K). Shape and format only."""
    pair = NIBBLE_PAIR.get(fmt, 16)
    for bk in TILE_WIDTHS:
        if bk <= widest and k % bk == 0 and bk % (2 * pair) == 0:
            return bk
    raise ValueError(f"a {fmt} weight of K={k} has no tile width the kernels take")


def plane_args(w: QuantWeight) -> list[torch.Tensor | None]:
    """The six plane pointers of `w` in PLANES order (None past the format's planes)."""
    planes = [w.planes[name] for name in PLANES[w.fmt]]
    for p in planes:
        if not p.is_contiguous():
            raise ValueError(f"{w.fmt} planes must be contiguous")
    return planes + [None] * (6 - len(planes))


def is_quantized(w: object) -> bool:
    return isinstance(w, (QuantWeight, QuantStack))


@triton.jit
def _run_cols(k0, G: tl.constexpr, PAIR: tl.constexpr, H: tl.constexpr, HI: tl.constexpr):
    """The first column of each run of consecutive tile bytes t whose columns (the high half's if
    HI) share one group of G columns: int32 [H // TG]. A run is TG = G bytes when G <= PAIR, else
    G / 2 (a group spans G / (2 PAIR) pair runs; 2 PAIR divides G then), at most H."""
    TG: tl.constexpr = min(G if G <= PAIR else G // 2, H)
    t0 = tl.arange(0, H // TG) * TG
    return k0 + 2 * PAIR * (t0 // PAIR) + t0 % PAIR + HI * PAIR


@triton.jit
def _groups(p, rows, row_mask, stride: tl.constexpr, k0, G: tl.constexpr, PAIR: tl.constexpr,
            H: tl.constexpr, HI: tl.constexpr):
    """Plane p's entries (one per G columns) for a half's runs (_run_cols), each loaded once:
    float32 [R, H // TG]; _spread makes them [R, H] (or [R, 1])."""
    c = _run_cols(k0, G, PAIR, H, HI)
    return tl.load(p + rows * stride + (c // G)[None, :], mask=row_mask, other=0).to(tl.float32)


@triton.jit
def _spread(s, N: tl.constexpr):
    """Group values s [R, NG] repeated over N // NG consecutive entries each: [R, N] ([R, 1]
    when NG = 1, which broadcasts; s itself when NG = N)."""
    R: tl.constexpr = s.shape[0]
    NG: tl.constexpr = s.shape[1]
    if NG == 1 or NG == N:
        return s
    else:
        return tl.reshape(tl.broadcast_to(s[:, :, None], (R, NG, N // NG)), (R, N))


@triton.jit
def _high_bits(qh, k0, FMT: tl.constexpr, PAIR: tl.constexpr, H: tl.constexpr, HI: tl.constexpr):
    """The high bits of a half's 4-bit fields at bit 4, from qh = the fields' qh bytes times 16:
    Q5_K bit 2 * (c % 256 // 64) + c % 64 // 32 of the byte, Q6_K bits 2 * (c % 128 // 32) (two).
    The bit position is constant over 32 columns: computed per run of 32 (_run_cols), spread."""
    c = _run_cols(k0, 32, PAIR, H, HI)
    if FMT == 4:
        shift = _spread((2 * (c % 256 // 64) + c % 64 // 32)[None, :], H)
        return (qh >> shift) & 16
    else:
        shift = _spread((2 * (c % 128 // 32))[None, :], H)
        return (qh >> shift) & 48


@triton.jit
def _mantissa(n):
    """int32 n in [0, 2**23) as float32 2**23 + n, exactly (n in the mantissa bits): a subtract
    of an integral float then gives an exact small integer without an int-to-float conversion."""
    return (n | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _nibble_value(FMT: tl.constexpr, q, qh, HI: tl.constexpr, p1, p2, p3, p4, rows, row_mask, k0,
                  K: tl.constexpr, H: tl.constexpr, PAIR: tl.constexpr):
    """A half's weights (the high half's if HI) from their 4-bit fields q int32 [R, H] and, for
    Q5_K / Q6_K, the qh bytes of the same columns (int32 [R, H]): the docstring's formulas, each
    scale plane loaded once per group."""
    if FMT == 1:  # Q4_0
        d = _spread(_groups(p1, rows, row_mask, K // 32, k0, 32, PAIR, H, HI), H)
        w = d * (q - 8).to(tl.float32)
    elif FMT == 2:  # Q4_1
        d = _spread(_groups(p1, rows, row_mask, K // 32, k0, 32, PAIR, H, HI), H)
        m = _spread(_groups(p2, rows, row_mask, K // 32, k0, 32, PAIR, H, HI), H)
        w = d * q.to(tl.float32) + m
    elif FMT == 3 or FMT == 4:  # Q4_K, Q5_K
        sc = _groups(p3, rows, row_mask, K // 32, k0, 32, PAIR, H, HI)
        mn = _groups(p4, rows, row_mask, K // 32, k0, 32, PAIR, H, HI)
        scale = _spread(_spread(_groups(p1, rows, row_mask, K // 256, k0, 256, PAIR, H, HI), sc.shape[1]) * sc, H)
        low = _spread(_spread(_groups(p2, rows, row_mask, K // 256, k0, 256, PAIR, H, HI), mn.shape[1]) * mn, H)
        if FMT == 4:
            q = q | _high_bits(qh, k0, FMT, PAIR, H, HI)
        w = scale * q.to(tl.float32) - low
    elif FMT == 5:  # Q6_K
        q6 = q | _high_bits(qh, k0, FMT, PAIR, H, HI)
        sc = _groups(p2, rows, row_mask, K // 16, k0, 16, PAIR, H, HI)
        scale = _spread(_spread(_groups(p1, rows, row_mask, K // 256, k0, 256, PAIR, H, HI), sc.shape[1]) * sc, H)
        w = scale * (_mantissa(q6) - 8388640.0)
    else:  # int4
        d = _spread(_groups(p1, rows, row_mask, K // 128, k0, 128, PAIR, H, HI), H)
        w = d * (q - 8).to(tl.float32)
    return w


@triton.jit
def weight_tile(FMT: tl.constexpr, p0, p1, p2, p3, p4, p5, rows, row_mask, k0,
                K: tl.constexpr, H: tl.constexpr, PAIR: tl.constexpr):
    """Rows `rows` (int64 [R, 1], masked by row_mask [R, 1]) of the tile at column k0: (low
    half, high half) float32 [R, H] and their columns (int32 [H] each)."""
    t = tl.arange(0, H)
    if FMT == 0 or FMT == 6:  # Q8_0, fp8: bytes in column order
        c_lo = k0 + t
        c_hi = c_lo + H
        if FMT == 0:
            w_lo = tl.load(p0 + rows * K + c_lo[None, :], mask=row_mask, other=0).to(tl.float32)
            w_hi = tl.load(p0 + rows * K + c_hi[None, :], mask=row_mask, other=0).to(tl.float32)
            w_lo = w_lo * _spread(_groups(p1, rows, row_mask, K // 32, k0, 32, H, H, 0), H)
            w_hi = w_hi * _spread(_groups(p1, rows, row_mask, K // 32, k0, 32, H, H, 1), H)
        else:  # fp8 e4m3 read as its bytes (masked lanes 0), then reinterpreted
            b = p0.to(tl.pointer_type(tl.uint8))
            w_lo = tl.load(b + rows * K + c_lo[None, :], mask=row_mask, other=0)
            w_hi = tl.load(b + rows * K + c_hi[None, :], mask=row_mask, other=0)
            w_lo = w_lo.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            w_hi = w_hi.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        byte = tl.load(p0 + rows * (K // 2) + (k0 // 2 + t)[None, :], mask=row_mask, other=0).to(tl.int32)
        c_lo = k0 + 2 * PAIR * (t // PAIR) + t % PAIR
        c_hi = c_lo + PAIR
        # a column's qh byte is its pair partner's too (c_lo % 2P < P keeps both in one qh run)
        if FMT == 4:
            qh = tl.load(p5 + rows * (K // 8) + (32 * (c_lo // 256) + c_lo % 32)[None, :], mask=row_mask, other=0)
        elif FMT == 5:
            qh = tl.load(p3 + rows * (K // 4) + (64 * (c_lo // 256) + 32 * (c_lo % 256 // 128) + c_lo % 32)[None, :],
                         mask=row_mask, other=0)
        else:
            qh = byte
        qh = qh.to(tl.int32) << 4
        w_lo = _nibble_value(FMT, byte & 15, qh, 0, p1, p2, p3, p4, rows, row_mask, k0, K, H, PAIR)
        w_hi = _nibble_value(FMT, byte >> 4, qh, 1, p1, p2, p3, p4, rows, row_mask, k0, K, H, PAIR)
    return w_lo, w_hi, c_lo, c_hi


@triton.jit
def _rows_kernel(p0, p1, p2, p3, p4, p5, ids_ptr, out_ptr, R,
                 pos_ptr, slot_ptr, seq_lens_ptr, slots32_ptr,
                 FMT: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 PAIR: tl.constexpr, GATHER: tl.constexpr, STEP: tl.constexpr):
    """Program (r, kb): rows [r*BLOCK_R, +BLOCK_R) of the output, columns [kb*BLOCK_K, +BLOCK_K),
    dequantized and rounded to out's dtype. GATHER: output row i is weight row ids[i], else row i.
    STEP (GATHER): program (r, 0) also writes seq_lens = positions + 1 and slots32 = slots (int32)
    for its rows (the decode step's inputs, as fused.step_inputs)."""
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = offs < R
    if GATHER:
        rows = tl.load(ids_ptr + offs, mask=live, other=0).to(tl.int64)
    else:
        rows = offs.to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    H: tl.constexpr = BLOCK_K // 2
    w_lo, w_hi, c_lo, c_hi = weight_tile(FMT, p0, p1, p2, p3, p4, p5, rows[:, None], live[:, None], k0, K, H, PAIR)
    if FMT == 6:  # fp8: the row's scale
        s = tl.load(p1 + rows, mask=live, other=0.0).to(tl.float32)[:, None]
        w_lo = w_lo * s
        w_hi = w_hi * s
    out = out_ptr + offs.to(tl.int64)[:, None] * K
    tl.store(out + c_lo[None, :], w_lo.to(out_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(out + c_hi[None, :], w_hi.to(out_ptr.dtype.element_ty), mask=live[:, None])
    if STEP:
        if tl.program_id(1) == 0:
            tl.store(seq_lens_ptr + offs, (tl.load(pos_ptr + offs, mask=live) + 1).to(tl.int32), mask=live)
            tl.store(slots32_ptr + offs, tl.load(slot_ptr + offs, mask=live).to(tl.int32), mask=live)


def _write_rows(w: QuantWeight, ids: torch.Tensor | None, out: torch.Tensor,
                step: tuple[torch.Tensor, ...] | None = None) -> None:
    n, k = w.shape
    rows = out.shape[0]
    bk = pick_block_k(w.fmt, k, widest=512)
    block_r = 4 if ids is not None else 16
    pos, slots, seq_lens, slots32 = step if step is not None else (None, None, None, None)
    fast(_rows_kernel)[(cdiv(rows, block_r), k // bk)](
        *plane_args(w), ids, out, rows, pos, slots, seq_lens, slots32,
        FMT=CODES[w.fmt], K=k, BLOCK_R=block_r, BLOCK_K=bk, PAIR=NIBBLE_PAIR.get(w.fmt, 1),
        GATHER=ids is not None, STEP=step is not None, num_warps=4)


def dequantize_rows(w: QuantWeight, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows `ids` (int64 [R], on w's device) of w dequantized: [R, K] in `dtype` (default w.dtype),
    each value the exact float32 one rounded once (the embedding lookup of a quantized embedding)."""
    out = torch.empty((ids.shape[0], w.shape[1]), dtype=dtype or w.dtype, device=w.device)
    if ids.shape[0]:
        _write_rows(w, ids, out)
    return out


def dequantize(w: QuantWeight | QuantStack, dtype: torch.dtype | None = None) -> torch.Tensor:
    """All of w dequantized: [N, K] in `dtype` (default w.dtype), parts of a stack in order."""
    parts = w.parts if isinstance(w, QuantStack) else [w]
    out = torch.empty(w.shape, dtype=dtype or w.dtype, device=w.device)
    at = 0
    for p in parts:
        _write_rows(p, None, out[at:at + p.shape[0]])
        at += p.shape[0]
    return out


def step_inputs(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, embed: QuantWeight,
                seq_lens: torch.Tensor, slots32: torch.Tensor) -> torch.Tensor:
    """fused.step_inputs for a quantized embedding, in one launch: writes seq_lens (positions + 1)
    and slots32 in place and returns the dequantized embeddings h [B, H] in embed.dtype."""
    out = torch.empty((ids.shape[0], embed.shape[1]), dtype=embed.dtype, device=embed.device)
    _write_rows(embed, ids, out, (positions, slots, seq_lens, slots32))
    return out
