"""The verification step's rows, and the verification forward the draft model runs.

The target verifies as a decode step over B x block rows (step.StepProgram.pieces with block =
k + 1, in the engine's mode): row (b, j) holds sequence b's last accepted token (j = 0) or its
draft j at position len_b - 1 + j of its slot, and attends causally within its block through its
own length. `verify_logits` runs the same rows through the prefill-after-cached-rows path of
model.prefill, eagerly: the K/V rows alone for a draft model's catch-up longer than its step's
block, and logits as tests' reference.

The K/V rows written for drafts that are rejected stay in the cache past the sequence's length:
nothing reads a position >= a sequence's length, and the next step writes them again before any
row attends to them. Lengths roll back with no device work: every step's per-row lengths are its
positions + 1, staged from the host's accepted lengths."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fgchat.engine.model.prefill import _fused_layers, _unfused_rows, final_logits

if TYPE_CHECKING:
    from fgchat.engine.model.decoder import Decoder


def block_rows(lasts: list[int], drafts: list[list[int]], lengths: list[int], slots: list[int],
               max_context: int, block: int = 1) -> tuple[list[int], list[int], list[int], int]:
    """(ids, positions, slots, block) of a verification step's rows: block = the larger of
    `block` and 1 + the most drafts any sequence has; sequence b's rows are b * block + j. A
    sequence with fewer drafts fills its block with its last real row's token at the positions
    after it (clamped to the cache's last row): their outputs are ignored, and their K/V land past
    every row the sequence reads before it writes them again."""
    block = max(block, 1 + max((len(d) for d in drafts), default=0))
    ids: list[int] = []
    pos: list[int] = []
    out_slots: list[int] = []
    for last, d, n, slot in zip(lasts, drafts, lengths, slots):
        toks = [last] + d
        toks += [toks[-1]] * (block - len(toks))
        ids += toks
        pos += [min(n - 1 + j, max_context - 1) for j in range(block)]
        out_slots += [slot] * block
    return ids, pos, out_slots, block


def verify_logits(dec: Decoder, blocks: list[tuple[list[int], int, int]], k_caches: list[torch.Tensor],
                  v_caches: list[torch.Tensor], logits: bool = True) -> list[torch.Tensor]:
    """blocks [(token ids, first position, slot)] -> float32 logits [len(ids), V] per block: row r
    is the model's prediction for position first + r + 1. logits=False: the K/V rows alone (the
    last layer runs on each block's last row; nothing is returned)."""
    dev = dec.device
    if any(first + len(ids) > k_caches[0].shape[1] for ids, first, _ in blocks):
        raise ValueError("a verification block does not fit the cache")
    if not dec.fused:
        prompts = [(torch.tensor(ids, dtype=torch.int64, device=dev), slot) for ids, _, slot in blocks]
        h, _ = _unfused_rows(dec, prompts, k_caches, v_caches, first=[f for _, f, _ in blocks], last_only=not logits)
        return list(dec.norm_logits(h).split([len(ids) for ids, _, _ in blocks])) if logits else []
    out = []
    for ids, first, slot in blocks:  # fused (CUDA) eager path: one block after its slot's rows
        t = len(ids)
        pos = torch.arange(first, first + t, dtype=torch.int64, device=dev)
        slots = torch.full((t,), slot, dtype=torch.int64, device=dev)
        keep = None if logits else torch.tensor([t - 1], dtype=torch.int64, device=dev)
        h, delta = _fused_layers(dec, torch.tensor(ids, dtype=torch.int64, device=dev), pos, slots, None,
                                 k_caches, v_caches, after=(slot, first), keep=keep)
        if logits:
            out.append(final_logits(dec, h, delta))
    return out
