"""Prefill: one prompt of T tokens through the decoder into its KV-cache slot (eager).

Two paths, chosen by `dec.fused`:
- unfused (CPU, or fused=False): plain torch ops, the reference the CPU tests compare with
  transformers;
- fused (CUDA with Triton): the decode stages' Triton kernels over all T rows — add_rms_norm
  (which also adds the previous sublayer's output into the residual), rope_kv_write (RoPE of q
  and k, and the K/V cache write) and silu_mul — so a layer is ~10 launches instead of ~40.

Attention is causal SDPA over the slot's cache rows [0, T) (fused) or the fresh k/v (unfused),
as strided views (one as_strided each), with no copies. In bf16/fp16 the grouped heads go to
SDPA as they are (enable_gqa=True): both fused CUDA backends that take grouped heads, flash
and cuDNN, are eligible for these views, and on an H200 with torch 2.11 the default dispatch
picks cuDNN's flash-style kernel (measured by scripts/profile_prefill.py: ~8.5 us a layer at
T=512, as fast as flash forced, and no head expansion). Float32 is eligible for neither, and
enable_gqa would fall back to the math backend, so there K/V heads are expanded first and the
efficient kernel runs.

No host syncs: T, the slot and all shapes are host ints; positions and slots are made on the
device once per call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fgchat.engine.model.decoder import apply_rope, rms_norm

if TYPE_CHECKING:
    from fgchat.engine.model.decoder import Decoder

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def prefill(
    dec: Decoder,
    ids: torch.Tensor,
    slot: int,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    all_logits: bool = False,
) -> torch.Tensor:
    """Positions 0..T-1 of cache slot `slot`; returns last logits [V] or all [T, V] (float32)."""
    if dec.fused:
        return _prefill_fused(dec, ids, slot, k_caches, v_caches, all_logits)
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


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] (any strides) -> the [1, H, T, D] view SDPA takes, in one op."""
    t, h, d = x.shape
    s0, s1, s2 = x.stride()
    return x.as_strided((1, h, t, d), (t * s0, s1, s0, s2))


def cache_heads_first(cache: torch.Tensor, slot: int, t: int) -> torch.Tensor:
    """Rows [0, t) of one slot of a [S, T, Hkv, D] cache as a [1, Hkv, t, D] view, in one op."""
    s0, s1, s2, s3 = cache.stride()
    return cache.as_strided((1, cache.shape[2], t, cache.shape[3]), (s0, s2, s1, s3),
                            cache.storage_offset() + slot * s0)


def sdpa_causal(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of [1, Hq, T, D] over [1, Hkv, T, D] -> [T, Hq*D].

    bf16/fp16 pass the grouped heads to SDPA (enable_gqa); float32 GQA expands K/V heads first,
    since no fused backend takes grouped float32 heads and enable_gqa would run the math one.
    """
    _, hq, t, d = q4.shape
    hkv = k4.shape[1]
    gqa = hq != hkv
    if gqa and q4.dtype not in _FLASH_DTYPES:
        g = hq // hkv
        k4 = k4[:, :, None].expand(1, hkv, g, t, d).reshape(1, hq, t, d)
        v4 = v4[:, :, None].expand(1, hkv, g, t, d).reshape(1, hq, t, d)
        gqa = False
    a = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)
    if a.stride() == (t * hq * d, d, hq * d, 1):  # [1, T, Hq, D] memory (flash, cuDNN): a view
        return a.as_strided((t, hq * d), (hq * d, 1))
    return a.transpose(1, 2).reshape(t, hq * d)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (any strides with a unit last stride) -> [T, Hq*D]."""
    return sdpa_causal(heads_first(q), heads_first(k), heads_first(v), scale)


def _prefill_fused(
    dec: Decoder,
    ids: torch.Tensor,
    slot: int,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    all_logits: bool,
) -> torch.Tensor:
    """The fused path: per layer add_rms_norm, qkv, rope_kv_write, SDPA, wo, add_rms_norm,
    gate_up, silu_mul, down. The MLP output stays in `delta` until the next add_rms_norm adds it.
    """
    from fgchat.engine import fused as fk

    c, w = dec.cfg, dec.w
    t = ids.shape[0]
    # the kernel writes rows unchecked: keep them inside the slot (host ints, no sync)
    if t > k_caches[0].shape[1] or t > dec.cos.shape[0]:
        raise ValueError(f"prompt of {t} tokens exceeds the context of {k_caches[0].shape[1]}")
    if not 0 <= slot < k_caches[0].shape[0]:
        raise ValueError(f"slot {slot} out of range")
    dev = dec.device
    pos = torch.arange(t, dtype=torch.int64, device=dev)
    slots = torch.full((t,), slot, dtype=torch.int64, device=dev)
    h = F.embedding(ids, w.embed)
    delta: torch.Tensor | None = None
    for i, lw in enumerate(w.layers):
        kc, vc = k_caches[i], v_caches[i]
        h, x = fk.add_rms_norm(h, delta, lw.attn_norm, c.rms_eps)
        qkv = F.linear(x, lw.wqkv, lw.bqkv)
        q = fk.rope_kv_write(qkv, dec.cos, dec.sin, pos, slots, kc, vc,
                             c.num_heads, c.num_kv_heads, c.head_dim)
        # attend over the rows just written: the slot's cache [0, T) holds exactly RoPE'd k and v
        a = sdpa_causal(heads_first(q), cache_heads_first(kc, slot, t),
                        cache_heads_first(vc, slot, t), dec.scale)
        h, x = fk.add_rms_norm(h, F.linear(a, lw.wo), lw.mlp_norm, c.rms_eps)
        delta = F.linear(fk.silu_mul(F.linear(x, lw.w_gate_up)), lw.w_down)
    if not all_logits:
        h, delta = h[-1:], delta[-1:] if delta is not None else None
    _, x = fk.add_rms_norm(h, delta, w.final_norm, c.rms_eps)
    logits = F.linear(x, w.lm_head).float()
    return logits if all_logits else logits[0]
