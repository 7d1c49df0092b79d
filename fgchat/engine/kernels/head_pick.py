"""The LM head's greedy or Gumbel pick from an int8 copy of the head, its candidates rescored exactly.

The head is a decode step's largest weight read (Llama-3.2-1B: 128256 x 2048 bf16, 525 MB), yet a
pick needs only each row's maximum. Pass 1 reads an int8 copy (per vocabulary row v a scale s_v and
q_v = round(w_v / s_v), half the bytes) and gives every v an approximate logit a_v = s_v (x . q_v)
with a bound |x . w_v - a_v| <= beta_v = ||x|| slack_v, where
    slack_v = ||w_v - s_v q_v|| + gamma (||w_v|| + s_v ||q_v||)
(Cauchy-Schwarz for the quantisation; gamma covers float32 accumulation in either product). Each
program stores its a_v, and per row the maximum of a - beta and of a + beta over its tile. Pass 2:
L = max over tiles of max(a - beta) is at most the row's largest exact logit, so only a tile whose
max(a + beta) >= L can hold it. Those tiles are recomputed from the half-precision head with the
LM head kernel's own tiles and sum order (gemv.project_argmax's), their exact logits stored over
the approximations, and the row's first maximum picked among them. Every row left out has an
exact logit < L <= the maximum, so the pick is gemv.project_argmax's. Sampled rows (T > 0) do the
same on Gumbel scores logit / T + noise (sampling_triton.gumbel_scores), with the bound beta / T.

Invariants:
- Tokens equal gemv.project_argmax's for the same x, head tile and sample arguments; a row's pick
  depends only on that row (any batch size, any graph mode).
- Logits out: exact (project_logits' bits) in every rescored tile, within beta_v elsewhere.
- Graph-safe: fixed grids per batch size, no host sync; how many tiles are rescored is decided
  inside pass 2 (on real weights a median of 3 candidate rows, docs/design.md V63; if
  every tile qualifies, pass 2 computes the whole head, slower but still exact).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fgchat.engine.intmath import cdiv, next_pow2
from fgchat.engine.kernels import gemv
from fgchat.engine.kernels.gemv import argmax_finish_kernel, tile_product
from fgchat.engine.kernels.launch import fast
from fgchat.engine.kernels.pdl import pdl_enter
from fgchat.engine.kernels.sampling_triton import LIBDEVICE, gumbel_scores, row_hash

# pass 1's tile: (block_k, warps, stages, swap); None: K tiles of 256 int8, 4 warps, 4 stages, no
# swap (others measured slower on an H100)
APPROX_TILE: tuple[int, int, int, bool] | None = None
# Where the pick pays by default (H100 microbench, docs/design.md V63): one row
# (1B head 174 -> 140 us, 8B 345 -> 307) and heads of at least PAYS_BYTES; at 8 rows of random
# weights pass 2 rescores hundreds of tiles and the pick is no faster (1B) or up to 2x slower
# (8B, 135M heads), and a 135M-sized head gains nothing at any batch.
PAYS_ROWS = 1
PAYS_BYTES = 128 * 2**20
TILES_PER_CHUNK = 16  # pass 2: head tiles each program checks (and rescores where needed)
P_BLOCK = 256  # pass 2: per-tile lower bounds reduced this many at a time
# Relative margin on the score side of the bound (division by T, adding the noise: a few ulps).
SCORE_MARGIN = tl.constexpr(1e-5)


@dataclass(frozen=True)
class Int8Head:
    """An int8 copy of a [V, K] head: q [V, K] int8, scale and slack float32 [V]."""

    q: torch.Tensor
    scale: torch.Tensor
    slack: torch.Tensor


def supports(w: torch.Tensor) -> bool:
    """Half-precision heads whose K is whole 64-wide tiles (float32 heads keep the exact kernel)."""
    return w.dtype in (torch.float16, torch.bfloat16) and w.dim() == 2 and w.shape[1] % 64 == 0


def pays(w: torch.Tensor) -> bool:
    """Whether the default pick (one row) is worth an int8 copy of head w."""
    return supports(w) and w.numel() * w.element_size() >= PAYS_BYTES


def quantize(w: torch.Tensor, rows: int = 8192) -> Int8Head:
    """Symmetric per-row int8 copy of w [V, K] with each row's slack (see the module doc), built
    on w's device `rows` rows at a time (float64 for the norms)."""
    if not supports(w):
        raise ValueError("the int8 head needs a float16 / bfloat16 [V, K] weight with K % 64 == 0")
    n, k = w.shape
    gamma = (k + 16) * 2.0**-22  # 4x the float32 accumulation bound K * 2^-24, either product
    q = torch.empty((n, k), dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    slack = torch.empty(n, dtype=torch.float32, device=w.device)
    for lo in range(0, n, rows):
        wf = w[lo: lo + rows].double()
        s = (wf.abs().amax(dim=1) / 127.0).clamp_min(1e-30).float()
        qi = (wf / s.double()[:, None]).round().clamp(-127, 127)
        deq = s.double()[:, None] * qi
        r = (wf - deq).norm(dim=1) + gamma * (wf.norm(dim=1) + deq.norm(dim=1))
        q[lo: lo + rows] = qi.to(torch.int8)
        scale[lo: lo + rows] = s
        slack[lo: lo + rows] = (r * (1 + 1e-4)).float()  # ||x|| in float32, and the cast down
    return Int8Head(q, scale, slack)


@triton.jit
def _approx_kernel(
    x_ptr, q_ptr, scale_ptr, slack_ptr, logits_ptr, plo_ptr, phi_ptr, M,
    temp_ptr, seed_ptr, pos_ptr,  # SAMPLE: per row temperature, seed, position
    P: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, SAMPLE: tl.constexpr, LIBDEVICE: tl.constexpr,
    SWAP: tl.constexpr = False,
):
    """Program pid: vocabulary rows [pid*BLOCK_N, +BLOCK_N). Stores a = s * (x . q) into logits and,
    at [row, pid] of plo / phi, the tile's max of score - bound and of score + bound."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k0 = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    q_rows = q_ptr + offs_n.to(tl.int64)[:, None] * K
    x_rows = x_ptr + offs_m[:, None] * K
    q = tl.load(q_rows + offs_k0[None, :], mask=n_mask[:, None], other=0)  # weights: before the wait
    pdl_enter(USE_PDL)
    x = tl.load(x_rows + offs_k0[None, :], mask=m_mask[:, None], other=0.0)
    acc = tile_product(x, q.to(x_ptr.dtype.element_ty), SWAP, "tf32")
    xf = x.to(tl.float32)
    xsq = tl.sum(xf * xf, axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        q = tl.load(q_rows + (k0 + offs_k0)[None, :], mask=n_mask[:, None], other=0)
        x = tl.load(x_rows + (k0 + offs_k0)[None, :], mask=m_mask[:, None], other=0.0)
        acc += tile_product(x, q.to(x_ptr.dtype.element_ty), SWAP, "tf32")
        xf = x.to(tl.float32)
        xsq += tl.sum(xf * xf, axis=1)
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    slack = tl.load(slack_ptr + offs_n, mask=n_mask, other=0.0)
    a = acc * scale[None, :]
    bound = tl.sqrt(xsq)[:, None] * slack[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(logits_ptr + offs_m[:, None] * N + offs_n[None, :], a, mask=out_mask)
    if SAMPLE:
        t = tl.load(temp_ptr + offs_m, mask=m_mask, other=0.0)
        row = row_hash(tl.load(seed_ptr + offs_m, mask=m_mask, other=0),
                       tl.load(pos_ptr + offs_m, mask=m_mask, other=0))
        score = gumbel_scores(a, t[:, None], row[:, None], offs_n[None, :], LIBDEVICE)
        bound = tl.where(t[:, None] > 0.0, bound / tl.where(t[:, None] > 0.0, t[:, None], 1.0), bound)
        bound += SCORE_MARGIN * (tl.abs(score) + 1.0)
    else:
        score = a
    lo = tl.where(n_mask[None, :], score - bound, float("-inf"))
    hi = tl.where(n_mask[None, :], score + bound, float("-inf"))
    tl.store(plo_ptr + offs_m * P + pid, tl.max(lo, axis=1), mask=m_mask)
    tl.store(phi_ptr + offs_m * P + pid, tl.max(hi, axis=1), mask=m_mask)


@triton.jit
def _rescore_kernel(
    x_ptr, w_ptr, logits_ptr, plo_ptr, phi_ptr, cmax_ptr, cidx_ptr, M,
    temp_ptr, seed_ptr, pos_ptr,
    P: tl.constexpr, CHUNKS: tl.constexpr, N: tl.constexpr, K: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, P_BLOCK: tl.constexpr,
    SWAP: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, SAMPLE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """Program c: head tiles [c*TILES, +TILES). A tile some row may take its maximum from (its
    upper bound >= the row's L) is recomputed exactly as gemv._proj_kernel computes it (same tile,
    same K order) and stored; per row, the chunk's first maximum goes to [row, c] of cmax / cidx."""
    c = tl.program_id(0)
    pdl_enter(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    low = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for p0 in range(0, P, P_BLOCK):
        offs_p = p0 + tl.arange(0, P_BLOCK)
        v = tl.load(plo_ptr + offs_m[:, None] * P + offs_p[None, :],
                    mask=m_mask[:, None] & (offs_p < P)[None, :], other=float("-inf"))
        low = tl.maximum(low, tl.max(v, axis=1))
    offs_t = c * TILES + tl.arange(0, TILES)
    live = m_mask[:, None] & (offs_t < P)[None, :]
    hi = tl.load(phi_ptr + offs_m[:, None] * P + offs_t[None, :], mask=live, other=float("-inf"))
    need = tl.max((live & (hi >= low[:, None])).to(tl.int32), axis=0)  # [TILES]: any row
    if SAMPLE:
        t = tl.load(temp_ptr + offs_m, mask=m_mask, other=0.0)
        row = row_hash(tl.load(seed_ptr + offs_m, mask=m_mask, other=0),
                       tl.load(pos_ptr + offs_m, mask=m_mask, other=0))
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_M], dtype=tl.int32)
    offs_k0 = tl.arange(0, BLOCK_K)
    for j in range(TILES):
        if tl.sum(tl.where(tl.arange(0, TILES) == j, need, 0)) > 0:
            tile = c * TILES + j
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
            x_rows = x_ptr + offs_m[:, None] * K
            k_mask = offs_k0[None, :] < K
            w = tl.load(w_rows + offs_k0[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
            x = tl.load(x_rows + offs_k0[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
            acc = tile_product(x, w, SWAP, DOT_PRECISION)
            for k0 in range(BLOCK_K, K, BLOCK_K):
                offs_k = k0 + offs_k0
                if EVEN_K:
                    x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
                else:
                    k_mask = offs_k[None, :] < K
                    x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
                    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
                acc += tile_product(x, w, SWAP, DOT_PRECISION)
            tl.store(logits_ptr + offs_m[:, None] * N + offs_n[None, :], acc,
                     mask=m_mask[:, None] & n_mask[None, :])
            vals = acc
            if SAMPLE:
                vals = gumbel_scores(vals, t[:, None], row[:, None], offs_n[None, :], LIBDEVICE)
            vals = tl.where(n_mask[None, :], vals, float("-inf"))
            tile_best = tl.max(vals, axis=1)
            tile_idx = tile * BLOCK_N + tl.argmax(vals, axis=1, tie_break_left=True)
            better = tile_best > best
            best = tl.where(better, tile_best, best)
            best_idx = tl.where(better, tile_idx, best_idx)
    tl.store(cmax_ptr + offs_m * CHUNKS + c, best, mask=m_mask)
    tl.store(cidx_ptr + offs_m * CHUNKS + c, best_idx, mask=m_mask)


@dataclass(frozen=True)
class _Plan:
    tiles: int  # pass 1's programs (head tiles)
    chunks: int  # pass 2's programs
    approx_kw: dict
    rescore_kw: dict


@functools.lru_cache(maxsize=256)
def _plan(m: int, n: int, k: int, config: gemv.ProjConfig | None, pdl: bool, sample: bool,
          approx_tile: tuple[int, int, int, bool] | None) -> _Plan:
    if m > gemv.MAX_ROWS:
        raise ValueError(f"the int8 head pick handles at most {gemv.MAX_ROWS} rows, got {m}")
    cfg = config or gemv.pick_config(n, k)
    tiles = cdiv(n, cfg.block_n)
    chunks = cdiv(tiles, TILES_PER_CHUNK)
    block_k8, warps, stages, swap = approx_tile or (256, 4, 4, False)
    while k % block_k8:  # int8: up to 256 bytes a row per tile, whole tiles of K
        block_k8 //= 2
    approx_kw = dict(P=tiles, N=n, K=k, BLOCK_M=gemv.MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=block_k8, USE_PDL=pdl,
                     SAMPLE=sample, LIBDEVICE=LIBDEVICE, SWAP=swap, num_warps=warps, num_stages=stages,
                     launch_pdl=pdl)
    # the exact tiles as gemv._plan launches the head
    rescore_kw = dict(P=tiles, CHUNKS=chunks, N=n, K=k, EVEN_K=k % cfg.block_k == 0, BLOCK_M=gemv.MAX_ROWS, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, TILES=TILES_PER_CHUNK, P_BLOCK=P_BLOCK, SWAP=cfg.swap,
                      DOT_PRECISION="tf32", USE_PDL=pdl, SAMPLE=sample, LIBDEVICE=LIBDEVICE,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    return _Plan(tiles, chunks, approx_kw, rescore_kw)


def pick(x: torch.Tensor, w: torch.Tensor, head: Int8Head, config: gemv.ProjConfig | None = None,
         pdl: bool = False, sample: gemv.SampleArgs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv.project_argmax's tokens (greedy, or with sample = (temperature, seeds, positions) the
    unfiltered sampled pick) from the int8 copy `head` of w plus exact rescoring; returns float32
    logits [M, V] (exact in rescored tiles, approximate elsewhere) and int64 tokens [M]. Three
    launches. x [M <= 16, K] in w's dtype; config: the LM head's tile (as given to project_argmax)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or head.q.shape != w.shape or x.dtype != w.dtype or not x.is_contiguous():
        raise ValueError("the int8 head pick needs contiguous x [M, K] in w's dtype and head = quantize(w)")
    plan = _plan(m, n, k, config, pdl, sample is not None, APPROX_TILE)
    dev = x.device
    logits = torch.empty((m, n), dtype=torch.float32, device=dev)
    plo = torch.empty((m, plan.tiles), dtype=torch.float32, device=dev)
    phi = torch.empty((m, plan.tiles), dtype=torch.float32, device=dev)
    cmax = torch.empty((m, plan.chunks), dtype=torch.float32, device=dev)
    cidx = torch.empty((m, plan.chunks), dtype=torch.int32, device=dev)
    tokens = torch.empty(m, dtype=torch.int64, device=dev)
    temp, seeds, positions = sample if sample is not None else (None, None, None)
    fast(_approx_kernel)[(plan.tiles,)](x, head.q, head.scale, head.slack, logits, plo, phi, m,
                                        temp, seeds, positions, **plan.approx_kw)
    fast(_rescore_kernel)[(plan.chunks,)](x, w, logits, plo, phi, cmax, cidx, m,
                                          temp, seeds, positions, **plan.rescore_kw)
    fast(argmax_finish_kernel)[(m,)](cmax, cidx, tokens, plan.chunks, plan.chunks,
                                      BLOCK_P=max(16, next_pow2(plan.chunks)), USE_PDL=pdl,
                                      num_warps=4, launch_pdl=pdl)
    return logits, tokens
