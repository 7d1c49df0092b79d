"""The unfiltered sampled pick of kernels.sampling as two Triton kernels (CUDA; imported only when
they run, so a machine without Triton imports the engine).

`sampling.sample(filtered=False)` as torch ops is ~25 kernels over [B, V] (the noise hash alone is
a dozen int64 passes); here the first kernel computes, per (lane, chunk of the vocabulary), the
hash, the Gumbel noise, logit / T + noise (raw logits for a greedy lane) and the chunk's first
maximum; the second picks each lane's first maximum among its chunks.

Invariants:
- The same arithmetic as the torch ops: the splitmix64 hash in wrapping 64-bit integers, the
  uniform (bits >> 40 + 0.5) * 2^-24 (exact), IEEE division (div_rn) and, on the GPU, libdevice's
  logf, which is what torch's CUDA log runs. So on CUDA a lane picks the token the torch
  composition picks (filtered or not), bit for bit in every compared value. Under Triton's
  interpreter (CPU tests) the log is numpy's, which may differ by an ulp.
- The pick is the first index of the maximum, as torch.argmax: ties inside a chunk go to the
  lowest index, ties across chunks to the earlier chunk.
- Graph-safe: fixed shapes for a batch size, no host sync; the partials come from the caching
  allocator.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fgchat.engine.kernels.launch import fast

BLOCK = 1024  # vocabulary ids per program of the first kernel
_INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
LIBDEVICE = not _INTERPRET  # libdevice's logf on the GPU; the interpreter's (numpy's) log on CPU
if not _INTERPRET:
    from triton.language.extra import libdevice
else:  # the interpreter has no extern functions; the branch below never traces this name
    libdevice = None


@triton.jit
def _mix64(x):
    """splitmix64's finaliser on uint64 (wrapping multiplies, logical shifts)."""
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def row_hash(seed, pos):
    """The per-(request, position) hash every id's noise starts from (seed, pos int64, any shape)."""
    golden = tl.full((), 0x9E3779B97F4A7C15, tl.uint64)
    return _mix64(seed.to(tl.uint64) * golden + _mix64(pos.to(tl.uint64)))


@triton.jit
def gumbel_scores(x, t, row, cols, LIBDEVICE: tl.constexpr):
    """logit / T + Gumbel noise(row hash, id) where T > 0, the raw logit where T <= 0; x float32,
    t and row broadcast against cols (the ids)."""
    golden = tl.full((), 0x9E3779B97F4A7C15, tl.uint64)
    bits = _mix64(row + cols.to(tl.uint64) * golden)
    u = ((bits >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    gumbel = -_log(-_log(u, LIBDEVICE), LIBDEVICE)
    return tl.where(t <= 0.0, x, tl.math.div_rn(x, tl.where(t <= 0.0, 1.0, t)) + gumbel)


@triton.jit
def _chunk_kernel(logits_ptr, temp_ptr, seed_ptr, pos_ptr, part_val_ptr, part_idx_ptr, vocab, chunks,
                  BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    lane = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    m = cols < vocab
    row = row_hash(tl.load(seed_ptr + lane), tl.load(pos_ptr + lane))
    x = tl.load(logits_ptr + lane * vocab + cols, mask=m, other=0.0)
    val = gumbel_scores(x, tl.load(temp_ptr + lane), row, cols, LIBDEVICE)
    val = tl.where(m, val, float("-inf"))
    best = tl.max(val, 0)
    first = tl.min(tl.where((val == best) & m, cols, vocab), 0)
    tl.store(part_val_ptr + lane * chunks + chunk, best)
    tl.store(part_idx_ptr + lane * chunks + chunk, first)


@triton.jit
def _lane_kernel(part_val_ptr, part_idx_ptr, out_ptr, chunks, CHUNKS: tl.constexpr):
    lane = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    m = c < chunks
    val = tl.load(part_val_ptr + lane * chunks + c, mask=m, other=float("-inf"))
    idx = tl.load(part_idx_ptr + lane * chunks + c, mask=m, other=2147483647)
    best = tl.max(val, 0)
    tl.store(out_ptr + lane, tl.min(tl.where((val == best) & m, idx, 2147483647), 0).to(tl.int64))


def pick(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
         positions: torch.Tensor) -> torch.Tensor:
    """int64 [B]: per lane, argmax of logit / T + Gumbel noise(seed, position, id); the plain
    argmax for lanes with T <= 0. logits float32 [B, V] contiguous; the rest [B] on its device."""
    b, vocab = logits.shape
    chunks = triton.cdiv(vocab, BLOCK)
    part_val = torch.empty((b, chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((b, chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    fast(_chunk_kernel)[(b, chunks)](
        logits, temperature.float().contiguous(), seeds.contiguous(), positions.contiguous(), part_val, part_idx,
        vocab, chunks, BLOCK=BLOCK, LIBDEVICE=LIBDEVICE, num_warps=4)
    fast(_lane_kernel)[(b,)](part_val, part_idx, out, chunks, CHUNKS=triton.next_power_of_2(chunks), num_warps=1)
    return out
