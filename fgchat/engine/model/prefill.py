"""Prefill: one prompt of T tokens through the decoder into its KV-cache slot (eager)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fgchat.engine.model.decoder import apply_rope, rms_norm

if TYPE_CHECKING:
    from fgchat.engine.model.decoder import Decoder


def prefill(
    dec: Decoder,
    ids: torch.Tensor,
    slot: int,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    all_logits: bool = False,
) -> torch.Tensor:
    """Positions 0..T-1 of cache slot `slot`; returns last logits [V] or all [T, V] (float32)."""
    c, w = dec.cfg, dec.w
    t = ids.shape[0]
    pos = torch.arange(t, device=dec.device)
    cos, sin = dec.cos[:t], dec.sin[:t]
    h = F.embedding(ids, w.embed)
    for i, lw in enumerate(w.layers):
        x = rms_norm(h, lw.attn_norm, c.rms_eps)
        qkv = F.linear(x, lw.wqkv, lw.bqkv)
        q = apply_rope(qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim), cos, sin)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
        k = apply_rope(k, cos, sin)
        v = qkv[:, c.q_size + c.kv_size :].view(t, c.num_kv_heads, c.head_dim)
        k_caches[i][slot, pos] = k
        v_caches[i][slot, pos] = v
        a = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=dec.scale,
            enable_gqa=c.num_heads != c.num_kv_heads,
        )[0].transpose(0, 1)
        h = h + F.linear(a.reshape(t, c.q_size), lw.wo)
        x = rms_norm(h, lw.mlp_norm, c.rms_eps)
        g, u = F.linear(x, lw.w_gate_up).chunk(2, dim=-1)
        h = h + F.linear(F.silu(g) * u, lw.w_down)
    x = rms_norm(h if all_logits else h[-1:], w.final_norm, c.rms_eps)
    logits = F.linear(x, w.lm_head).float()
    return logits if all_logits else logits[0]
