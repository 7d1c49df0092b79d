"""The verification forward: each sequence's last accepted token and its drafts, at their
positions after the rows its slot holds, through the target in one pass; logits at every row.

Each row attends to the slot's cached rows and causally to the rows before it in its own block
(the prefill-after-cached-rows path of model.prefill). The K/V rows it writes for drafts that are
rejected stay in the cache past the sequence's length: nothing reads a position >= a sequence's
length, and the next step writes them again before any row attends to them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fgchat.engine.model.prefill import _fused_layers, _unfused_rows, final_logits

if TYPE_CHECKING:
    from fgchat.engine.model.decoder import Decoder


def verify_logits(dec: Decoder, blocks: list[tuple[list[int], int, int]], k_caches: list[torch.Tensor],
                  v_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """blocks [(token ids, first position, slot)] -> float32 logits [len(ids), V] per block: row r
    is the target's prediction for position first + r + 1."""
    dev = dec.device
    if any(first + len(ids) > k_caches[0].shape[1] for ids, first, _ in blocks):
        raise ValueError("a verification block does not fit the cache")
    if not dec.fused:
        prompts = [(torch.tensor(ids, dtype=torch.int64, device=dev), slot) for ids, _, slot in blocks]
        h, _ = _unfused_rows(dec, prompts, k_caches, v_caches, first=[f for _, f, _ in blocks])
        logits = dec.norm_logits(h)
        return list(logits.split([len(ids) for ids, _, _ in blocks]))
    out = []
    for ids, first, slot in blocks:  # fused (CUDA) eager path: one block after its slot's rows
        t = len(ids)
        pos = torch.arange(first, first + t, dtype=torch.int64, device=dev)
        slots = torch.full((t,), slot, dtype=torch.int64, device=dev)
        h, delta = _fused_layers(dec, torch.tensor(ids, dtype=torch.int64, device=dev), pos, slots, None,
                                 k_caches, v_caches, after=(slot, first))
        out.append(final_logits(dec, h, delta))
    return out
