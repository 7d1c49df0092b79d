"""Reference decode attention in plain PyTorch (fp32 matmul + softmax). Runs on CPU and CUDA.

This is the oracle the tests compare other backends with, so it favours clarity over speed.
Graph safety with max_len_hint=None: every shape is fixed by (B, Hq, D, T); lengths enter only
as a device-side mask, and slots only through index_select on a device tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fgchat.engine.kernels.attention.base import DecodeAttention, cache_window, check_decode_shapes


class TorchDecodeAttention(DecodeAttention):
    name = "torch"

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
        window: int = 0,
    ) -> None:
        batch, num_q_heads, num_kv_heads, head_dim, max_context = check_decode_shapes(
            q, k_cache, v_cache, slot_ids, seq_lens, out
        )
        group = num_q_heads // num_kv_heads
        # The hint only shortens the window we look at (eager CPU decode with a large T stays
        # cheap); positions beyond it are masked anyway, so a correct hint never changes the result.
        sliding, window = window, cache_window(max_context, max_len_hint)

        idx = slot_ids.long()
        k = k_cache[:, :window].index_select(0, idx).float()  # [B, W, Hkv, D]
        v = v_cache[:, :window].index_select(0, idx).float()
        qg = q.float().view(batch, num_kv_heads, group, head_dim)

        positions = torch.arange(window, device=q.device)
        valid = positions[None, :] < seq_lens.long()[:, None]  # [B, W]
        if sliding > 0:  # a sliding-window layer: the last `sliding` positions only
            valid = valid & (positions[None, :] >= seq_lens.long()[:, None] - sliding)

        scores = torch.einsum("bhgd,bwhd->bhgw", qg, k) * scale
        # masked_fill also replaces NaN scores from garbage K beyond seq_len.
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        # A lane with seq_len == 0 has row_max == -inf; use 0 so its weights are exp(-inf) = 0.
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(scores - row_max)
        denom = weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        # Zero V beyond seq_len too: 0 * NaN would otherwise poison the sum.
        v = v.masked_fill(~valid[:, :, None, None], 0.0)
        result = torch.einsum("bhgw,bwhd->bhgd", weights / denom, v)
        out.copy_(result.reshape(batch, num_q_heads, head_dim))
