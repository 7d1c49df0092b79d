"""The float32 reference forward pass: plain torch ops, no Triton, every product in float32.

Used by the start-up check (engine.startup_check) on the user's own weights, whatever dtype the
engine runs in. Weights stay in the engine's dtype; each layer's weights are upcast only while
that layer runs, and the LM head in row chunks, so the check needs little memory beyond the
engine's own. The residual stream, norms, RoPE, attention and MLP run in float32 throughout.
Quantized weights (quant.qweight) enter as their dequantized float32 values (quant.dequant):
exactly the numbers the file or the quantizer holds; the embedding dequantizes only the rows it
looks up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fgchat.engine.model.config import ModelConfig
from fgchat.engine.model import family_reference
from fgchat.engine.model.decoder import DecoderWeights, LayerWeights
from fgchat.engine.model.families import uses_family_stages
from fgchat.engine.model.ops import apply_rope, rms_norm
from fgchat.engine.quant.dequant import dense, dense_rows

HEAD_CHUNK_ROWS = 16384


def _qkv(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k and v [N, Hkv, D] of the residual h [N, H], before RoPE, in float32."""
    f, n = torch.float32, h.shape[0]
    x = rms_norm(h, lw.attn_norm.to(f), cfg.rms_eps)
    qkv = F.linear(x, dense(lw.wqkv, f), None if lw.bqkv is None else lw.bqkv.to(f))
    q = qkv[:, : cfg.q_size].view(n, cfg.num_heads, cfg.head_dim)
    k = qkv[:, cfg.q_size: cfg.q_size + cfg.kv_size].view(n, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, cfg.q_size + cfg.kv_size:].view(n, cfg.num_kv_heads, cfg.head_dim)
    return q, k, v


def _finish_layer(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The residual after the o projection of attn [N, Hq * D] and the MLP, in float32."""
    f = torch.float32
    h = h + F.linear(attn, dense(lw.wo, f))
    x = rms_norm(h, lw.mlp_norm.to(f), cfg.rms_eps)
    g, u = F.linear(x, dense(lw.w_gate_up, f)).chunk(2, dim=-1)
    return h + F.linear(F.silu(g) * u, dense(lw.w_down, f))


def _logits(cfg: ModelConfig, w: DecoderWeights, h: torch.Tensor) -> torch.Tensor:
    """The final norm and the LM head (upcast in row chunks) of the residual h [N, H]."""
    f = torch.float32
    x = rms_norm(h, w.final_norm.to(f), cfg.rms_eps)
    head = w.lm_head
    return torch.cat([F.linear(x, dense_rows(head, slice(r, r + HEAD_CHUNK_ROWS), f))
                      for r in range(0, head.shape[0], HEAD_CHUNK_ROWS)], dim=1)


@torch.inference_mode()
def reference_logits(cfg: ModelConfig, w: DecoderWeights, ids: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 logits [T, V] of the token ids [T] at positions 0..T-1 (causal attention).
    cos/sin: the decoder's RoPE tables [>= T, D] (any dtype; taken as float32). Qwen3 / Gemma 3 /
    Phi-3: model.family_reference, with its own float32 tables and scale."""
    if uses_family_stages(cfg):
        return family_reference.reference_logits(cfg, w, ids)
    t = ids.shape[0]
    f = torch.float32
    cos, sin = cos[:t].to(f), sin[:t].to(f)
    h = dense_rows(w.embed, ids, f)
    groups = cfg.num_heads // cfg.num_kv_heads
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
    for lw in w.layers:
        q, k, v = _qkv(cfg, lw, h)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        h = _finish_layer(cfg, lw, h, torch.einsum("hqk,khd->qhd", p, v).reshape(t, cfg.q_size))
    return _logits(cfg, w, h)


@torch.inference_mode()
def reference_decode_step(cfg: ModelConfig, w: DecoderWeights, ids: list[int], positions: list[int],
                          slots: list[int], k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                          cos: torch.Tensor, sin: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 logits [B, V] of one decode step: row r is token ids[r] at position positions[r] of
    slot slots[r]; it attends over that slot's cached rows [0, position) (k_cache[layer] [slots,
    T, Hkv, D], upcast) and its own k/v, computed here in float32. The cache is only read."""
    if uses_family_stages(cfg):
        return family_reference.reference_decode_step(cfg, w, ids, positions, slots, k_cache, v_cache)
    f = torch.float32
    dev = w.final_norm.device
    pos = torch.tensor(positions, dtype=torch.int64, device=dev)
    cos, sin = cos[pos].to(f), sin[pos].to(f)
    h = dense_rows(w.embed, torch.tensor(ids, dtype=torch.int64, device=dev), f)
    groups = cfg.num_heads // cfg.num_kv_heads
    for lw, kc, vc in zip(w.layers, k_cache, v_cache):
        q, k, v = _qkv(cfg, lw, h)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rows = []
        for r, (s, t) in enumerate(zip(slots, positions)):
            keys = torch.cat((kc[s, :t].to(f), k[r: r + 1])).repeat_interleave(groups, dim=1)  # [t+1, Hq, D]
            vals = torch.cat((vc[s, :t].to(f), v[r: r + 1])).repeat_interleave(groups, dim=1)
            p = (torch.einsum("hd,thd->ht", q[r], keys) * scale).softmax(-1)
            rows.append(torch.einsum("ht,thd->hd", p, vals).reshape(cfg.q_size))
        h = _finish_layer(cfg, lw, h, torch.stack(rows))
    return _logits(cfg, w, h)
