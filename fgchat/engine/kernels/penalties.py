"""Repetition, presence and frequency penalties on the device, per sequence slot.

State, allocated once for the engine's lifetime (`alloc_state`), one row per sequence slot:
- counts[NUM_SLOTS, V] int32: how often each vocabulary id was *generated* in the slot's request
  (prompt tokens are not counted);
- prompt_mask[NUM_SLOTS, V] bool: which ids occur in the slot's prompt.

Rules (SamplingParams):
- repetition (transformers' RepetitionPenaltyLogitsProcessor), over prompt and output tokens: a
  seen id's logit is multiplied by `rep` when negative, divided by it otherwise;
- presence / frequency (OpenAI), over output tokens only, applied after repetition, in vLLM's
  order: logit -= frequency * count, then logit -= presence * [count > 0].

Two implementations of `apply_penalties` / `record_tokens`: one Triton kernel each on CUDA, and
plain torch ops elsewhere (the reference; CPU). `use_triton=None` picks by the logits' device.
Measured on an H200 inside a CUDA graph, apply + record per step: 4.7 us (B=1) / 5.5 us (B=8) at
V=49152, 6.5 / 8.5 us at V=151936; the torch composition (~12 launches) takes 35-82 us.

Invariants:
- `apply_penalties` and `record_tokens` are graph-safe: fixed shapes for a batch size, no host
  syncs, no Python branch on tensor values, no allocation outside the caching allocator. They
  can run eagerly or inside a captured CUDA graph over fixed-address slot / penalty tensors.
- A lane with repetition 1, presence 0 and frequency 0 keeps its logits bit for bit
  (x * 1, x / 1, x - 0 are exact in IEEE arithmetic, fused multiply-add or not), whatever the
  slot has seen, in both implementations.
- The repetition rule gives the same bits in both implementations (one IEEE-rounded multiply or
  divide per logit: the kernel divides with div_rn, as torch does); presence / frequency may differ
  by an ulp (the kernel may contract a multiply and subtract into one FMA).
- A slot's rows are valid only between `reset_slot` (at admission, before the first token is
  sampled) and the request's end; a new request in the slot must be `reset_slot` again.
- Lanes of one call use distinct slots (the engine's invariant), so `record_tokens` adds exactly
  one to one counter per lane.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def alloc_state(num_slots: int, vocab: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts int32 [num_slots, vocab], prompt_mask bool [num_slots, vocab]), zeroed."""
    counts = torch.zeros((num_slots, vocab), dtype=torch.int32, device=device)
    prompt_mask = torch.zeros((num_slots, vocab), dtype=torch.bool, device=device)
    return counts, prompt_mask


def reset_slot(counts: torch.Tensor, prompt_mask: torch.Tensor, slot: int,
               prompt_ids: Sequence[int] | torch.Tensor) -> None:
    """Admission (host side, a few small launches; not for graphs): forget the slot's previous
    request, count nothing yet, and mark the ids of `prompt_ids`."""
    counts[slot].zero_()
    row = prompt_mask[slot]
    row.zero_()
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).to(row.device, non_blocking=True)
    if ids.numel():
        row.index_fill_(0, ids.reshape(-1), True)


def _check(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor) -> None:
    """Shapes and layouts only (host metadata, no sync)."""
    if not (logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_contiguous()):
        raise ValueError("logits must be a contiguous float32 [B, V] tensor")
    if counts.shape != prompt_mask.shape or counts.shape[1] != logits.shape[1]:
        raise ValueError(f"penalty state {tuple(counts.shape)} does not fit logits {tuple(logits.shape)}")
    if not (counts.is_contiguous() and prompt_mask.is_contiguous()):
        raise ValueError("penalty state must be contiguous (alloc_state)")


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    slots: torch.Tensor, rep: torch.Tensor, pres: torch.Tensor,
                    freq: torch.Tensor, *, use_triton: bool | None = None, pdl: bool = False) -> None:
    """Penalize `logits` [B, V] float32 (contiguous) in place; lane i uses slot slots[i] (int64
    [B]) and the penalties rep[i], pres[i], freq[i] (float32 [B]), all on the logits' device.
    use_triton None: the Triton kernel on CUDA, torch ops elsewhere. pdl: launch the kernel with
    programmatic dependent launch (engine.pdl), as the step's other kernels."""
    _check(logits, counts, prompt_mask)
    b, vocab = logits.shape
    if b == 0:
        return
    if use_triton if use_triton is not None else logits.is_cuda:
        from fgchat.engine.kernels import penalties_triton

        penalties_triton.apply(logits, counts, prompt_mask, slots, rep, pres, freq, pdl)
    else:
        _apply_torch(logits, counts, prompt_mask, slots, rep, pres, freq)


def _apply_torch(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                 slots: torch.Tensor, rep: torch.Tensor, pres: torch.Tensor, freq: torch.Tensor) -> None:
    c = counts.index_select(0, slots)  # [B, V] int32
    seen = prompt_mask.index_select(0, slots) | (c > 0)
    r = rep.to(logits.dtype).unsqueeze(1)
    out = torch.where(seen, torch.where(logits < 0, logits * r, logits / r), logits)
    cf = c.to(logits.dtype)
    out = out - freq.to(logits.dtype).unsqueeze(1) * cf
    out = out - pres.to(logits.dtype).unsqueeze(1) * (c > 0).to(logits.dtype)
    logits.copy_(out)


def record_tokens(counts: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, *,
                  use_triton: bool | None = None, pdl: bool = False) -> None:
    """counts[slots[i], tokens[i]] += 1 for every lane i (slots, tokens: int64 [B] on the device,
    distinct slots). use_triton / pdl: as for apply_penalties."""
    b = tokens.shape[0]
    if b == 0:
        return
    if use_triton if use_triton is not None else counts.is_cuda:
        from fgchat.engine.kernels import penalties_triton

        penalties_triton.record(counts, slots, tokens, pdl)
        return
    flat = slots * counts.shape[1] + tokens.to(slots.dtype)  # counts is contiguous (alloc_state)
    counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype))
