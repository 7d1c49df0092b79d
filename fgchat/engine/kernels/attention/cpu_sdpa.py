"""Decode attention for eager CPU steps: torch's scaled_dot_product_attention over the cache
window that holds every lane's tokens.

CPU steps are never captured in a graph, so this backend may use the host-side length bound
(max_len_hint) and the host's view of the slots. Lengths enter as a boolean mask; a lane with
no positions (seq_len == 0) yields zeros, as in the reference backend (torch_ref), which the
tests compare this one with.

Half-precision caches are attended in float32 (copies of the lane's K/V window): torch's CPU
kernel for bf16 took 60 / 277 / 1089 us per layer at 100 / 500 / 2000 positions (SmolLM2's 9 q
and 3 kv heads, 2 AMD EPYC cores) where the float32 copies and the float32 kernel took 41 / 107 /
340, with a smaller error against float64. Several lanes share one call over a window padded to
the longest; each shorter lane's tail in the copies is zeroed by one contiguous fill per lane.
From PER_LANE_WINDOW positions up each lane's own positions are converted straight into the
float32 window (no half-precision gather of whole windows first): fewer bytes moved, more calls,
so it pays only on long windows (embedded model, bf16, batch 8: -4.4 ms a step at ~1000 positions,
+0.5 ms at ~300; notes V68).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fgchat.engine.kernels.attention.base import DecodeAttention, cache_window, check_decode_shapes

PER_LANE_WINDOW = 512


class SdpaDecodeAttention(DecodeAttention):
    name = "sdpa"

    def __call__(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_ids: Tensor,
        seq_lens: Tensor,
        out: Tensor,
        scale: float,
        max_len_hint: int | None = None,
    ) -> None:
        batch, num_q_heads, num_kv_heads, head_dim, max_context = check_decode_shapes(
            q, k_cache, v_cache, slot_ids, seq_lens, out
        )
        if q.device.type != "cpu":
            raise ValueError("the sdpa decode backend serves CPU steps only")
        gqa = num_q_heads != num_kv_heads
        if batch == 1:
            # the lane's own positions, as views of its slot: no copy and nothing to mask
            n = min(int(seq_lens[0]), max_context)
            if n <= 0:
                out.zero_()
                return
            slot = int(slot_ids[0])
            # .float(): a copy of a half-precision tensor, a float32 one as it is
            k = k_cache[slot, :n].transpose(0, 1)[None].float()  # [1, Hkv, n, D]
            v = v_cache[slot, :n].transpose(0, 1)[None].float()
            result = F.scaled_dot_product_attention(q.unsqueeze(2).float(), k, v, scale=scale, enable_gqa=gqa)
            out.copy_(result.view(batch, num_q_heads, head_dim))
            return
        window = cache_window(max_context, max_len_hint)
        idx = slot_ids.long()
        lens = seq_lens.long()
        valid = torch.arange(window, device=q.device)[None, :] < lens[:, None]  # [B, W]
        # float32 copies of the lanes' windows [B, W, Hkv, D]; positions past a lane's length may
        # hold anything (the CPU cache is not zeroed, a fresh buffer neither): each lane's tail is
        # zeroed before it can reach a product, one contiguous fill per lane (a broadcast
        # masked_fill over the whole window took 1.1 ms a call at 1000 positions, batch 8)
        if window >= PER_LANE_WINDOW:
            k = torch.empty((batch, window, num_kv_heads, head_dim), dtype=torch.float32)
            v = torch.empty_like(k)
            for lane, (slot, n) in enumerate(zip(idx.tolist(), lens.tolist())):
                n = max(min(n, window), 0)
                k[lane, :n].copy_(k_cache[slot, :n])
                v[lane, :n].copy_(v_cache[slot, :n])
        else:
            k = k_cache[:, :window].index_select(0, idx).float()
            v = v_cache[:, :window].index_select(0, idx).float()
        for lane, n in enumerate(lens.tolist()):
            if n < window:
                k[lane, max(n, 0):].zero_()
                v[lane, max(n, 0):].zero_()
        result = F.scaled_dot_product_attention(
            q.unsqueeze(2).float(), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=gqa,
        ).view(batch, num_q_heads, head_dim)
        # a lane without positions has an all-False mask (NaN row): it attends to nothing
        out.copy_(torch.where((lens > 0)[:, None, None], result, torch.zeros((), dtype=result.dtype)))

