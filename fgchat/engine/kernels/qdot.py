"""Exact products of activation rows with a tile of quantized weights (Triton), for kernels.qgemv.

A tile is BLOCK_K consecutive weight columns k0 .. k0 + BLOCK_K of BLOCK_N rows. Its stored
integers q enter a tensor-core dot as they are (|q| <= 128 is exact in bf16 and fp16): one dot
per scale group gives that group's float32 sum of x * q per (activation row, weight row), which
is then scaled by the group's float32 scale and, where the format has mins, added to the min times
the group's float32 sum of x (a dot with ones: the sum lands in the accumulator's layout). So the weights are carried exactly and only float32 sums round
(sum_k x w = sum_groups (s * sum x q + m * sum x)); nothing is gathered per weight element:
scales and mins are loaded once per (row, group), x as contiguous runs.

Units (the order of the sum over a tile; each a static loop, so per tile and format fixed):
- nibble planes (Q4_0, Q4_1, Q4_K, Q5_K, int4; pair distance P): unit u holds the P bytes
  k0/2 + P*u .. +P of each row: low nibbles are columns c = k0 + 2P*u + j, high nibbles c + P.
  Q4_0 / Q4_1 (P 16, groups of 32) and int4 (P 64, groups of 128) scale both halves by one
  group's scale; Q4_K / Q5_K (P 32) the low half by sub-block c / 32, the high by the next.
- Q6_K (ql pairs 64 apart, groups of 16): per 128 columns c, four groups g of 16 ql bytes c/2 +
  16g: low nibbles columns c + 16g + j, high c + 64 + 16g + j, their two high bits from qh byte
  c/4 + 16(g % 2) + j at bits 2(g // 2) and 4 + 2(g // 2).
- Q8_0: groups of 32 columns; fp8: one dot per tile (its per-channel scale is the caller's).

Invariants: each activation row's sums depend only on that row (BLOCK_M fixed by the caller), so
a row's result is the same at every batch size; no host sync. Tile widths: BLOCK_K a multiple of
UNIT[fmt] that divides K. Q5_K tiles of whole blocks (BLOCK_K % 256 == 0, so k0 % 256 == 0) load
each block's high-bit bytes once and shift by a unit's place in its block known at compile time;
narrower tiles load them per unit and shift at run time.
"""

from __future__ import annotations

import triton
import triton.language as tl

# columns a tile width must be a multiple of: one unit (nibble formats, Q8_0; Q6_K its 128 columns
# of one qh run), the dot's least K of 16 twice over (fp8)
UNIT = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 64, "Q5_K": 64, "Q6_K": 128, "fp8": 32, "int4": 128}
# nibble pair distance of the kernels' first plane (int4's layout is ours: qweight.PAIR)
PAIR = {"Q4_0": 16, "Q4_1": 16, "Q4_K": 32, "Q5_K": 32, "Q6_K": 64, "int4": 64}


def tile_width(fmt: str, k: int, widest: int) -> int:
    """The widest tile (at most `widest`) that divides k and is whole units; ValueError if none."""
    for bk in (512, 256, 128, 64, 32):
        if bk <= widest and k % bk == 0 and bk % UNIT[fmt] == 0:
            return bk
    raise ValueError(f"a {fmt} weight of K={k} has no tile width the kernels take")


@triton.jit
def _x_run(x_ptr, offs_m, m_mask, c, W: tl.constexpr, K: tl.constexpr):
    """x[:, c .. c + W] as [BLOCK_M, W] (rows past M zero)."""
    j = tl.arange(0, W)
    return tl.load(x_ptr + offs_m[:, None] * K + (c + j)[None, :], mask=m_mask[:, None], other=0.0)


@triton.jit
def _w_run(p, rows, row_mask, stride: tl.constexpr, c, W: tl.constexpr):
    """Plane p's entries c .. c + W of each row, as [W, BLOCK_N] (the dot's right operand)."""
    j = tl.arange(0, W)
    return tl.load(p + rows[None, :] * stride + (c + j)[:, None], mask=row_mask[None, :], other=0)


@triton.jit
def _per_row(p, rows, row_mask, stride: tl.constexpr, idx):
    """Plane p's entry idx of each row as float32 [BLOCK_N]."""
    return tl.load(p + rows * stride + idx, mask=row_mask, other=0).to(tl.float32)


@triton.jit
def _bits_to(v, SRC: tl.constexpr, DST: tl.constexpr, MASK: tl.constexpr):
    """(v >> SRC << DST) & MASK in one shift and one and (MASK: the wanted bits at DST)."""
    if SRC < DST:
        out = (v << (DST - SRC)) & MASK
    elif SRC > DST:
        out = (v >> (SRC - DST)) & MASK
    else:
        out = v & MASK
    return out


@triton.jit
def _dot(x, q, PREC: tl.constexpr, acc=None, OFF: tl.constexpr = 0, SMALL: tl.constexpr = True):
    """x . (q - OFF) (+ acc), float32, q's integers as x's dtype (exact). SMALL: q holds unsigned
    values below 128, made bf16 (fp16) by setting them as the mantissa of 128 (1024) and taking
    128 + OFF (1024 + OFF) away: two integer ops and one subtraction, no integer-to-float
    conversion. Else (signed bytes, float32 x) q converts through float32."""
    if SMALL and x.dtype == tl.bfloat16:
        w = (q.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - (128.0 + OFF)
    elif SMALL and x.dtype == tl.float16:
        w = (q.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + OFF)
    else:
        w = (q.to(tl.float32) - OFF).to(x.dtype)
    return tl.dot(x, w, acc, input_precision=PREC)


@triton.jit
def _nibble_unit(FMT: tl.constexpr, acc, x_lo, x_hi, xs_lo, xs_hi, b, qh, p1, p2, p3, p4,
                 rows, row_mask, c, SUB: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr):
    """acc + this unit's sums for one row set: b uint8 [P, BLOCK_N] the unit's bytes, x_lo / x_hi
    x at its low / high columns (starting at c / c + P), xs_* their float32 row sums broadcast
    over the columns [BLOCK_M, BLOCK_N] (formats with mins), qh (Q5_K) the block's 32 high-bit bytes, SUB (Q5_K) the unit's place in its block (-1:
    known only at run time)."""
    lo = b & 15
    hi = b >> 4
    if FMT == 1 or FMT == 7:  # Q4_0 / int4: w = s * (q - 8), one scale for both halves
        G: tl.constexpr = 32 if FMT == 1 else 128
        s = _per_row(p1, rows, row_mask, K // G, c // G)
        part = _dot(x_lo, lo, PREC, OFF=8)
        part = _dot(x_hi, hi, PREC, part, OFF=8)
        acc += part * s[None, :]
    elif FMT == 2:  # Q4_1: w = d * q + m
        d = _per_row(p1, rows, row_mask, K // 32, c // 32)
        m = _per_row(p2, rows, row_mask, K // 32, c // 32)
        part = _dot(x_lo, lo, PREC)
        part = _dot(x_hi, hi, PREC, part)
        acc += part * d[None, :] + (xs_lo + xs_hi) * m[None, :]
    else:  # Q4_K / Q5_K: w = (d * sc) * q - (dmin * mn), sub-blocks c / 32 (low) and the next
        if FMT == 4:  # the fifth bits: sub-block j of a block at bit j of its qh bytes
            if SUB >= 0:
                lo = lo | _bits_to(qh, 2 * SUB, 4, 16)
                hi = hi | _bits_to(qh, 2 * SUB + 1, 4, 16)
            else:  # the unit's place in its block at run time
                j = (c % 256) // 32
                lo = lo | (((qh >> j) & 1) << 4)
                hi = hi | (((qh >> (j + 1)) & 1) << 4)
        d = _per_row(p1, rows, row_mask, K // 256, c // 256)
        dmin = _per_row(p2, rows, row_mask, K // 256, c // 256)
        sub = c // 32
        acc += _dot(x_lo, lo, PREC) * (d * _per_row(p3, rows, row_mask, K // 32, sub))[None, :] \
            - xs_lo * (dmin * _per_row(p4, rows, row_mask, K // 32, sub))[None, :]
        acc += _dot(x_hi, hi, PREC) * (d * _per_row(p3, rows, row_mask, K // 32, sub + 1))[None, :] \
            - xs_hi * (dmin * _per_row(p4, rows, row_mask, K // 32, sub + 1))[None, :]
    return acc


@triton.jit
def _nibble_tile(FMT: tl.constexpr, acc, acc_u, x_ptr, offs_m, m_mask, p0, p1, p2, p3, p4, p5,
                 rows, rows_u, row_mask, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr,
                 GLU: tl.constexpr, PREC: tl.constexpr):
    MINS: tl.constexpr = FMT == 2 or FMT == 3 or FMT == 4
    WHOLE: tl.constexpr = BLOCK_K % 256 == 0  # Q5_K: tiles of whole blocks
    qh = acc  # Q5_K: reloaded at each block's first unit
    qh_u = acc
    for u in tl.static_range(BLOCK_K // (2 * P)):
        c = k0 + 2 * P * u
        x_lo = _x_run(x_ptr, offs_m, m_mask, c, P, K)
        x_hi = _x_run(x_ptr, offs_m, m_mask, c + P, P, K)
        xs_lo = acc  # unused without mins
        xs_hi = acc
        if MINS:  # x's group sums, broadcast over the columns in the dot's own layout
            ones = tl.full((P, rows.shape[0]), 1.0, tl.float32).to(x_lo.dtype)
            xs_lo = tl.dot(x_lo, ones, input_precision=PREC)
            xs_hi = tl.dot(x_hi, ones, input_precision=PREC)
        if FMT == 4:
            if not WHOLE or (2 * P * u) % 256 == 0:
                qh = _w_run(p5, rows, row_mask, K // 8, (c // 256) * 32, 32)
                if GLU:
                    qh_u = _w_run(p5, rows_u, row_mask, K // 8, (c // 256) * 32, 32)
        b = _w_run(p0, rows, row_mask, K // 2, c // 2, P)
        acc = _nibble_unit(FMT, acc, x_lo, x_hi, xs_lo, xs_hi, b, qh, p1, p2, p3, p4, rows, row_mask,
                           c, u % 4 if WHOLE else -1, K, PREC)
        if GLU:
            b_u = _w_run(p0, rows_u, row_mask, K // 2, c // 2, P)
            acc_u = _nibble_unit(FMT, acc_u, x_lo, x_hi, xs_lo, xs_hi, b_u, qh_u, p1, p2, p3, p4, rows_u,
                                 row_mask, c, u % 4 if WHOLE else -1, K, PREC)
    return acc, acc_u


@triton.jit
def _q6_group(acc, x_lo, x_hi, ql, qh, p1, p2, rows, row_mask, c, g: tl.constexpr, K: tl.constexpr,
              PREC: tl.constexpr):
    """acc + group g of the 128 columns at c (Q6_K: w = (d * sc) * (q6 - 32)): ql [16, BLOCK_N]
    its low-bit bytes, qh [16, BLOCK_N] the high-bit bytes it shares with group g ^ 2."""
    lo = (ql & 15) | _bits_to(qh, 2 * (g // 2), 4, 48)
    hi = (ql >> 4) | _bits_to(qh, 4 + 2 * (g // 2), 4, 48)
    d = _per_row(p1, rows, row_mask, K // 256, c // 256)
    acc += _dot(x_lo, lo, PREC, OFF=32) * (d * _per_row(p2, rows, row_mask, K // 16, c // 16 + g))[None, :]
    acc += _dot(x_hi, hi, PREC, OFF=32) * (d * _per_row(p2, rows, row_mask, K // 16, c // 16 + 4 + g))[None, :]
    return acc


@triton.jit
def _q6_tile(acc, acc_u, x_ptr, offs_m, m_mask, p0, p1, p2, p3, rows, rows_u, row_mask, k0,
             K: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr, PREC: tl.constexpr):
    for u in tl.static_range(BLOCK_K // 128):
        c = k0 + 128 * u
        for g2 in tl.static_range(2):
            qh = _w_run(p3, rows, row_mask, K // 4, c // 4 + 16 * g2, 16)
            if GLU:
                qh_u = _w_run(p3, rows_u, row_mask, K // 4, c // 4 + 16 * g2, 16)
            for g4 in tl.static_range(2):  # group g2 + 2 g4: its high bits from the same qh bytes
                x_lo = _x_run(x_ptr, offs_m, m_mask, c + 16 * (g2 + 2 * g4), 16, K)
                x_hi = _x_run(x_ptr, offs_m, m_mask, c + 64 + 16 * (g2 + 2 * g4), 16, K)
                ql = _w_run(p0, rows, row_mask, K // 2, c // 2 + 16 * (g2 + 2 * g4), 16)
                acc = _q6_group(acc, x_lo, x_hi, ql, qh, p1, p2, rows, row_mask, c, g2 + 2 * g4, K, PREC)
                if GLU:
                    ql_u = _w_run(p0, rows_u, row_mask, K // 2, c // 2 + 16 * (g2 + 2 * g4), 16)
                    acc_u = _q6_group(acc_u, x_lo, x_hi, ql_u, qh_u, p1, p2, rows_u, row_mask, c, g2 + 2 * g4,
                                      K, PREC)
    return acc, acc_u


@triton.jit
def _byte_tile(FMT: tl.constexpr, acc, acc_u, x_ptr, offs_m, m_mask, p0, p1, rows, rows_u, row_mask, k0,
               K: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr, PREC: tl.constexpr):
    if FMT == 0:  # Q8_0: w = d * q, groups of 32
        for u in tl.static_range(BLOCK_K // 32):
            c = k0 + 32 * u
            x = _x_run(x_ptr, offs_m, m_mask, c, 32, K)
            q = _w_run(p0, rows, row_mask, K, c, 32)
            acc += _dot(x, q, PREC, SMALL=False) * _per_row(p1, rows, row_mask, K // 32, c // 32)[None, :]
            if GLU:
                q_u = _w_run(p0, rows_u, row_mask, K, c, 32)
                acc_u += _dot(x, q_u, PREC, SMALL=False) * _per_row(p1, rows_u, row_mask, K // 32,
                                                                    c // 32)[None, :]
    else:  # fp8 e4m3, read as its bytes (masked rows 0) and reinterpreted: exact in bf16 / fp16
        x = _x_run(x_ptr, offs_m, m_mask, k0, BLOCK_K, K)
        b = p0.to(tl.pointer_type(tl.uint8))
        w = _w_run(b, rows, row_mask, K, k0, BLOCK_K).to(tl.float8e4nv, bitcast=True)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PREC)
        if GLU:
            w_u = _w_run(b, rows_u, row_mask, K, k0, BLOCK_K).to(tl.float8e4nv, bitcast=True)
            acc_u = tl.dot(x, w_u.to(x.dtype), acc_u, input_precision=PREC)
    return acc, acc_u


@triton.jit
def tile_dot(FMT: tl.constexpr, acc, acc_u, x_ptr, offs_m, m_mask, p0, p1, p2, p3, p4, p5,
             rows, rows_u, row_mask, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr,
             GLU: tl.constexpr, PREC: tl.constexpr):
    """(acc + x . tile(rows)^T, acc_u + x . tile(rows_u)^T (GLU; else acc_u as given)) for the
    tile at column k0: acc [BLOCK_M, BLOCK_N] float32, rows / rows_u int64 [BLOCK_N] masked by
    row_mask, x_ptr the contiguous activations [M, K] (rows offs_m masked by m_mask). FMT the
    format code (qtiles.CODES), P its PAIR (nibble formats)."""
    if FMT == 0 or FMT == 6:
        acc, acc_u = _byte_tile(FMT, acc, acc_u, x_ptr, offs_m, m_mask, p0, p1, rows, rows_u, row_mask, k0,
                                K, BLOCK_K, GLU, PREC)
    elif FMT == 5:
        acc, acc_u = _q6_tile(acc, acc_u, x_ptr, offs_m, m_mask, p0, p1, p2, p3, rows, rows_u, row_mask, k0,
                              K, BLOCK_K, GLU, PREC)
    else:
        acc, acc_u = _nibble_tile(FMT, acc, acc_u, x_ptr, offs_m, m_mask, p0, p1, p2, p3, p4, p5, rows, rows_u,
                                  row_mask, k0, K, BLOCK_K, P, GLU, PREC)
    return acc, acc_u


@triton.jit
def prefetch_rows(p, rows, row_mask, stride: tl.constexpr, byte0, NBYTES: tl.constexpr):
    """Ask L2 for bytes byte0 .. byte0 + NBYTES of each row of the byte plane p (sm_90+ bulk
    prefetch; p, stride and byte0 16-byte aligned, NBYTES a multiple of 16). A hint: no result
    depends on it."""
    addr = (p.to(tl.pointer_type(tl.uint8)) + rows * stride + byte0).to(tl.int64, bitcast=True)
    live = row_mask.to(tl.int32)
    size = tl.full(rows.shape, NBYTES, tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, live], dtype=tl.int32, is_pure=False, pack=1)
