"""Fused Triton kernels for the decode step (CUDA only), each matching its torch composition.

Each kernel reproduces the rounding points of the torch code it replaces (bf16/fp16 results are
rounded where torch would round), so fused and unfused decoders agree to within an ulp, and every
mode of one engine runs the same kernels, so modes stay bit-identical to each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fgchat.engine.intmath import cdiv, next_pow2
from fgchat.engine.kernels.activation import gate_activation
from fgchat.engine.kernels.launch import fast
from fgchat.engine.kernels.pdl import pdl_enter
from fgchat.engine.kernels.sampling_triton import LIBDEVICE


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, h_out_ptr, y_ptr, n_cols, eps, stride_part, dw_ptr, in_scale,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
                         PARTS: tl.constexpr = 1, ONE_ROUND: tl.constexpr = False,
                         DELTA_NORM: tl.constexpr = False, SCALE_IN: tl.constexpr = False):
    """PARTS > 1: the delta is PARTS float32 partial sums (slabs stride_part apart) of a split-K
    projection, added in slab order and rounded to y's (the model's) dtype as the projection
    would round. h_out's dtype is the residual stream's (float32, or the model's).
    ONE_ROUND: y = x * rsqrt(mean(x^2) + eps) * w in float32, rounded once (Gemma's norm, w its
    float32 1 + weight); else the normed row is rounded before the weight's product (ops.rms_norm).
    DELTA_NORM (with ONE_ROUND): the delta, rounded to y's dtype, is first normed the same way by
    dw (Gemma's norm after a sublayer) and rounded again before it is added.
    SCALE_IN (no delta): x times in_scale, rounded to y's dtype, is the residual (Gemma's
    embedding scale), stored in h_out."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)  # weights: readable before the wait
    if DELTA_NORM:
        dw = tl.load(dw_ptr + cols, mask=m, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    x = tl.load(x_ptr + row * n_cols + cols, mask=m, other=0.0)
    if SCALE_IN:
        x = (x.to(tl.float32) * in_scale).to(y_ptr.dtype.element_ty).to(h_out_ptr.dtype.element_ty)
        tl.store(h_out_ptr + row * n_cols + cols, x, mask=m)
    if HAS_DELTA:
        if PARTS == 1:
            d = tl.load(d_ptr + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        else:
            d = tl.load(d_ptr + row * n_cols + cols, mask=m, other=0.0)
            for p in tl.static_range(1, PARTS):
                d += tl.load(d_ptr + p * stride_part + row * n_cols + cols, mask=m, other=0.0)
            d = d.to(y_ptr.dtype.element_ty).to(tl.float32)
        if DELTA_NORM:
            d_var = tl.sum(d * d, axis=0) / n_cols
            d = (d * (1.0 / tl.sqrt(d_var + eps)) * dw).to(y_ptr.dtype.element_ty).to(tl.float32)
        x = (x.to(tl.float32) + d).to(h_out_ptr.dtype.element_ty)
        tl.store(h_out_ptr + row * n_cols + cols, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    if ONE_ROUND:
        y = xf * (1.0 / tl.sqrt(var + eps)) * w
    else:
        y = w * (xf * (1.0 / tl.sqrt(var + eps))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float,
                 pdl: bool = False, residual_dtype: torch.dtype | None = None, *,
                 out_dtype: torch.dtype | None = None, one_round: bool = False,
                 delta_norm: torch.Tensor | None = None, in_scale: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (h + delta, rms_norm(h + delta) * w); with delta None, (h, rms_norm(h) * w).
    The sum is stored in `residual_dtype` (default h's; float32 keeps the residual stream's
    massive activation channels exact to float32, where bf16 steps by 128 at 2.5e4); the
    normalised output is in out_dtype (default w's: the model's). Statistics are float32 in any case.
    delta [S, rows, n] float32: partial sums of a split-K projection (gemv.project_partials).
    Gemma's norms (families.gemma_norm's rounding): one_round with w = 1 + weight in float32;
    delta_norm, the same form of weight, norms the delta before it is added (its post-sublayer
    norm); in_scale (delta None) multiplies h first, rounded to out_dtype (its embedding scale,
    a value of that dtype); the scaled rows are then the returned residual.
    pdl: launch with programmatic dependent launch (see engine.pdl), as for every kernel here."""
    rows, n = h.shape
    if (delta_norm is not None or in_scale is not None) and not one_round:
        raise ValueError("delta_norm and in_scale come with one_round (Gemma's norms)")
    if in_scale is not None and delta is not None:
        raise ValueError("in_scale scales the embedding rows: no delta")
    y = torch.empty((rows, n), dtype=out_dtype or w.dtype, device=h.device)
    stored = delta is not None or in_scale is not None
    h_out = torch.empty((rows, n), dtype=residual_dtype or h.dtype, device=h.device) if stored else h
    parts = delta.shape[0] if delta is not None and delta.dim() == 3 else 1
    if parts > 1 and (delta.shape[1:] != h.shape or delta.dtype != torch.float32 or not delta.is_contiguous()):
        raise ValueError("partial sums must be contiguous float32 [S, rows, n]")
    fast(_add_rms_norm_kernel)[(rows,)](h, delta if delta is not None else h, w, h_out, y, n, eps,
                                        rows * n if parts > 1 else 0,
                                        delta_norm if delta_norm is not None else w,
                                        1.0 if in_scale is None else in_scale,
                                        HAS_DELTA=delta is not None, BLOCK=next_pow2(n),
                                        USE_PDL=pdl, PARTS=parts, ONE_ROUND=one_round,
                                        DELTA_NORM=delta_norm is not None and delta is not None,
                                        SCALE_IN=in_scale is not None,
                                        num_warps=4 if n <= 4096 else 8, launch_pdl=pdl)
    return h_out, y


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
                     GELU: tl.constexpr = False, LIBDEVICE: tl.constexpr = True):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
    s = gate_activation(g, GELU, LIBDEVICE).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (s * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor, pdl: bool = False, gelu: bool = False) -> torch.Tensor:
    """gu: [N, 2I] rows gate | up -> silu(gate) * up, [N, I]; gelu: gelu_tanh(gate) * up
    (activation.gate_activation), each product rounded to gu's dtype as torch rounds it."""
    rows, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty((rows, inter), dtype=gu.dtype, device=gu.device)
    block = 1024
    fast(_silu_mul_kernel)[(rows, cdiv(inter, block))](gu, out, inter, BLOCK=block, USE_PDL=pdl, GELU=gelu,
                                                       LIBDEVICE=LIBDEVICE, num_warps=4, launch_pdl=pdl)
    return out


@triton.jit
def _lanes(ok, idx, n: tl.constexpr, P: tl.constexpr):
    """The [HB, P] mask of heads `ok` [HB] over lanes idx [P], the first n of them real (P == n:
    no lane mask, so the loads stay vectorised)."""
    if P == n:
        m = ok[:, None]
    else:
        m = ok[:, None] & (idx < n)[None, :]
    return m


@triton.jit
def _cols(ptr, idx, n: tl.constexpr, P: tl.constexpr):
    """The first n of P float32 values at ptr + idx, as a [1, P] row (0 past n)."""
    if P == n:
        v = tl.load(ptr + idx)
    else:
        v = tl.load(ptr + idx, mask=idx < n, other=0.0)
    return v.to(tl.float32)[None, :]


@triton.jit
def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                    n_q_heads, n_kv_heads, stride_slot, stride_pos, k_out_ptr, slot_step,
                    q_norm_ptr, k_norm_ptr, norm_eps, tab_ptr,
                    HEAD_DIM: tl.constexpr, HB: tl.constexpr, USE_PDL: tl.constexpr = False,
                    K_OUT: tl.constexpr = False, QK_NORM: tl.constexpr = False,
                    NORM_ONE_ROUND: tl.constexpr = False, ROT: tl.constexpr = 0, HALF_P: tl.constexpr = 0,
                    TAIL_P: tl.constexpr = 1, TABLE_ROWS: tl.constexpr = False):
    """Program (row, block of HB heads): heads [0, Hq) are q, [Hq, Hq+Hkv) are k (+ their v is
    copied). Elementwise per head, so the bits do not depend on HB.
    ROT (0: HEAD_DIM): the rotated dims of each head, pairs (i, i + ROT/2) for i < ROT/2 (HF's
    partial rotary); dims [ROT, HEAD_DIM) pass unchanged. HALF_P (0: ROT/2) and TAIL_P: powers of
    two covering ROT/2 and HEAD_DIM - ROT. The cos / sin tables are [rows, ROT].
    TABLE_ROWS: row r rotates by table row tab_ptr[r] (else by its position).
    K_OUT: the RoPE'd k rows also go to k_out [rows, Hkv, D] (prefill attends over them).
    QK_NORM: each q / k head row is RMS-normed by q_norm / k_norm [D] before RoPE (Qwen3), with
    ops.rms_norm's rounding points: float32 statistics, the normed row rounded to the model's
    dtype, then the weight's product rounded; NORM_ONE_ROUND: rounded once after the weight's
    product (Gemma 3, its weights float32 1 + w: families.gemma_norm).
    Row r's slot is at slot_ptr + r * slot_step (0: one slot for every row)."""
    rot: tl.constexpr = HEAD_DIM if ROT == 0 else ROT
    half: tl.constexpr = rot // 2
    hp: tl.constexpr = half if HALF_P == 0 else HALF_P
    tail: tl.constexpr = HEAD_DIM - rot
    idx = tl.arange(0, hp)
    tix = tl.arange(0, TAIL_P)
    if QK_NORM:  # weights: readable before the wait
        qn1, qn2 = _cols(q_norm_ptr, idx, half, hp), _cols(q_norm_ptr + half, idx, half, hp)
        kn1, kn2 = _cols(k_norm_ptr, idx, half, hp), _cols(k_norm_ptr + half, idx, half, hp)
        if tail > 0:
            qn3, kn3 = _cols(q_norm_ptr + rot, tix, tail, TAIL_P), _cols(k_norm_ptr + rot, tix, tail, TAIL_P)
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    width = (n_q_heads + 2 * n_kv_heads) * HEAD_DIM
    live = heads < n_q_heads + n_kv_heads
    is_q = heads < n_q_heads
    is_k = live & (heads >= n_q_heads)
    pos = tl.load(pos_ptr + row)
    if TABLE_ROWS:
        trow = tl.load(tab_ptr + row)
    else:
        trow = pos
    src = qkv_ptr + row * width + heads[:, None] * HEAD_DIM  # [HB, 1]: each head's first dim
    base = src + idx[None, :]
    x1 = tl.load(base, mask=_lanes(live, idx, half, hp), other=0.0)
    x2 = tl.load(base + half, mask=_lanes(live, idx, half, hp), other=0.0)
    c1, c2 = _cols(cos_ptr + trow * rot, idx, half, hp), _cols(cos_ptr + trow * rot + half, idx, half, hp)
    s1, s2 = _cols(sin_ptr + trow * rot, idx, half, hp), _cols(sin_ptr + trow * rot + half, idx, half, hp)
    ty = x1.dtype
    xf1, xf2 = x1.to(tl.float32), x2.to(tl.float32)
    if tail > 0:  # the dims that pass (normed with the rest where the model norms q / k)
        x3 = tl.load(src + rot + tix[None, :], mask=_lanes(live, tix, tail, TAIL_P), other=0.0)
    if QK_NORM:
        ss = tl.sum(xf1 * xf1, axis=1) + tl.sum(xf2 * xf2, axis=1)
        if tail > 0:
            xf3 = x3.to(tl.float32)
            ss += tl.sum(xf3 * xf3, axis=1)
        r = (1.0 / tl.sqrt(ss / HEAD_DIM + norm_eps))[:, None]
        w1 = tl.where(is_q[:, None], qn1, kn1)
        w2 = tl.where(is_q[:, None], qn2, kn2)
        if NORM_ONE_ROUND:
            xf1 = (xf1 * r * w1).to(ty).to(tl.float32)
            xf2 = (xf2 * r * w2).to(ty).to(tl.float32)
        else:
            xf1 = (w1 * (xf1 * r).to(ty).to(tl.float32)).to(ty).to(tl.float32)
            xf2 = (w2 * (xf2 * r).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        if tail > 0:
            w3 = tl.where(is_q[:, None], qn3, kn3)
            if NORM_ONE_ROUND:
                x3 = (xf3 * r * w3).to(ty)
            else:
                x3 = (w3 * (xf3 * r).to(ty).to(tl.float32)).to(ty)
    # torch: x * cos + rotate_half(x) * sin, rounding after each product and after the sum
    o1 = ((xf1 * c1).to(ty).to(tl.float32) + (-xf2 * s1).to(ty).to(tl.float32)).to(ty)
    o2 = ((xf2 * c2).to(ty).to(tl.float32) + (xf1 * s2).to(ty).to(tl.float32)).to(ty)
    qm = _lanes(is_q, idx, half, hp)
    qdst = q_out_ptr + (row * n_q_heads + heads)[:, None] * HEAD_DIM
    dst = qdst + idx[None, :]
    tl.store(dst, o1, mask=qm)
    tl.store(dst + half, o2, mask=qm)
    km = _lanes(is_k, idx, half, hp)
    kv_head = tl.where(is_k, heads - n_q_heads, 0)
    slot = tl.load(slot_ptr + row * slot_step).to(tl.int64)
    kvo = (slot * stride_slot + pos.to(tl.int64) * stride_pos + kv_head * HEAD_DIM)[:, None]
    off = kvo + idx[None, :]
    tl.store(k_cache_ptr + off, o1, mask=km)
    tl.store(k_cache_ptr + off + half, o2, mask=km)
    kdst = k_out_ptr + (row * n_kv_heads + kv_head)[:, None] * HEAD_DIM
    if K_OUT:
        tl.store(kdst + idx[None, :], o1, mask=km)
        tl.store(kdst + idx[None, :] + half, o2, mask=km)
    vsrc = qkv_ptr + row * width + (n_q_heads + n_kv_heads + kv_head)[:, None] * HEAD_DIM
    vbase = vsrc + idx[None, :]
    tl.store(v_cache_ptr + off, tl.load(vbase, mask=km, other=0.0), mask=km)
    tl.store(v_cache_ptr + off + half, tl.load(vbase + half, mask=km, other=0.0), mask=km)
    if tail > 0:  # dims [rot, HEAD_DIM): q and k as they came (or normed), v copied
        tq, tk = _lanes(is_q, tix, tail, TAIL_P), _lanes(is_k, tix, tail, TAIL_P)
        at = rot + tix[None, :]
        tl.store(qdst + at, x3, mask=tq)
        tl.store(k_cache_ptr + kvo + at, x3, mask=tk)
        if K_OUT:
            tl.store(kdst + at, x3, mask=tk)
        tl.store(v_cache_ptr + kvo + at, tl.load(vsrc + at, mask=tk, other=0.0), mask=tk)


# From this many rows (a prefill) a program takes every head of its row; below (decode) one head
# each, which spreads a few rows over more SMs.
ROPE_ROWS_PER_ROW_PROGRAM = 32


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  n_q_heads: int, n_kv_heads: int, head_dim: int, pdl: bool = False,
                  k_out: torch.Tensor | None = None, heads_per_program: int | None = None,
                  qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None, norm_eps: float = 0.0,
                  norm_one_round: bool = False, table_rows: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE on q and k of `qkv` [N, (Hq+2Hkv)*D]; k and v written to the cache at (slot, pos).

    Returns q [N, Hq, D]. Cache layout [slots, T, Hkv, D], contiguous. `slots` [N] may be an
    expanded view (stride 0: every row in one slot). k_out [N, Hkv, D] (contiguous), if given,
    receives the RoPE'd k rows as well. heads_per_program (a power of two) overrides the rule
    above; the bits are the same either way. qk_norm = (q weight, k weight), each [D] in the
    model's dtype: every q / k head is rms_norm(head, weight, norm_eps) before its RoPE (Qwen3);
    norm_one_round: weights 1 + w in float32 and families.gemma_norm's single rounding (Gemma 3).
    cos / sin [rows, rot] (contiguous): rot < D rotates the first rot dims of each head (Phi-3's
    partial rotary, families.apply_rope_part), the others pass. table_rows [N] (int64): the table
    row each row rotates by (LongRoPE's long rows); None: its position.
    """
    rows = qkv.shape[0]
    heads = n_q_heads + n_kv_heads
    hb = heads_per_program or (next_pow2(heads) if rows >= ROPE_ROWS_PER_ROW_PROGRAM else 1)
    q = torch.empty((rows, n_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    warps = max(1, min(8, hb * head_dim // 2 // 256))
    rot = cos.shape[-1]
    if rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"RoPE tables of {rot} columns do not fit heads of {head_dim}")
    half = rot // 2  # a power-of-two half of a whole head: the lanes need no mask (Llama's launch)
    part = {} if rot == head_dim and next_pow2(half) == half else \
        dict(ROT=rot, HALF_P=next_pow2(half), TAIL_P=next_pow2(max(1, head_dim - rot)))
    fast(_rope_kv_kernel)[(rows, cdiv(heads, hb))](
        qkv, cos, sin, positions, slots, q, k_cache, v_cache, n_q_heads, n_kv_heads,
        k_cache.stride(0), k_cache.stride(1), k_out if k_out is not None else q, slots.stride(0),
        *(qk_norm if qk_norm is not None else (qkv, qkv)), norm_eps,
        table_rows if table_rows is not None else positions,
        HEAD_DIM=head_dim, HB=hb, USE_PDL=pdl, K_OUT=k_out is not None, QK_NORM=qk_norm is not None,
        NORM_ONE_ROUND=norm_one_round, TABLE_ROWS=table_rows is not None, **part, num_warps=warps,
        launch_pdl=pdl,
    )
    return q


@triton.jit
def _step_inputs_kernel(ids_ptr, pos_ptr, slot_ptr, embed_ptr, h_ptr, len_ptr, slot32_ptr,
                        hidden: tl.constexpr, BLOCK: tl.constexpr):
    """Lane b: attention's int32 inputs (seq_len = position + 1, slot) and the token's embedding row."""
    b = tl.program_id(0)
    tok = tl.load(ids_ptr + b).to(tl.int64)
    tl.store(len_ptr + b, (tl.load(pos_ptr + b) + 1).to(tl.int32))
    tl.store(slot32_ptr + b, tl.load(slot_ptr + b).to(tl.int32))
    for c0 in range(0, hidden, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        m = cols < hidden
        tl.store(h_ptr + b * hidden + cols, tl.load(embed_ptr + tok * hidden + cols, mask=m), mask=m)


def step_inputs(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, embed: torch.Tensor,
                seq_lens: torch.Tensor, slots32: torch.Tensor) -> torch.Tensor:
    """One launch for the step's inputs: writes seq_lens (positions + 1) and slots32 (int32) in
    place and returns the embeddings h [B, H] of `ids` (int64 ids, positions, slots [B])."""
    b, hidden = ids.shape[0], embed.shape[1]
    h = torch.empty((b, hidden), dtype=embed.dtype, device=embed.device)
    fast(_step_inputs_kernel)[(b,)](ids, positions, slots, embed, h, seq_lens, slots32, hidden=hidden,
                                    BLOCK=min(4096, next_pow2(hidden)), num_warps=4)
    return h


@triton.jit
def _advance_kernel(tok_ptr, ids_ptr, pos_ptr, host_ptr, B, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < B
    tok = tl.load(tok_ptr + offs, mask=m)
    tl.store(ids_ptr + offs, tok, mask=m)
    tl.store(pos_ptr + offs, tl.load(pos_ptr + offs, mask=m) + 1, mask=m)
    tl.store(host_ptr + offs, tok, mask=m)


def advance(tokens: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, host_out: torch.Tensor) -> None:
    """After a decode step, in one launch: the next step's inputs (ids = tokens, positions + 1, in
    place) and the tokens written into `host_out`, pinned host memory the GPU writes directly (the
    host reads it after an event recorded behind this launch). All int64 [B]."""
    b = tokens.shape[0]
    fast(_advance_kernel)[(1,)](tokens, ids, positions, host_out, b, BLOCK=max(16, next_pow2(b)), num_warps=1)
