"""The Triton kernels of kernels.penalties (CUDA; imported only when they run, so a machine
without Triton imports the engine). Same rules and invariants as penalties.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fgchat.engine.kernels.launch import fast
from fgchat.engine.kernels.pdl import pdl_enter

BLOCK = 2048


@triton.jit
def _apply_kernel(logits_ptr, counts_ptr, mask_ptr, slots_ptr, rep_ptr, pres_ptr, freq_ptr, vocab,
                  BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Program (lane, block of the vocabulary): the torch composition of _apply_torch."""
    lane = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = cols < vocab
    pdl_enter(USE_PDL)
    slot = tl.load(slots_ptr + lane).to(tl.int64)
    r = tl.load(rep_ptr + lane)
    pres = tl.load(pres_ptr + lane)
    freq = tl.load(freq_ptr + lane)
    x = tl.load(logits_ptr + lane * vocab + cols, mask=m, other=0.0)
    c = tl.load(counts_ptr + slot * vocab + cols, mask=m, other=0)
    pm = tl.load(mask_ptr + slot * vocab + cols, mask=m, other=0)
    out_seen = c > 0
    seen = (pm != 0) | out_seen
    x = tl.where(seen, tl.where(x < 0, x * r, tl.math.div_rn(x, r)), x)
    x = x - freq * c.to(tl.float32)
    x = x - pres * out_seen.to(tl.float32)
    tl.store(logits_ptr + lane * vocab + cols, x, mask=m)


@triton.jit
def _record_kernel(counts_ptr, slots_ptr, tokens_ptr, vocab, USE_PDL: tl.constexpr = False):
    lane = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL)
    slot = tl.load(slots_ptr + lane).to(tl.int64)
    tok = tl.load(tokens_ptr + lane).to(tl.int64)
    ptr = counts_ptr + slot * vocab + tok
    tl.store(ptr, tl.load(ptr) + 1)  # lanes use distinct slots: no two programs share a counter


def apply(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, slots: torch.Tensor,
          rep: torch.Tensor, pres: torch.Tensor, freq: torch.Tensor, pdl: bool) -> None:
    b, vocab = logits.shape
    fast(_apply_kernel)[(b, triton.cdiv(vocab, BLOCK))](
        logits, counts, prompt_mask.view(torch.uint8), slots, rep, pres, freq, vocab,
        BLOCK=BLOCK, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)


def record(counts: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, pdl: bool) -> None:
    fast(_record_kernel)[(tokens.shape[0],)](counts, slots, tokens, counts.shape[1], USE_PDL=pdl,
                                             num_warps=1, launch_pdl=pdl)
