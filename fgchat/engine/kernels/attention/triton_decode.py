"""fgchat's own split-K ("flash-decoding") decode-attention kernel, in Triton.

Two launches per call:
1. `_split_kernel`, grid (B, Hkv, programs). Each lane's range [0, seq_len) is partitioned into
   `num_splits` chunks (the partition); program (lane, kv head, p) runs chunks p, p + programs,
   ... Per chunk it runs an online softmax over the chunk for all G query heads of the KV group
   at once (G padded to BLOCK_G >= 16 rows so tl.dot applies; each K/V tile is loaded once per
   group) and writes a normalised partial output and its log2-sum-exp (lse); an empty chunk
   writes lse = -inf and no output.
2. `_combine_kernel`, grid (B, Hq): merges the chunks' partials weighted by exp2(lse - max).

Invariants:
- a lane's bits depend on its own length, slot, q and cache rows and on the partition, never on
  the batch size or the grid: the partition is a function of (Hkv, T, D) and the SM count
  (`partition`, plan_num_splits at one lane), the grid's program count (plan_num_splits at B
  lanes, at most the partition) only decides which program runs a chunk, and every chunk runs
  the same code. So a row of a verification step (B x block rows) computes the bits of the plain
  decode step of that row, and a sequence's tokens do not depend on the batch it decodes in;
- the grid depends only on shapes and the SM count; max_len_hint is ignored; there is no host
  sync and no Python branch on tensor values;
- chunk = cdiv(cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N is derived on the device, so a
  graph captured at any length is correct at every other length 1..T;
- seq_len is clamped to T, so a bad length can never read past the cache;
- the combine step never reads the partial output of an empty chunk (that memory is
  uninitialised) and maps a lane with no work at all (seq_len == 0) to zeros, never NaN.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from fgchat.engine.kernels.attention.base import DecodeAttention, check_decode_shapes, plan_num_splits
from fgchat.protocol.errors import FgchatError
from fgchat.engine.intmath import next_pow2
from fgchat.engine.kernels.launch import fast
from fgchat.engine.kernels.pdl import pdl_enter
from fgchat.engine.kernels.pdl import supported as pdl_supported

LOG2_E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2_E)


@triton.jit
def _attend(q, k, v, n_mask, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One K/V tile of the online softmax; masked positions take no weight. A tile holds at least
    one valid position, so every row max is finite and alpha / p never see inf - inf."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _chunk_partial(q, k0, v0, start, end, last, k_cur, v_cur, k_base, v_base, stride_kt, stride_vt,
                   lse_row, part_row, stride_ps, vs, qk_scale, offs_n, offs_d, g_mask,
                   BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, CUR_FROM_REGS: tl.constexpr):
    """Partition chunk `vs` = positions [start, end): online softmax over its tiles, its first
    tile (k0, v0) given, then its lse and normalised partial output stored at slot vs (an empty
    chunk stores lse = -inf and no output). The first tile's current row (position `last`) is
    replaced: from k_cur / v_cur (CUR_FROM_REGS) or re-read from the cache after its write. The
    same code for every chunk, whichever program runs it, so a chunk's bits do not depend on the
    grid."""
    pos0 = start + offs_n
    mask0 = pos0 < end
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    if start < end:
        cur_row = (pos0 == last)[:, None]
        if not CUR_FROM_REGS:
            here = (start <= last) & (last < start + BLOCK_N) & (offs_d < HEAD_DIM)
            k_cur = tl.load(k_base + last * stride_kt + offs_d, mask=here, other=0.0)
            v_cur = tl.load(v_base + last * stride_vt + offs_d, mask=here, other=0.0)
        k0 = tl.where(cur_row, k_cur[None, :], k0)
        v0 = tl.where(cur_row, v_cur[None, :], v0)
        m_i, l_i, acc = _attend(q, k0, v0, mask0, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        k = tl.load(k_base + pos[:, None] * stride_kt + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vt + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        m_i, l_i, acc = _attend(q, k, v, n_mask, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    has_work = l_i > 0.0  # l_i >= 1 for any chunk that saw a position, 0 otherwise
    l_safe = tl.where(has_work, l_i, 1.0)
    lse = tl.where(has_work, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(lse_row + vs, lse, mask=g_mask)
    part = acc / l_safe[:, None]
    # Empty chunks store no partial output (the merge never reads it). Full [BLOCK_G, D] mask.
    store_mask = (g_mask & has_work)[:, None] & (offs_d[None, :] < HEAD_DIM)
    tl.store(part_row + vs * stride_ps, part, mask=store_mask)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, part_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    max_context, group, num_splits,  # num_splits: the partition's chunks (>= the grid's third dim)
    window,  # > 0: the lane attends to its last `window` positions only
    stride_qb, stride_qh,
    stride_ks, stride_kt, stride_kh,
    stride_vs, stride_vt, stride_vh,
    stride_pb, stride_ph, stride_ps,  # partial out [B, Hq, splits, D], D contiguous
    stride_lb, stride_lh,  # lse [B, Hq, splits], splits contiguous
    cnt_ptr, out_ptr, stride_ob, stride_oh,  # used with FUSE_COMBINE: counters [B, Hkv], out
    cos_ptr, sin_ptr,  # used with ROPE: tables [T, D]; q_ptr is then the qkv row [B, (Hq+2Hkv)*D]
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FUSE_COMBINE: tl.constexpr = False,
    BLOCK_S: tl.constexpr = 2,
    ROPE: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    PRELOAD: tl.constexpr = False,
    CUR_FROM_CACHE: tl.constexpr = True,
    MERGE_UNROLLED: tl.constexpr = False,
    MERGE_CH: tl.constexpr = 8,
):
    if not PRELOAD:
        pdl_enter(USE_PDL)
    lane = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    n_prog = tl.num_programs(2)  # programs per (lane, kv head): chunks split, split + n_prog, ...

    slot = tl.load(slot_ptr + lane).to(tl.int64)
    seq_len = tl.minimum(tl.load(len_ptr + lane), max_context)
    # The partition into num_splits chunks derives from the device-side length alone: short
    # sequences still spread over all chunks (in BLOCK_N steps); chunks past the end get
    # start >= end and do nothing. A window moves the range's start to seq_len - window, also on
    # the device. Which program runs a chunk never changes its bits (_chunk_partial).
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    last = seq_len - 1  # the current token's position

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < group
    q_heads = kv_head * group + offs_g  # the query heads that share this KV head

    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
    # The program's first chunk's first K/V tile, loaded here (PRELOAD) or after the current
    # token's K/V is written; the same code either way, so both give the same bits.
    pos0 = start + offs_n
    mask0 = pos0 < end  # masked K/V are loaded as 0, so garbage beyond seq_len is never read
    if PRELOAD:
        # Before the PDL wait: the slot, the length and the cache rows were written at least two
        # launches earlier (the step's inputs, earlier steps), complete once this kernel runs
        # (engine.pdl); the current position's row is not, and is replaced in _chunk_partial
        # after its write (by this program with ROPE, by the cache-write kernel otherwise).
        k0 = tl.load(k_base + pos0[:, None] * stride_kt + offs_d[None, :], mask=mask0[:, None], other=0.0)
        v0 = tl.load(v_base + pos0[:, None] * stride_vt + offs_d[None, :], mask=mask0[:, None], other=0.0)
        pdl_enter(USE_PDL)
    k_new = tl.zeros([HEAD_DIM], k_ptr.dtype.element_ty)
    v_new = tl.zeros([HEAD_DIM], v_ptr.dtype.element_ty)
    if ROPE:
        # RoPE of q (and of k for the cache write) at the current position seq_len - 1, with the
        # rounding points of fused.rope_kv_write: x * cos + rotate_half(x) * sin, where
        # rotate_half(x)[d] = -x[d + D/2] for d < D/2 and x[d - D/2] otherwise.
        half: tl.constexpr = HEAD_DIM // 2
        cur_c = tl.maximum(last, 0)
        offs_r = (offs_d + half) % HEAD_DIM
        sign = tl.where(offs_d < half, -1.0, 1.0)
        cs = tl.load(cos_ptr + cur_c * HEAD_DIM + offs_d).to(tl.float32)
        sn = tl.load(sin_ptr + cur_c * HEAD_DIM + offs_d).to(tl.float32)
        row = q_ptr + lane * stride_qb
        x = tl.load(row + q_heads[:, None] * HEAD_DIM + offs_d[None, :], mask=g_mask[:, None], other=0.0)
        xr = tl.load(row + q_heads[:, None] * HEAD_DIM + offs_r[None, :], mask=g_mask[:, None], other=0.0)
        ty = x.dtype
        q = ((x.to(tl.float32) * cs[None, :]).to(ty).to(tl.float32)
             + (sign[None, :] * xr.to(tl.float32) * sn[None, :]).to(ty).to(tl.float32)).to(ty)
        # The program that runs the current position's chunk writes its K/V before reading the
        # cache; the barrier makes every thread's store visible to the whole program's loads.
        n_kv = tl.num_programs(1)
        k_row = row + (group * n_kv + kv_head) * HEAD_DIM
        kx = tl.load(k_row + offs_d)
        kxr = tl.load(k_row + offs_r)
        k_new = ((kx.to(tl.float32) * cs).to(ty).to(tl.float32)
                 + (sign * kxr.to(tl.float32) * sn).to(ty).to(tl.float32)).to(ty)
        v_new = tl.load(row + (group * n_kv + n_kv + kv_head) * HEAD_DIM + offs_d)
        cur_chunk = (last - lo) // tl.maximum(chunk, 1)
        owns = (lo <= last) & (cur_chunk % n_prog == split)
        tl.store(k_base + cur_c * stride_kt + offs_d, k_new, mask=owns & (offs_d < HEAD_DIM))
        tl.store(v_base + cur_c * stride_vt + offs_d, v_new, mask=owns & (offs_d < HEAD_DIM))
        tl.debug_barrier()
    else:
        q = tl.load(
            q_ptr + lane * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None],
            other=0.0,
        )

    if not PRELOAD:
        k0 = tl.load(k_base + pos0[:, None] * stride_kt + offs_d[None, :], mask=mask0[:, None], other=0.0)
        v0 = tl.load(v_base + pos0[:, None] * stride_vt + offs_d[None, :], mask=mask0[:, None], other=0.0)
    # CUR_FROM_CACHE: a chunk's current row is read back from the cache after its write is visible
    # (the barrier above with ROPE, the wait otherwise). Otherwise (ROPE only) it comes from the
    # registers this program wrote it from: one L2 round trip less, and at head dim 64 not the
    # separate path's rounding (every step of one engine, verification included, runs this kernel).
    regs: tl.constexpr = ROPE and not CUR_FROM_CACHE
    lse_row = lse_ptr + lane * stride_lb + q_heads * stride_lh
    part_row = part_ptr + lane * stride_pb + q_heads[:, None] * stride_ph + offs_d[None, :]
    _chunk_partial(q, k0, v0, start, end, last, k_new, v_new, k_base, v_base, stride_kt, stride_vt,
                   lse_row, part_row, stride_ps, split, qk_scale, offs_n, offs_d, g_mask,
                   BLOCK_G, HEAD_DIM, BLOCK_N, DOT_PRECISION, regs)
    for vs in range(split + n_prog, num_splits, n_prog):  # the program's further chunks
        start = lo + vs * chunk
        end = tl.minimum(start + chunk, seq_len)
        pos0 = start + offs_n
        mask0 = pos0 < end
        k0 = tl.load(k_base + pos0[:, None] * stride_kt + offs_d[None, :], mask=mask0[:, None], other=0.0)
        v0 = tl.load(v_base + pos0[:, None] * stride_vt + offs_d[None, :], mask=mask0[:, None], other=0.0)
        _chunk_partial(q, k0, v0, start, end, last, k_new, v_new, k_base, v_base, stride_kt, stride_vt,
                       lse_row, part_row, stride_ps, vs, qk_scale, offs_n, offs_d, g_mask,
                       BLOCK_G, HEAD_DIM, BLOCK_N, DOT_PRECISION, regs)

    if FUSE_COMBINE:
        # The last program of (lane, kv head) to finish merges all chunks. All threads' stores are
        # ordered before the counter's release by the barrier; the merging program reads the
        # partials after its acquire, from L2 (.cg: L1 may hold lines of an earlier launch).
        tl.debug_barrier()
        cnt = cnt_ptr + lane * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == n_prog - 1:
            offs_s = tl.arange(0, BLOCK_S)
            gs_mask = g_mask[:, None] & (offs_s[None, :] < num_splits)
            lse_all = tl.load(lse_ptr + lane * stride_lb + q_heads[:, None] * stride_lh + offs_s[None, :],
                              mask=gs_mask, other=float("-inf"), cache_modifier=".cg")
            m = tl.max(lse_all, 1)
            m = tl.where(m > float("-inf"), m, 0.0)  # no live split (seq_len == 0): weights 0
            denom = tl.sum(tl.exp2(lse_all - m[:, None]), 1)
            o = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
            if MERGE_UNROLLED:
                # Chunks are consecutive from position lo, so the live ones are a prefix
                # [0, n_live): MERGE_CH of them per step, each step one [G, MERGE_CH, D] load
                # (one L2 round trip) summed over the chunks; steps added in order (fixed sums).
                n_live = tl.where(seq_len > lo, tl.cdiv(seq_len - lo, tl.maximum(chunk, 1)), 0)
                offs_c = tl.arange(0, MERGE_CH)
                for c0 in range(0, tl.minimum(n_live, num_splits), MERGE_CH):
                    sp = c0 + offs_c
                    gc_mask = g_mask[:, None] & (sp[None, :] < num_splits)
                    lse_c = tl.load(lse_ptr + lane * stride_lb + q_heads[:, None] * stride_lh + sp[None, :],
                                    mask=gc_mask, other=float("-inf"), cache_modifier=".cg")
                    live = lse_c > float("-inf")  # only live splits wrote a partial output
                    part_c = tl.load(part_ptr + lane * stride_pb + q_heads[:, None, None] * stride_ph
                                     + sp[None, :, None] * stride_ps + offs_d[None, None, :],
                                     mask=live[:, :, None], other=0.0, cache_modifier=".cg")
                    w_c = tl.where(live, tl.exp2(lse_c - m[:, None]), 0.0)
                    o += tl.sum(part_c * w_c[:, :, None], 1)
            else:
                for sp in range(0, tl.minimum(num_splits, BLOCK_S)):  # fixed order: same sum every launch
                    lse_s = tl.load(lse_ptr + lane * stride_lb + q_heads * stride_lh + sp, mask=g_mask,
                                    other=float("-inf"), cache_modifier=".cg")
                    live = lse_s > float("-inf")  # only live splits wrote a partial output
                    part_s = tl.load(part_ptr + lane * stride_pb + q_heads[:, None] * stride_ph
                                     + sp * stride_ps + offs_d[None, :],
                                     mask=live[:, None], other=0.0, cache_modifier=".cg")
                    o += part_s * tl.exp2(lse_s - m)[:, None]
            o = o / tl.where(denom > 0.0, denom, 1.0)[:, None]
            tl.store(out_ptr + lane * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr,
    num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    lane = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)

    lse = tl.load(lse_ptr + lane * stride_lb + head * stride_lh + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    live = lse > float("-inf")  # only live splits wrote a partial output
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # no live split (seq_len == 0): all weights become 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    part = tl.load(
        part_ptr + lane * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    o = tl.sum(part * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + lane * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class KernelConfig:
    """Tunables of the split kernel. Invariant: chosen from shapes only (head dim)."""

    block_n: int = 64  # KV positions per tile
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the K/V loads (3 beat 2 by up to 23% on H200)
    programs_per_sm: int = 2  # split target: B * Hkv * splits ~= programs_per_sm * SMs
    max_splits: int = 64


# Defaults per head dim, from the H200 sweep in docs/design.md: BLOCK_N=64,
# 4 warps, 3 stages, 2 programs per SM was best or within noise of best for both head dims.
# Head dim 256 (Gemma 3) halves the tile so a stage's K and V tiles stay at 32 KB (untuned).
DEFAULT_CONFIGS: dict[int, KernelConfig] = {64: KernelConfig(), 128: KernelConfig(), 256: KernelConfig(block_n=32)}


class TritonDecodeAttention(DecodeAttention):
    """Split-K decode attention. The config is fixed per instance and head dim, so a captured
    graph and an eager call with the same shapes launch identical kernels (bit-identical outputs)."""

    name = "triton"
    rope_in_attention = True

    def __init__(self, device: torch.device, config: KernelConfig | None = None,
                 fuse_combine: bool = False, pdl: bool = False, preload: bool = True,
                 cur_from_cache: bool = False, merge_unrolled: bool = True, sm_count: int | None = None) -> None:
        """config=None uses DEFAULT_CONFIGS[head_dim]; a given config applies to every head dim.
        fuse_combine: the last split merges the others instead of a separate combine kernel (the
        separate kernel measured faster on the H200). pdl: programmatic dependent launch where
        the device supports it (see kernels.pdl). preload: each split loads its first K/V tile before its
        PDL wait (the wait then covers only the previous kernel's output: q and the current row;
        H200, SmolLM2 full b1 0.536 -> 0.509 ms). cur_from_cache=False: with preload and RoPE
        inside the kernel, the current row comes from registers, not re-read from the cache
        (~13 us less per 1B step; True rounds like the separate RoPE path at D=64).
        merge_unrolled (with fuse_combine): the merging split reads the live splits' partials
        eight at a time, one load each, instead of every split's one after another (design.md V55).
        sm_count given: the SM count the plans are made for, on any device (tests run the kernels
        on CPU under Triton's interpreter)."""
        if sm_count is None:
            if device.type != "cuda" or not torch.cuda.is_available():
                raise FgchatError("the triton attention backend needs a CUDA device (use --attention torch)")
            index = device.index if device.index is not None else torch.cuda.current_device()
            sm_count = _sm_count(index)
        self.sm_count = sm_count
        self._config = config
        self.fuse_combine = fuse_combine
        self.merge_unrolled = merge_unrolled
        self.preload = preload
        self.cur_from_cache = cur_from_cache
        self.pdl = pdl and pdl_supported(device)
        # PDL for the split kernel: the caller lowers it when a library kernel precedes attention
        self.pdl_entry = self.pdl
        # the split kernel launches dependently (PDL) where pdl_entry allows; for_blocks' twin never
        self.dependent_launch = True
        self._cnt: Tensor | None = None
        self._plans: dict[tuple, _Plan] = {}
        self._scratch: dict[int, tuple[Tensor, Tensor]] = {}  # id of a plan in _plans -> part, lse
        self._blocks: TritonDecodeAttention | None = None  # for_blocks' twin

    def for_blocks(self) -> TritonDecodeAttention:
        """This backend with its split kernel launched after the preceding kernel has ended (no
        dependent launch): a preloaded first tile is read before the PDL wait, when only a lane's
        own current row is replaced after it, so another lane's row written by the preceding
        kernel could be read stale. The kernel is compiled with the same constants (USE_PDL
        included: its wait returns at once in a plain launch), so a verification row computes
        the bits of the plain step's (plans of its own)."""
        if not (self.preload and self.pdl_entry):
            return self
        if self._blocks is None:
            twin = copy.copy(self)
            twin.dependent_launch, twin._plans, twin._scratch, twin._blocks = False, {}, {}, None
            self._blocks = twin
        self._blocks.pdl_entry = self.pdl_entry
        return self._blocks

    def _counters(self, batch: int, num_kv_heads: int, device: torch.device) -> Tensor:
        """Arrival counters, zero between launches (each merge resets its own). Allocated once,
        outside any graph pool, at the largest size used, so graphs keep a valid address."""
        need = batch * num_kv_heads
        if self._cnt is None or self._cnt.numel() < need:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("attention counters must be allocated before graph capture")
            self._cnt = torch.zeros(max(need, 64 * 8), dtype=torch.int32, device=device)
        return self._cnt

    def config(self, head_dim: int) -> KernelConfig:
        if self._config is not None:
            return self._config
        if head_dim not in DEFAULT_CONFIGS:
            raise ValueError(f"triton decode attention supports head dim {sorted(DEFAULT_CONFIGS)}, got {head_dim}")
        return DEFAULT_CONFIGS[head_dim]

    def num_splits(self, batch: int, num_kv_heads: int, max_context: int, head_dim: int) -> int:
        """Programs per (lane, kv head) at `batch` lanes (see plan_num_splits), at most the
        partition's chunks; exposed for tests and the benchmark."""
        cfg = self.config(head_dim)
        return plan_num_splits(
            batch, num_kv_heads, max_context, cfg.block_n, self.sm_count, cfg.programs_per_sm, cfg.max_splits
        )

    def partition(self, num_kv_heads: int, max_context: int, head_dim: int) -> int:
        """Chunks each lane's positions are split into, whatever the batch size (the split count
        of one lane): what a lane's bits depend on (module docstring)."""
        return self.num_splits(1, num_kv_heads, max_context, head_dim)

    def __call__(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_ids: Tensor,
        seq_lens: Tensor,
        out: Tensor,
        scale: float,
        max_len_hint: int | None = None,  # ignored on purpose: the launch must not depend on lengths
        window: int = 0,
    ) -> None:
        plan = self._plain_plan(q, k_cache, v_cache, slot_ids, seq_lens, out, scale, window)
        self._run(plan, q, None, None, k_cache, v_cache, slot_ids, seq_lens, out)

    def _plain_plan(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_ids: Tensor, seq_lens: Tensor,
                    out: Tensor, scale: float, window: int = 0) -> _Plan:
        key = self._key(q, q.stride(), None, k_cache, v_cache, slot_ids, seq_lens, out, scale, window)
        plan = self._plans.get(key)
        if plan is None:
            check_decode_shapes(q, k_cache, v_cache, slot_ids, seq_lens, out)
            if q.stride(-1) != 1:
                raise ValueError("q must be contiguous in its last dimension")
            plan = self._plan(key, q, q.stride(0), q.stride(1), None, k_cache, v_cache, out, scale, window)
        return plan

    def decode_with_rope(
        self,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_ids: Tensor,
        seq_lens: Tensor,
        out: Tensor,
        scale: float,
    ) -> None:
        """RoPE + KV-cache write + attention in one call: qkv [B, (Hq + 2 Hkv) * D] rows q | k | v
        of the current token at position seq_lens - 1; cos/sin [T, D] tables in qkv's dtype.
        Same bits as fused.rope_kv_write followed by __call__."""
        plan = self._rope_plan(qkv, cos, sin, k_cache, v_cache, slot_ids, seq_lens, out, scale)
        self._run(plan, qkv, cos, sin, k_cache, v_cache, slot_ids, seq_lens, out)

    def _rope_plan(self, qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slot_ids: Tensor, seq_lens: Tensor, out: Tensor, scale: float) -> _Plan:
        key = self._key(qkv, qkv.stride(), cos, k_cache, v_cache, slot_ids, seq_lens, out, scale)
        plan = self._plans.get(key)
        if plan is None:
            batch, num_q_heads, head_dim = out.shape
            num_kv_heads = k_cache.shape[2]
            if qkv.shape != (batch, (num_q_heads + 2 * num_kv_heads) * head_dim) or qkv.stride(-1) != 1:
                raise ValueError(f"qkv must be [B, (Hq + 2 Hkv) * D] contiguous rows, got {tuple(qkv.shape)}")
            if cos.shape[-1] != head_dim or sin.shape != cos.shape or cos.shape[0] < k_cache.shape[1]:
                raise ValueError("cos/sin must be [T, D] tables covering the cache")
            q_view = qkv[:, : num_q_heads * head_dim].view(batch, num_q_heads, head_dim)
            check_decode_shapes(q_view, k_cache, v_cache, slot_ids, seq_lens, out)
            plan = self._plan(key, qkv, qkv.stride(0), head_dim, cos, k_cache, v_cache, out, scale)
        return plan

    def _key(self, q: Tensor, q_strides: tuple, cos: Tensor | None, k_cache: Tensor, v_cache: Tensor,
             slot_ids: Tensor, seq_lens: Tensor, out: Tensor, scale: float, window: int = 0) -> tuple:
        """Everything a launch's arguments derive from apart from the tensors' addresses: calls
        with equal keys launch the same grid with the same scalars (all layers share one key)."""
        return (q.shape, q.dtype, q_strides, cos is None or (cos.shape, cos.dtype), k_cache.shape,
                k_cache.stride(), k_cache.dtype, v_cache.stride(), v_cache.dtype, out.shape, out.stride(),
                out.dtype, slot_ids.shape, slot_ids.dtype, seq_lens.shape, seq_lens.dtype, scale,
                self.pdl, self.pdl_entry, self.dependent_launch, self.fuse_combine, self.merge_unrolled, window)

    def _plan(self, key: tuple, q: Tensor, stride_qb: int, stride_qh: int, cos: Tensor | None, k_cache: Tensor,
              v_cache: Tensor, out: Tensor, scale: float, window: int = 0) -> _Plan:
        """Validate once per key and precompute the launches' grids, scalars and options."""
        batch, num_q_heads, head_dim = out.shape
        _, max_context, num_kv_heads, _ = k_cache.shape
        if head_dim not in DEFAULT_CONFIGS:
            raise ValueError(f"triton decode attention supports head dim {sorted(DEFAULT_CONFIGS)}, got {head_dim}")
        if not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype):
            raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}, out {out.dtype}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension")
        cfg = self.config(head_dim)
        group = num_q_heads // num_kv_heads
        splits = self.partition(num_kv_heads, max_context, head_dim)
        programs = min(splits, self.num_splits(batch, num_kv_heads, max_context, head_dim))
        block_s = max(2, next_pow2(splits))
        part_shape = (batch, num_q_heads, splits, head_dim)
        # strides of the contiguous scratch allocated per call
        part_strides = (num_q_heads * splits * head_dim, splits * head_dim, head_dim)
        lse_strides = (num_q_heads * splits, splits)
        split_mid = (scale * LOG2_E, max_context, group, splits, window, stride_qb, stride_qh,
                     *k_cache.stride()[:3], *v_cache.stride()[:3], *part_strides, *lse_strides)
        split_kw = dict(
            HEAD_DIM=head_dim, BLOCK_G=max(16, next_pow2(group)), FUSE_COMBINE=self.fuse_combine,
            BLOCK_S=block_s, ROPE=cos is not None, BLOCK_N=cfg.block_n,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_PDL=self.pdl_entry,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            launch_pdl=self.pdl_entry and self.dependent_launch,
            PRELOAD=self.preload, CUR_FROM_CACHE=self.cur_from_cache,
            MERGE_UNROLLED=self.fuse_combine and self.merge_unrolled,
        )
        combine = None
        if not self.fuse_combine:
            combine = (
                (batch, num_q_heads),
                (splits, *part_strides, *lse_strides, *out.stride()[:2]),
                dict(HEAD_DIM=head_dim, BLOCK_S=block_s, USE_PDL=self.pdl,
                     num_warps=4 if head_dim * splits >= 4096 else 2, launch_pdl=self.pdl),
            )
        plan = _Plan((batch, num_kv_heads, programs), split_mid, tuple(out.stride()[:2]),
                     split_kw, part_shape, part_shape[:3], batch * num_kv_heads, combine)
        self._plans[key] = plan
        return plan

    def _run(self, plan: _Plan, q: Tensor, cos: Tensor | None, sin: Tensor | None, k_cache: Tensor,
             v_cache: Tensor, slot_ids: Tensor, seq_lens: Tensor, out: Tensor) -> None:
        part, lse = self._scratch_for(plan, q.device)
        cnt = self._counters(plan.lanes, 1, q.device) if self.fuse_combine else lse
        fast(_split_kernel)[plan.split_grid](*self._split_args(plan, q, cos, sin, k_cache, v_cache, slot_ids,
                                                               seq_lens, out, part, lse, cnt), **plan.split_kw)
        if plan.combine is not None:
            grid, scalars, kw = plan.combine
            fast(_combine_kernel)[grid](part, lse, out, *scalars, **kw)

    def _scratch_for(self, plan: _Plan, device: torch.device) -> tuple[Tensor, Tensor]:
        """Split partials and log-sum-exps. Under graph capture: fresh, owned by the graph's pool.
        Eager (and a launch list recorded from eager calls): one pair per plan, shared by every
        call of that plan (all layers of one batch size). Calls run in stream order, and a split
        kernel writes its scratch only after its PDL wait, when every earlier kernel has ended."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return (torch.empty(plan.part_shape, dtype=torch.float32, device=device),
                    torch.empty(plan.lse_shape, dtype=torch.float32, device=device))
        scratch = self._scratch.get(id(plan))
        if scratch is None:
            scratch = (torch.empty(plan.part_shape, dtype=torch.float32, device=device),
                       torch.empty(plan.lse_shape, dtype=torch.float32, device=device))
            self._scratch[id(plan)] = scratch
        return scratch

    @staticmethod
    def _split_args(plan: _Plan, q: Tensor, cos: Tensor | None, sin: Tensor | None, k_cache: Tensor,
                    v_cache: Tensor, slot_ids: Tensor, seq_lens: Tensor, out: Tensor, part: Tensor,
                    lse: Tensor, cnt: Tensor) -> tuple:
        return (q, k_cache, v_cache, slot_ids, seq_lens, part, lse, *plan.split_mid, cnt, out, *plan.out_strides,
                cos if cos is not None else lse, sin if sin is not None else lse)


@dataclass(frozen=True)
class _Plan:
    """Precomputed launches of one attention key (see TritonDecodeAttention._key)."""

    split_grid: tuple[int, int, int]
    split_mid: tuple  # scalars between the scratch tensors and the counter argument
    out_strides: tuple
    split_kw: dict
    part_shape: tuple
    lse_shape: tuple
    lanes: int  # batch * KV heads: arrival counters needed by the fused merge
    combine: tuple | None  # (grid, scalars, options) of the combine kernel
