"""Where does a bf16 prefill on real weights leave the fp32 reference? (CUDA)

For one chat prompt on a real model: the last position's logits of every prefill path (fused,
fused unpadded, plain torch ops, transformers) against an fp32 reference; the residual stream
after every layer of the fused and the plain path against fp32; and each fused kernel, layer by
layer, against its torch composition on identical inputs (bit mismatches and error vs fp32).

    python3 tools/diagnose_prefill.py --model PATH.gguf [--dtype bfloat16] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import traceback

import torch
import torch.nn.functional as F

from fgchat.engine.kernels import fused as fk
from fgchat.engine.kernels import gemv
from fgchat.engine.kv_cache import KVCache
from fgchat.engine.devices import DTYPES
from fgchat.engine.loader import load_model
from fgchat.engine.model.decoder import Decoder
from fgchat.engine.model.ops import apply_rope, rms_norm
from fgchat.protocol.tuning import Tuning
from fgchat.engine.model.prefill import bucket_for, causal_attention, prefill, sdpa_causal, heads_first


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bits(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).sum())


def top(lg: torch.Tensor, k: int = 3) -> str:
    v, i = lg.float().topk(k)
    return " ".join(f"{int(t)}:{float(x):.3f}" for t, x in zip(i, v))


def layer_walk(dec: Decoder, ids: torch.Tensor, fused: bool, ref_h: list[torch.Tensor] | None,
               kernel_report: bool) -> list[torch.Tensor]:
    """The decoder's layers over `ids` as prefill runs them; returns h after each layer (with the
    MLP output added). kernel_report: each fused kernel vs torch on the same inputs."""
    c, w = dec.cfg, dec.w
    t = ids.shape[0]
    dev = dec.device
    cos, sin = dec.cos[:t], dec.sin[:t]
    h = F.embedding(ids, w.embed)
    out = []
    for i, lw in enumerate(w.layers):
        x = rms_norm(h, lw.attn_norm, c.rms_eps)
        if fused:
            _, xk = fk.add_rms_norm(h, None, lw.attn_norm, c.rms_eps)
            r_norm = bits(xk, x)
            x = xk
        qkv = F.linear(x, lw.wqkv, lw.bqkv)
        q = apply_rope(qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(qkv[:, c.q_size: c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
        if fused:
            kc = torch.zeros(1, t, c.num_kv_heads, c.head_dim, dtype=dec.dtype, device=dev)
            vc = torch.zeros_like(kc)
            kout = torch.empty(t, c.num_kv_heads, c.head_dim, dtype=dec.dtype, device=dev)
            slots = torch.zeros(1, dtype=torch.int64, device=dev).expand(t)
            qk = fk.rope_kv_write(qkv, dec.cos, dec.sin, torch.arange(t, device=dev), slots, kc, vc,
                                  c.num_heads, c.num_kv_heads, c.head_dim, k_out=kout)
            r_rope = (bits(qk, q), bits(kout, k), bits(vc[0], v))
            a_plain = causal_attention(q, k, v, dec.scale)
            a = sdpa_causal(heads_first(qk), heads_first(kout), heads_first(v), dec.scale)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                a_math = sdpa_causal(heads_first(qk.float()), heads_first(kout.float()),
                                     heads_first(v.float()), dec.scale)
            r_attn = (rel(a, a_math), rel(a_plain, a_math))
            q, k = qk, kout
        else:
            a = causal_attention(q, k, v, dec.scale)
        o = F.linear(a, lw.wo)
        hn = h + o
        x = rms_norm(hn, lw.mlp_norm, c.rms_eps)
        if fused:
            hk, xk = fk.add_rms_norm(h, o, lw.mlp_norm, c.rms_eps)
            r_add = (bits(hk, hn), bits(xk, x))
            hn, x = hk, xk
        gu = F.linear(x, lw.w_gate_up)
        g, u = gu.chunk(2, dim=-1)
        act = F.silu(g) * u
        if fused:
            actk = fk.silu_mul(gu)
            r_silu = bits(actk, act)
            act = actk
        d = F.linear(act, lw.w_down)
        h = hn + d
        out.append(h)
        if kernel_report and fused:
            err = f" h_vs_fp32 {rel(h, ref_h[i]):.2e}" if ref_h is not None else ""
            print(f"  layer {i:2d} bits: norm {r_norm} rope q/k/v {r_rope} add_norm h/x {r_add} silu {r_silu}"
                  f" | attn rel vs fp32 math: sdpa-views {r_attn[0]:.2e} plain {r_attn[1]:.2e}"
                  f" | max|h| {float(h.abs().max()):.0f}{err}")
    return out


def decode_kernels(dec: Decoder, x_rows: torch.Tensor) -> None:
    """The decode step's projection kernels on real activation rows vs F.linear and fp32."""
    w = dec.w
    for i in (0, len(w.layers) // 2, len(w.layers) - 1):
        lw = w.layers[i]
        for name, wt in (("qkv", lw.wqkv), ("o", lw.wo), ("gate_up", lw.w_gate_up), ("down", lw.w_down)):
            xin = x_rows[:, : wt.shape[1]] if x_rows.shape[1] >= wt.shape[1] else None
            if xin is None:
                xin = torch.randn(x_rows.shape[0], wt.shape[1], device=x_rows.device, dtype=x_rows.dtype)
            xin = xin.contiguous()
            ref = F.linear(xin.double(), wt.double())
            y = gemv.project(xin, wt)
            yl = F.linear(xin, wt)
            print(f"  layer {i} {name}: gemv rel {rel(y, ref):.2e}, cuBLAS rel {rel(yl, ref):.2e}, bits {bits(y, yl)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", default="What is the capital of France?")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dt = DTYPES[args.dtype]
    m32 = load_model(args.model, dev, torch.float32)
    m = load_model(args.model, dev, dt)
    ids = torch.tensor(m.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]), device=dev)
    t = ids.shape[0]
    print(f"prompt {t} tokens, bucket {bucket_for(t, 256)}, dtype {args.dtype}")
    ctx = 256
    d32 = Decoder(m32.cfg, m32.weights, ctx, fused=False)
    dfu = Decoder(m.cfg, m.weights, ctx, fused=True)
    dfu_lo = Decoder(m.cfg, m.weights, ctx, fused=True, tuning=Tuning(residual_fp32=False))
    dpl = Decoder(m.cfg, m.weights, ctx, fused=False)
    cache32 = KVCache(m.cfg, ctx, dev, torch.float32)
    cache = KVCache(m.cfg, ctx, dev, dt)
    with torch.inference_mode():
        ref = prefill(d32, ids, 0, cache32.k, cache32.v)
        rows = {
            "fp32 plain": ref,
            "fused (padded)": prefill(dfu, ids, 0, cache.k, cache.v),
            "fused (unpadded)": prefill(dfu, ids, 0, cache.k, cache.v, all_logits=True)[-1],
            "fused, residual in model dtype": prefill(dfu_lo, ids, 0, cache.k, cache.v),
            "plain": prefill(dpl, ids, 0, cache.k, cache.v),
        }
        try:
            from transformers import AutoModelForCausalLM

            from fgchat.engine.model.resolve import resolve_model

            hf = AutoModelForCausalLM.from_pretrained(resolve_model(args.model).path, dtype=dt).to(dev).eval()
            rows["transformers"] = hf(ids[None]).logits[0, -1].float()
            del hf
        except Exception as exc:  # transformers missing or failing: the other rows still tell
            print(f"transformers: {type(exc).__name__}: {exc}")
        print("last-position logits (top-3 id:value), relative error vs fp32:")
        for name, lg in rows.items():
            print(f"  {name:32s} {top(lg)}  rel {rel(lg.float(), ref):.2e}")
        try:
            walks(d32, dpl, dfu, ids, m)
        except Exception:  # the logits above still stand
            traceback.print_exc()


def walks(d32: Decoder, dpl: Decoder, dfu: Decoder, ids: torch.Tensor, m) -> None:
    with torch.inference_mode():
        print("residual after each layer vs fp32 (plain | fused):")
        h32 = layer_walk(d32, ids, False, None, False)
        hpl = layer_walk(dpl, ids, False, None, False)
        print("  " + " ".join(f"{i}:{rel(a, r):.1e}|" for i, (a, r) in enumerate(zip(hpl, h32))))
        print("fused kernels vs torch on the same inputs, per layer:")
        hfu = layer_walk(dfu, ids, True, h32, True)
        print("  fused final rel " + f"{rel(hfu[-1], h32[-1]):.2e}, plain {rel(hpl[-1], h32[-1]):.2e}")
        print("decode projections on real rows:")
        x = rms_norm(hpl[len(hpl) // 2][-8:], m.weights.layers[0].attn_norm, m.cfg.rms_eps).contiguous()
        decode_kernels(dfu, x)


if __name__ == "__main__":
    main()
