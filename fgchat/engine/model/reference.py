"""The float32 reference forward pass: plain torch ops, no Triton, every product in float32.

Used by the start-up check (engine.startup_check) on the user's own weights, whatever dtype the
engine runs in. Weights stay in the engine's dtype; each layer's weights are upcast only while
that layer runs, and the LM head in row chunks, so the check needs little memory beyond the
engine's own. The residual stream, norms, RoPE, attention and MLP run in float32 throughout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fgchat.engine.model.config import ModelConfig
from fgchat.engine.model.decoder import DecoderWeights
from fgchat.engine.model.ops import apply_rope, rms_norm

HEAD_CHUNK_ROWS = 16384


@torch.inference_mode()
def reference_logits(cfg: ModelConfig, w: DecoderWeights, ids: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 logits [T, V] of the token ids [T] at positions 0..T-1 (causal attention).
    cos/sin: the decoder's RoPE tables [>= T, D] (any dtype; taken as float32)."""
    t = ids.shape[0]
    f = torch.float32
    cos, sin = cos[:t].to(f), sin[:t].to(f)
    h = F.embedding(ids, w.embed).to(f)
    groups = cfg.num_heads // cfg.num_kv_heads
    for lw in w.layers:
        x = rms_norm(h, lw.attn_norm.to(f), cfg.rms_eps)
        qkv = F.linear(x, lw.wqkv.to(f), None if lw.bqkv is None else lw.bqkv.to(f))
        q = qkv[:, : cfg.q_size].view(t, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size: cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        a = torch.einsum("hqk,khd->qhd", p, v).reshape(t, cfg.q_size)
        h = h + F.linear(a, lw.wo.to(f))
        x = rms_norm(h, lw.mlp_norm.to(f), cfg.rms_eps)
        g, u = F.linear(x, lw.w_gate_up.to(f)).chunk(2, dim=-1)
        h = h + F.linear(F.silu(g) * u, lw.w_down.to(f))
    x = rms_norm(h, w.final_norm.to(f), cfg.rms_eps)
    head = w.lm_head
    return torch.cat([F.linear(x, head[r: r + HEAD_CHUNK_ROWS].to(f))
                      for r in range(0, head.shape[0], HEAD_CHUNK_ROWS)], dim=1)
