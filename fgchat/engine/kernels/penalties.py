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

Invariants:
- `apply_penalties` and `record_tokens` are graph-safe: fixed shapes for a batch size, no host
  syncs, no Python branch on tensor values, no allocation outside the caching allocator. They
  can run eagerly or inside a captured CUDA graph over fixed-address slot / penalty tensors.
- A lane with repetition 1, presence 0 and frequency 0 keeps its logits bit for bit
  (x * 1, x / 1, x - 0 are exact in IEEE arithmetic), whatever the slot has seen.
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


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    slots: torch.Tensor, rep: torch.Tensor, pres: torch.Tensor,
                    freq: torch.Tensor) -> None:
    """Penalize `logits` [B, V] float32 in place; lane i uses slot slots[i] (int64 [B]) and the
    penalties rep[i], pres[i], freq[i] (float32 [B], on the device)."""
    c = counts.index_select(0, slots)  # [B, V] int32
    seen = prompt_mask.index_select(0, slots) | (c > 0)
    r = rep.to(logits.dtype).unsqueeze(1)
    out = torch.where(seen, torch.where(logits < 0, logits * r, logits / r), logits)
    cf = c.to(logits.dtype)
    out = out - freq.to(logits.dtype).unsqueeze(1) * cf
    out = out - pres.to(logits.dtype).unsqueeze(1) * (c > 0).to(logits.dtype)
    logits.copy_(out)


def record_tokens(counts: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """counts[slots[i], tokens[i]] += 1 for every lane i (slots, tokens: int64 [B] on the device)."""
    ones = torch.ones_like(tokens, dtype=counts.dtype)
    counts.index_put_((slots, tokens.to(slots.dtype)), ones, accumulate=True)
