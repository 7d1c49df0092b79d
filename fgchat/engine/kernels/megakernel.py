"""The decoder layers of one decode step as one persistent Triton kernel (the `mega` mode).

One program per SM loops over the step's phases: the embedding, then per layer
  qkv    RMSNorm of the residual, the q/k/v projection, RoPE, k and v written to the cache;
  attn   split attention over the cache; the last split of a (row, kv head) to finish merges
         the splits (an atomic counter per pair picks it), so the merge needs no phase of its own;
  o      the o projection added to the residual;
  gateup RMSNorm, the gate/up projection and SiLU-and-multiply;
  down   the down projection added to the residual.
Between phases every program waits at a grid barrier (an atomic counter in global memory), so
the whole step is one launch where the fused path launches ~8 kernels per layer. The final norm,
the LM head and the pick stay the fused path's kernels.

Invariants:
- every program of a persistent launch must be resident at once (the barrier spins): the grid
  is one program per SM (PROGRAMS_PER_SM), or more only where the driver's occupancy count for
  the compiled kernel says that many fit (`DecodeLayers.run` checks before the first launch);
- a phase reads only what earlier phases wrote (after a barrier) and weights; data written
  inside the launch is read with `.cg` loads (L2, never a stale L1 line);
- each residual column is owned by one item of the o / down phases, which also store that
  column tile's sum of squares per row; the RMSNorm of a row sums those partial sums in item
  order, so results do not depend on timing: the persistent launch and the phase-by-phase
  launches (`persistent=False`, the interpreter's way) give the same bits;
- counters end every launch at zero (the barrier's last arrival and each merging split reset
  theirs), so a captured graph replays with no memset;
- in a projection phase program p takes items p, p + programs, ... as one flattened loop of a
  fixed count (items_per_program), its loads masked and its stores skipped past the last item;
- clock stamps (DecodeLayers.stamps, profiling only) write their own buffer and nothing else.
Roundings follow the fused path (projection outputs rounded to the model dtype, the residual
stream float32), but sums run in a different order, so tokens may differ from the other modes
at near ties: this mode is checked against float32, not bit for bit against the others.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fgchat.engine import cuda_driver
from fgchat.engine.intmath import cdiv, next_pow2

PHASES_PER_LAYER = 5
PHASES = tl.constexpr(PHASES_PER_LAYER)
MAX_ROWS = 8
ROWS_PAD = 16  # activation rows padded to the MMA's minimum
GROUP_PAD = 16  # q heads of one kv group, padded likewise
XM = tl.constexpr(ROWS_PAD)
GB = tl.constexpr(GROUP_PAD)
BT = tl.constexpr(64)  # attention positions per block
MAX_SPLITS = 16
MS = tl.constexpr(MAX_SPLITS)
# per program: warps, stages of the projections' weight pipeline, the largest K tile of the
# norm-fed projections (qkv, gate/up) and of o and down (the H200 sweeps:
# design.md V39, V43)
NUM_WARPS, NUM_STAGES, MAX_K_TILE, MAX_K_TILE_OUT = 4, 4, 256, 512
# Settings the sweep turns on (docs/design.md V46-V48); with
# all off the kernel is the one the GPU tests and the real weights cover. The norm-fed phases
# normalise only rows [0, next_pow2(B)) of their activation tile (None: where `norm_rows_only`
# says so); o and down load only those rows of x; the grid barrier sleeps this many ns between
# polls of its counter (0: none).
NORM_BATCH_ROWS_ONLY: bool | None = False
OUT_BATCH_ROWS_ONLY = False
# The H200 sweep (design.md V46) timed the batch-rows-only norm at Llama-3.2-1B (hidden 2048) batch 1 at
# 1.211 ms a step against 1.391, slower at batch 8 and on SmolLM2 (hidden 576); the GPU tests then
# found that launch wrong at 1B batch 1, so the rule below is not the default.
NORM_ROWS_MIN_HIDDEN = 2048
BARRIER_SLEEP_NS = 0
# persistent programs per SM (the sweep's +ppsN, design.md V53): more warps per scheduler to hide
# each program's load latency, if the kernel's registers and shared memory let them be resident
PROGRAMS_PER_SM = 1
# columns of the per-layer weight-offset table (DecodeLayers writes each row in this order)
W_QKV, W_O, W_GU, W_DOWN, W_N1, W_N2 = (tl.constexpr(i) for i in range(6))
W_COLS = tl.constexpr(6)
WEIGHT_ALIGN = 16  # elements: the largest weight-offset alignment the kernel is told of


def norm_rows_only(b: int, hidden: int) -> bool:
    """The per-shape default of NORM_BATCH_ROWS_ONLY: one row, a hidden size of 1B's or more."""
    return b == 1 and hidden >= NORM_ROWS_MIN_HIDDEN


@triton.jit
def _grid_barrier(bar_ptr, target, SYNC: tl.constexpr, SLEEP_NS: tl.constexpr = 0):
    """Every program arrives, then waits until `target` arrivals in all (targets grow by the
    grid size per barrier, so the counter is never reset inside a launch). SLEEP_NS > 0: each
    poll of the counter is followed by a nanosleep of about that long (fewer L2 requests from the
    waiting programs while others still stream weights; a later wake-up)."""
    if SYNC:
        tl.debug_barrier()
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        cur = tl.load(bar_ptr, volatile=True)
        while cur < target:
            if SLEEP_NS > 0:
                ns = tl.full((), SLEEP_NS, tl.int32)
                cur += tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [ns],
                                                 dtype=tl.int32, is_pure=False, pack=1)
            cur = tl.load(bar_ptr, volatile=True)
        tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


@triton.jit
def _w_offset(woff, col, WA: tl.constexpr):
    """A weight's offset from the table, a multiple of WA elements (DecodeLayers finds WA), which
    lets the weight loads vectorize and pipeline: an offset of unknown alignment makes every
    weight load a 2-byte load."""
    return tl.multiple_of(tl.load(woff + col), WA)


@triton.jit
def _stamp(stamp_ptr, slot, which: tl.constexpr):
    """This program's SM clock and the global nanosecond timer into stamp_ptr[slot, which, :]."""
    clk = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(stamp_ptr + slot * 4 + which * 2, clk)
    tl.store(stamp_ptr + slot * 4 + which * 2 + 1, ns)


@triton.jit
def _inv_rms(stats_ptr, n_parts, H, eps, NP: tl.constexpr, MP: tl.constexpr):
    """1 / rms of rows [0, MP) from the o / down phases' per-item sums of squares."""
    p = tl.arange(0, NP)
    rows = tl.arange(0, MP)
    s = tl.load(stats_ptr + p[:, None] * XM + rows[None, :], mask=p[:, None] < n_parts, other=0.0,
                cache_modifier=".cg")
    return 1.0 / tl.sqrt(tl.sum(s, axis=0) / H + eps)


@triton.jit
def _repeat_rows(xs, MP: tl.constexpr):
    """[MP, BK] rows repeated to the MMA's [XM, BK] (row r holds row r % MP); MP == XM: as is."""
    if MP == XM:
        return xs
    BK: tl.constexpr = xs.shape[1]
    return tl.reshape(tl.broadcast_to(xs[None, :, :], (XM // MP, MP, BK)), (XM, BK))


@triton.jit
def _normed_x(h_ptr, nw_ptr, inv, M, offs_k, H: tl.constexpr, DT: tl.constexpr, MP: tl.constexpr):
    """x tile [XM, BK] of rms_norm(h) * w, rounded as fused.add_rms_norm rounds, computed for
    rows [0, MP) (MP >= the batch M, a power of two; rows [M, MP) are zero) and, for MP < XM,
    repeated to XM rows for the MMA: a repeated row only reaches output rows past the batch,
    which every caller masks (each output row of a product depends on its own input row alone).
    At batch 1, MP 1 is 1/16 of the arithmetic of the whole padded tile."""
    rows = tl.arange(0, MP)
    hv = tl.load(h_ptr + rows[:, None] * H + offs_k[None, :], mask=(rows < M)[:, None], other=0.0,
                 cache_modifier=".cg")
    y = (hv * inv[:, None]).to(DT).to(tl.float32)
    w = tl.load(nw_ptr + offs_k).to(tl.float32)
    return _repeat_rows((w[None, :] * y).to(DT), MP)


@triton.jit
def _residual_add(acc, h_ptr, stats_ptr, item, cols, m_mask, H: tl.constexpr, DT: tl.constexpr):
    """h[:, cols] += acc rounded to the model dtype (h float32); this tile's sums of squares to stats[item]."""
    rows = tl.arange(0, XM)
    ptr = h_ptr + rows[:, None] * H + cols[None, :]
    hn = tl.load(ptr, mask=m_mask[:, None], other=0.0, cache_modifier=".cg") + acc.to(DT).to(tl.float32)
    tl.store(ptr, hn, mask=m_mask[:, None])
    tl.store(stats_ptr + item * XM + rows, tl.sum(hn * hn, axis=1))


@triton.jit
def _project_add(x_ptr, w_ptr, h_ptr, stats_ptr, pid, nprog, M, K: tl.constexpr, BK: tl.constexpr,
                 ITEMS: tl.constexpr, H: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr,
                 PREC: tl.constexpr, MPO: tl.constexpr):
    """The o and down phases: x [M, K] (written earlier in the launch) times w [H, K]^T, added to
    the residual by items of BN columns, program pid's items as one flattened loop. MPO < XM:
    x tiles are loaded for rows [0, MPO) only and repeated to XM rows (as `_normed_x` does): the
    repeated rows reach only output rows past the batch, whose residual stores are masked and
    whose sums of squares feed only those rows' norms."""
    rows = tl.arange(0, XM)
    m_mask = rows < M
    xr = tl.arange(0, MPO)
    for it in tl.range(0, ITEMS, flatten=True):
        item = pid + it * nprog
        live = item < tl.cdiv(H, BN)
        cols = item * BN + tl.arange(0, BN)
        acc = tl.zeros((XM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            x = _repeat_rows(tl.load(x_ptr + xr[:, None] * K + offs_k[None, :], mask=(xr < M)[:, None],
                                     other=0.0, cache_modifier=".cg"), MPO)
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + offs_k[None, :], mask=live)
            acc += tl.dot(x, tl.trans(w), input_precision=PREC)
        if live:
            _residual_add(acc, h_ptr, stats_ptr, item, cols, m_mask, H, DT)


@triton.jit
def _decode_layers_kernel(
    ids_ptr, pos_ptr, slot_ptr, embed_ptr, wbase_ptr, woff_ptr, cos_ptr, sin_ptr, cache_ptr,
    h_ptr, stats_ptr, q_ptr, part_ptr, ml_ptr, cnt_ptr, attn_ptr, act_ptr, bar_ptr, stamp_ptr,
    M, eps, scale, phase_lo, phase_hi, n_layers, n_splits,
    stride_layer, stride_slot, stride_pos,
    H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
    BN: tl.constexpr, BNI: tl.constexpr, PB: tl.constexpr,
    BKH: tl.constexpr, BKQ: tl.constexpr, BKI: tl.constexpr, NP: tl.constexpr,
    PREC: tl.constexpr, SYNC: tl.constexpr, WA: tl.constexpr,
    IQ: tl.constexpr, IC: tl.constexpr, IG: tl.constexpr, STAMP: tl.constexpr, MP: tl.constexpr,
    MPO: tl.constexpr, SLEEP_NS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    DT: tl.constexpr = embed_ptr.dtype.element_ty
    G: tl.constexpr = HQ // HKV
    HALF: tl.constexpr = D // 2
    chunks: tl.constexpr = HALF // PB
    rows = tl.arange(0, XM)
    m_mask = rows < M
    n_col_items = tl.cdiv(H, BN)
    zero = pid * 0  # loop-carried counters start as tensors (an argument of 1 is a constexpr)
    n_barrier = zero
    phase = phase_lo + zero
    while phase < phase_hi:
        if STAMP:  # [phase - phase_lo, program]: start, after the barrier that opened the phase
            _stamp(stamp_ptr, (phase - phase_lo) * nprog + pid, 0)
        if phase == 0:
            # the embedding rows into the float32 residual, with their sums of squares
            tok = tl.load(ids_ptr + rows, mask=m_mask, other=0).to(tl.int64)
            item = pid
            while item < n_col_items:
                cols = item * BN + tl.arange(0, BN)
                e = tl.load(embed_ptr + tok[:, None] * H + cols[None, :], mask=m_mask[:, None], other=0.0)
                e = e.to(tl.float32)
                tl.store(h_ptr + rows[:, None] * H + cols[None, :], e, mask=m_mask[:, None])
                tl.store(stats_ptr + item * XM + rows, tl.sum(e * e, axis=1))
                item += nprog
        else:
            layer = (phase - 1) // PHASES
            step = (phase - 1) % PHASES
            woff = woff_ptr + layer * W_COLS
            if step == 0:
                # qkv: an item is PB rotary pairs (columns c and c + D/2) of one q, k or v head
                w_ptr = wbase_ptr + _w_offset(woff, W_QKV, WA)
                nw_ptr = wbase_ptr + _w_offset(woff, W_N1, WA)
                inv = _inv_rms(stats_ptr, n_col_items, H, eps, NP, MP)
                pos = tl.load(pos_ptr + rows, mask=m_mask, other=0)
                slot = tl.load(slot_ptr + rows, mask=m_mask, other=0)
                for it in tl.range(0, IQ, flatten=True):
                    item = pid + it * nprog
                    live = item < (HQ + 2 * HKV) * chunks
                    head = item // chunks
                    c = (item % chunks) * PB + tl.arange(0, PB)
                    r1 = (head * D + c).to(tl.int64)
                    acc1 = tl.zeros((XM, PB), dtype=tl.float32)
                    acc2 = tl.zeros((XM, PB), dtype=tl.float32)
                    for k0 in range(0, H, BKH):
                        offs_k = k0 + tl.arange(0, BKH)
                        x = _normed_x(h_ptr, nw_ptr, inv, M, offs_k, H, DT, MP)
                        w1 = tl.load(w_ptr + r1[:, None] * H + offs_k[None, :], mask=live)
                        w2 = tl.load(w_ptr + (r1 + HALF)[:, None] * H + offs_k[None, :], mask=live)
                        acc1 += tl.dot(x, tl.trans(w1), input_precision=PREC)
                        acc2 += tl.dot(x, tl.trans(w2), input_precision=PREC)
                    y1 = acc1.to(DT).to(tl.float32)
                    y2 = acc2.to(DT).to(tl.float32)
                    if head < HQ + HKV:  # RoPE, rounded as fused.rope_kv_write
                        trig = pos[:, None] * D + c[None, :]
                        c1 = tl.load(cos_ptr + trig, mask=m_mask[:, None], other=0.0).to(tl.float32)
                        c2 = tl.load(cos_ptr + trig + HALF, mask=m_mask[:, None], other=0.0).to(tl.float32)
                        s1 = tl.load(sin_ptr + trig, mask=m_mask[:, None], other=0.0).to(tl.float32)
                        s2 = tl.load(sin_ptr + trig + HALF, mask=m_mask[:, None], other=0.0).to(tl.float32)
                        o1 = ((y1 * c1).to(DT).to(tl.float32) + (-y2 * s1).to(DT).to(tl.float32)).to(DT)
                        o2 = ((y2 * c2).to(DT).to(tl.float32) + (y1 * s2).to(DT).to(tl.float32)).to(DT)
                    else:
                        o1 = y1.to(DT)
                        o2 = y2.to(DT)
                    if head < HQ:
                        dst = q_ptr + (rows[:, None] * HQ + head) * D + c[None, :]
                    else:
                        kv = head - HQ
                        which = kv // HKV  # 0: k, 1: v
                        dst = (cache_ptr + (layer + which * n_layers) * stride_layer
                               + slot[:, None] * stride_slot + pos[:, None] * stride_pos
                               + (kv % HKV) * D + c[None, :])
                    tl.store(dst, o1, mask=m_mask[:, None] & live)
                    tl.store(dst + HALF, o2, mask=m_mask[:, None] & live)
            elif step == 1:
                # attention: an item is (row, kv head, split); partial results, then the merge
                k_base = cache_ptr + layer * stride_layer
                v_base = cache_ptr + (layer + n_layers) * stride_layer
                g_rows = tl.arange(0, GB)
                dims = tl.arange(0, D)
                item = pid
                while item < M * HKV * n_splits:
                    row = item // (HKV * n_splits)
                    g = (item // n_splits) % HKV
                    sp = item % n_splits
                    length = tl.load(pos_ptr + row) + 1
                    slot = tl.load(slot_ptr + row)
                    chunk = tl.cdiv(tl.cdiv(length, n_splits), BT) * BT
                    start = sp * chunk
                    end = tl.minimum(length, start + chunk)
                    q = tl.load(q_ptr + (row * HQ + g * G + g_rows)[:, None] * D + dims[None, :],
                                mask=(g_rows < G)[:, None], other=0.0, cache_modifier=".cg")
                    m_i = tl.full((GB,), float("-inf"), tl.float32)
                    l_i = tl.zeros((GB,), dtype=tl.float32)
                    acc = tl.zeros((GB, D), dtype=tl.float32)
                    kv_off = slot * stride_slot + g * D
                    t0 = start
                    while t0 < end:
                        t = t0 + tl.arange(0, BT)
                        tm = t < end
                        off = kv_off + t.to(tl.int64)[:, None] * stride_pos + dims[None, :]
                        k = tl.load(k_base + off, mask=tm[:, None], other=0.0, cache_modifier=".cg")
                        v = tl.load(v_base + off, mask=tm[:, None], other=0.0, cache_modifier=".cg")
                        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
                        s = tl.where(tm[None, :], s, float("-inf"))
                        m_new = tl.maximum(m_i, tl.max(s, axis=1))
                        p = tl.exp(s - m_new[:, None])
                        alpha = tl.exp(m_i - m_new)
                        l_i = l_i * alpha + tl.sum(p, axis=1)
                        acc = acc * alpha[:, None] + tl.dot(p.to(DT), v, input_precision=PREC)
                        m_i = m_new
                        t0 += BT
                    pair = row * HKV + g
                    slab = pair * n_splits + sp
                    tl.store(part_ptr + (slab * GB + g_rows)[:, None] * D + dims[None, :], acc)
                    tl.store(ml_ptr + (slab * GB + g_rows) * 2, m_i)
                    tl.store(ml_ptr + (slab * GB + g_rows) * 2 + 1, l_i)
                    tl.debug_barrier()
                    done = tl.atomic_add(cnt_ptr + pair, 1, sem="acq_rel", scope="gpu")
                    if done == n_splits - 1:  # the last split of this pair merges them all, in split order
                        first = pair * n_splits
                        # every split's (max, sum) in one load; the partial outputs' loads are
                        # independent (unrolled), so they are in flight together
                        js = tl.arange(0, MS)
                        ml = ml_ptr + ((first + js)[:, None] * GB + g_rows[None, :]) * 2
                        live_j = (js < n_splits)[:, None]
                        mj = tl.load(ml, mask=live_j, other=float("-inf"), cache_modifier=".cg")
                        lj = tl.load(ml + 1, mask=live_j, other=0.0, cache_modifier=".cg")
                        m_all = tl.max(mj, axis=0)
                        wj = tl.where(mj == float("-inf"), 0.0, tl.exp(mj - m_all[None, :]))
                        den = tl.sum(wj * lj, axis=0)
                        num = tl.zeros((GB, D), dtype=tl.float32)
                        for j in tl.static_range(MS):
                            aj = tl.load(part_ptr + ((first + j) * GB + g_rows)[:, None] * D + dims[None, :],
                                         mask=j < n_splits, other=0.0, cache_modifier=".cg")
                            num += tl.sum(tl.where(js[:, None] == j, wj, 0.0), axis=0)[:, None] * aj
                        out = (num / den[:, None]).to(DT)
                        dst = attn_ptr + (row * HQ + g * G + g_rows)[:, None] * D + dims[None, :]
                        tl.store(dst, out, mask=(g_rows < G)[:, None])
                        tl.atomic_xchg(cnt_ptr + pair, 0)
                    item += nprog
            elif step == 2:
                # o projection, added to the residual
                _project_add(attn_ptr, wbase_ptr + _w_offset(woff, W_O, WA), h_ptr, stats_ptr, pid, nprog, M,
                             HQ * D, BKQ, IC, H, BN, DT, PREC, MPO)
            elif step == 3:
                # gate/up with SiLU-and-multiply, rounded as gemv.project_glu
                w_ptr = wbase_ptr + _w_offset(woff, W_GU, WA)
                nw_ptr = wbase_ptr + _w_offset(woff, W_N2, WA)
                inv = _inv_rms(stats_ptr, n_col_items, H, eps, NP, MP)
                for it in tl.range(0, IG, flatten=True):
                    item = pid + it * nprog
                    live = item < tl.cdiv(INTER, BNI)
                    cols = item * BNI + tl.arange(0, BNI)
                    acc_g = tl.zeros((XM, BNI), dtype=tl.float32)
                    acc_u = tl.zeros((XM, BNI), dtype=tl.float32)
                    for k0 in range(0, H, BKH):
                        offs_k = k0 + tl.arange(0, BKH)
                        x = _normed_x(h_ptr, nw_ptr, inv, M, offs_k, H, DT, MP)
                        wg = tl.load(w_ptr + cols.to(tl.int64)[:, None] * H + offs_k[None, :], mask=live)
                        wu = tl.load(w_ptr + (cols + INTER).to(tl.int64)[:, None] * H + offs_k[None, :], mask=live)
                        acc_g += tl.dot(x, tl.trans(wg), input_precision=PREC)
                        acc_u += tl.dot(x, tl.trans(wu), input_precision=PREC)
                    gv = acc_g.to(DT).to(tl.float32)
                    uv = acc_u.to(DT).to(tl.float32)
                    sv = (gv / (1.0 + tl.exp(-gv))).to(DT).to(tl.float32)
                    tl.store(act_ptr + rows[:, None] * INTER + cols[None, :], (sv * uv).to(DT),
                             mask=m_mask[:, None] & live)
            else:
                # down projection, added to the residual
                _project_add(act_ptr, wbase_ptr + _w_offset(woff, W_DOWN, WA), h_ptr, stats_ptr, pid, nprog, M,
                             INTER, BKI, IC, H, BN, DT, PREC, MPO)
        if STAMP:  # end, before this program arrives at the next barrier
            _stamp(stamp_ptr, (phase - phase_lo) * nprog + pid, 1)
        if phase + 1 < phase_hi:
            n_barrier += 1
            _grid_barrier(bar_ptr, n_barrier * nprog, SYNC, SLEEP_NS)
        phase += 1
    if SYNC:  # the last to arrive resets the barrier for the next launch
        tl.debug_barrier()
        arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == (n_barrier + 1) * nprog - 1:
            tl.atomic_xchg(bar_ptr, 0)


def max_resident_per_sm(function: int, threads: int, shared: int, library: str = cuda_driver.LIBRARY) -> int:
    """The driver's count of blocks of a loaded kernel (`function`, a CUfunction) that fit one SM
    at once with `threads` threads and `shared` bytes of dynamic shared memory; 0 if unknown."""
    lib = cuda_driver.open_driver(library)
    if lib is None:
        return 0
    n = ctypes.c_int(0)
    rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(function),
                                                         ctypes.c_int(threads), ctypes.c_size_t(shared))
    return n.value if rc == 0 else 0


@dataclass(frozen=True)
class Tiles:
    bn: int  # residual columns per o / down item
    bni: int  # intermediate columns per gate/up item
    pb: int  # rotary pairs per qkv item
    bkh: int  # K tile over the hidden size
    bkq: int  # K tile over the attention output
    bki: int  # K tile over the intermediate size


def _k_tile(k: int, max_k: int) -> int:
    for t in (1024, 512, 256, 128, 64, 32, 16):
        if t <= max_k and k % t == 0:
            return t
    raise ValueError(f"the mega kernel needs dimensions divisible by 16, got {k}")


def pick_tiles(hidden: int, q_width: int, inter: int, head_dim: int, programs: int,
               max_k: int = MAX_K_TILE, max_k_out: int = MAX_K_TILE_OUT, bni: int = 16) -> Tiles:
    """Shape-only tiles: column tiles of 16 (32 where the hidden size gives over 2 tiles per
    program), gate/up items of bni columns (a power of two dividing the intermediate size), K
    tiles of max_k (qkv, gate/up) and max_k_out (o, down) where the size allows."""
    if bni < 16 or bni & (bni - 1) or inter % bni:
        raise ValueError(f"gate/up items of {bni} columns do not tile {inter}")
    bn = 32 if hidden // 16 > 2 * programs else 16
    pb = 16 if head_dim // 2 >= 16 else head_dim // 2
    return Tiles(bn, bni, pb, _k_tile(hidden, max_k), _k_tile(q_width, max_k_out),
                 _k_tile(inter, max_k_out))


def items_per_program(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, t: Tiles,
                      programs: int) -> dict[str, int]:
    """The most items one program takes in the qkv (IQ), o / down (IC) and gate/up (IG) phases:
    each program's items run as one flattened, pipelined loop of that many (masked past the end)."""
    qkv = (heads + 2 * kv_heads) * (head_dim // 2 // t.pb)
    return dict(IQ=cdiv(qkv, programs), IC=cdiv(cdiv(hidden, t.bn), programs), IG=cdiv(cdiv(inter, t.bni), programs))


class DecodeLayers:
    """Scratch buffers and launches of the mega kernel for one decoder and KV cache."""

    def __init__(self, dec, cache, programs: int | None = None) -> None:
        cfg, w = dec.cfg, dec.w
        lw0 = w.layers[0]
        dense = [w.embed, w.lm_head] + [t for lw in w.layers for t in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
        if not all(isinstance(t, torch.Tensor) for t in dense):
            raise ValueError("the mega kernel reads bf16 / fp16 weights, not quantized ones (full mode runs them)")
        if any(lw.bqkv is not None for lw in w.layers):
            raise ValueError("the mega kernel has no q/k/v bias")
        if cfg.qk_norm:
            raise ValueError("the mega kernel has no q/k norm (Qwen3, Gemma 3: full mode runs it)")
        if (cfg.rotary_dim or cfg.head_dim) != cfg.head_dim:
            raise ValueError("the mega kernel rotates whole heads, not partial RoPE (Phi-3: full mode runs it)")
        if cfg.head_dim % 16 or cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > GROUP_PAD:
            raise ValueError("the mega kernel needs head_dim % 16 == 0 and at most 16 q heads per kv head")
        if dec.residual_dtype != torch.float32:
            raise ValueError("the mega kernel keeps the residual stream in float32 (the fused decoder's)")
        self.dec, self.cache = dec, cache
        dev = lw0.wqkv.device
        self.device = dev
        self.sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        f32, dt = torch.float32, w.embed.dtype
        self.stats: torch.Tensor | None = None  # set_programs allocates it
        self.set_programs(self.sm_count * PROGRAMS_PER_SM if programs is None else programs)
        base = w.embed
        elem = base.element_size()

        def off(t: torch.Tensor) -> int:
            if t.dtype != base.dtype or not t.is_contiguous():
                raise ValueError("the mega kernel needs contiguous weights of one dtype")
            delta = t.data_ptr() - base.data_ptr()
            if delta % elem:
                raise ValueError("weights are not aligned to their element size")
            return delta // elem

        table = [[off(lw.wqkv), off(lw.wo), off(lw.w_gate_up), off(lw.w_down), off(lw.attn_norm), off(lw.mlp_norm)]
                 for lw in w.layers]
        self.woff = torch.tensor(table, dtype=torch.int64, device=dev)
        self.align = WEIGHT_ALIGN  # CUDA's allocator gives 512-byte blocks: 16 on the GPU
        while any(o % self.align for row in table for o in row):
            self.align //= 2
        self.h = torch.zeros((ROWS_PAD, cfg.hidden_size), dtype=f32, device=dev)
        self.q = torch.zeros((ROWS_PAD, hq, d), dtype=dt, device=dev)
        self.part = torch.zeros((MAX_ROWS * hkv * MAX_SPLITS, GROUP_PAD, d), dtype=f32, device=dev)
        self.ml = torch.zeros((MAX_ROWS * hkv * MAX_SPLITS, GROUP_PAD, 2), dtype=f32, device=dev)
        self.cnt = torch.zeros(MAX_ROWS * hkv, dtype=torch.int32, device=dev)
        self.attn = torch.zeros((ROWS_PAD, hq * d), dtype=dt, device=dev)
        self.act = torch.zeros((ROWS_PAD, cfg.intermediate_size), dtype=dt, device=dev)
        self.bar = torch.zeros(1, dtype=torch.int32, device=dev)
        # int64 [phases, programs, 2 (start, end), 2 (SM clock, global ns)] when a profiler sets
        # it (GPU only, the interpreter has no clocks); None: no stamps
        self.stamps: torch.Tensor | None = None
        self.num_warps, self.num_stages = NUM_WARPS, NUM_STAGES
        self.norm_batch_rows_only = NORM_BATCH_ROWS_ONLY
        self.out_batch_rows_only = OUT_BATCH_ROWS_ONLY
        self.barrier_sleep_ns = BARRIER_SLEEP_NS
        self.max_splits = MAX_SPLITS

    def set_programs(self, programs: int) -> None:
        """Programs of a launch; the tiles and the per-column-tile statistics follow (shape-only).
        Graphs captured before must be dropped: the statistics buffer may be a new one."""
        cfg = self.dec.cfg
        self.programs = programs
        self.set_tiles(pick_tiles(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size,
                                  cfg.head_dim, programs))
        self._resident: dict[tuple, int] = {}  # launch options -> programs per SM the driver allows

    def set_tiles(self, tiles: Tiles) -> None:
        """Tiles of a launch (set_programs' by default; a sweep's own); the per-column-tile
        statistics buffer follows their column width. Graphs captured before must be dropped."""
        self.tiles = tiles
        n_col_items = cdiv(self.dec.cfg.hidden_size, tiles.bn)
        self.np = next_pow2(n_col_items)
        if self.stats is None or self.stats.shape[0] != n_col_items:
            self.stats = torch.zeros((n_col_items, ROWS_PAD), dtype=torch.float32, device=self.device)

    def items_per_program(self) -> dict[str, int]:
        cfg = self.dec.cfg
        return items_per_program(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 cfg.intermediate_size, self.tiles, self.programs)

    def _check_resident(self, args: tuple, kw: dict) -> None:
        """Raise ValueError unless every program of the launch can be resident at once (more
        than one per SM): a grid that cannot would spin at its first barrier forever."""
        key = tuple(sorted(kw.items()))
        per_sm = self._resident.get(key)
        if per_sm is None:
            compiled = _decode_layers_kernel.warmup(*args, SYNC=True, grid=(self.programs,), **kw)
            compiled._init_handles()
            per_sm = max_resident_per_sm(compiled.function, kw["num_warps"] * 32, compiled.metadata.shared)
            self._resident[key] = per_sm
        if self.programs > per_sm * self.sm_count:
            raise ValueError(f"{self.programs} programs cannot be resident at once: {per_sm} per SM fit "
                             f"on {self.sm_count} SMs")

    def norms_batch_rows(self, b: int) -> bool:
        """Whether a launch for b rows normalises only the batch's rows of its activation tiles."""
        if self.norm_batch_rows_only is not None:
            return self.norm_batch_rows_only
        return norm_rows_only(b, self.dec.cfg.hidden_size)

    def splits(self, b: int) -> int:
        """Attention splits per (row, kv head): enough items for every program, at most
        max_splits (16; the sweep's +splitsN lowers it: fewer partials to merge, longer splits)."""
        return max(1, min(self.max_splits, self.programs // (b * self.dec.cfg.num_kv_heads)))

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            persistent: bool = True, phases: tuple[int, int] | None = None) -> torch.Tensor:
        """Every decoder layer for rows [0, B) (int64 ids, positions, slots [B]); the residual
        stream after the last layer, float32 [B, H] (a view of a buffer reused by every call).
        persistent False: one launch per phase (no grid barrier; Triton's interpreter). phases
        (lo, hi): only phases [lo, hi) of 1 + 5 x layers (profiling)."""
        b = ids.shape[0]
        if not 1 <= b <= MAX_ROWS:
            raise ValueError(f"the mega kernel runs 1 to {MAX_ROWS} rows, got {b}")
        cfg, dec, t = self.dec.cfg, self.dec, self.tiles
        all_kv = self.cache.all
        args = (ids, positions, slots, dec.w.embed, dec.w.embed, self.woff, dec.cos, dec.sin, all_kv,
                self.h, self.stats, self.q, self.part, self.ml, self.cnt, self.attn, self.act, self.bar,
                self.bar if self.stamps is None else self.stamps,
                b, cfg.rms_eps, dec.scale)
        tail = (cfg.num_layers, self.splits(b), all_kv.stride(0), all_kv.stride(1), all_kv.stride(2))
        kw = dict(H=cfg.hidden_size, HQ=cfg.num_heads, HKV=cfg.num_kv_heads, D=cfg.head_dim,
                  INTER=cfg.intermediate_size, BN=t.bn, BNI=t.bni, PB=t.pb, BKH=t.bkh, BKQ=t.bkq, BKI=t.bki,
                  NP=self.np, PREC="ieee" if dec.w.embed.dtype == torch.float32 else "tf32",
                  WA=self.align, **self.items_per_program(),
                  STAMP=self.stamps is not None, MP=next_pow2(b) if self.norms_batch_rows(b) else ROWS_PAD,
                  MPO=next_pow2(b) if self.out_batch_rows_only else ROWS_PAD, SLEEP_NS=self.barrier_sleep_ns,
                  num_warps=self.num_warps, num_stages=self.num_stages)
        lo, hi = phases or (0, 1 + PHASES_PER_LAYER * cfg.num_layers)
        if persistent:
            if self.programs > self.sm_count:
                self._check_resident(args + (lo, hi) + tail, kw)
            _decode_layers_kernel[(self.programs,)](*args, lo, hi, *tail, SYNC=True, **kw)
        else:
            for p in range(lo, hi):
                _decode_layers_kernel[(self.programs,)](*args, p, p + 1, *tail, SYNC=False, **kw)
        return self.h[:b]
