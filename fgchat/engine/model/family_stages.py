"""The plain decode stages and prefill of Qwen3, Gemma 3 and Phi-3 (model.families): what the
Decoder runs for them in every mode, in place of its Llama stages (installed once, at
construction), except on the fused path where it serves them (model.fused_step,
families.fused_serves; their fused prefill's windowed attention is here). Same stage contract as
the Llama ones: no host syncs, no branches on values, so
the piecewise and full graphs capture them as they are. A windowed layer's attention takes its
window as an argument of the attention call (the backends start at max(0, len - window) on the
device), so one graph serves every length."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fgchat.engine.model import families as fam
from fgchat.engine.model import quant_ops
from fgchat.engine.model.ops import signed_sin

if TYPE_CHECKING:
    from fgchat.engine.kernels.gemv import SampleArgs
    from fgchat.engine.model.decoder import Decoder, StepState


class FamilyStages:
    """Per decoder: the norms' prepared weights, the RoPE tables in the model's dtype, the
    windows, and the stages that read them."""

    def __init__(self, dec: Decoder) -> None:
        if dec.fused:
            raise ValueError(f"{dec.cfg.architecture} runs on plain torch stages only (families.fused_note)")
        c, w = dec.cfg, dec.w
        self.dec, self.cfg = dec, c
        if w.family is None or len(w.family) != c.num_layers:
            raise ValueError("family weights are missing")
        self.norm = fam.norm_fn(c)
        nw = lambda t: None if t is None else fam.norm_weight(c, t)  # noqa: E731
        self.attn_norm = [nw(lw.attn_norm) for lw in w.layers]
        self.mlp_norm = [nw(lw.mlp_norm) for lw in w.layers]
        self.q_norm = [nw(f.q_norm) for f in w.family]
        self.k_norm = [nw(f.k_norm) for f in w.family]
        self.post_attn = [nw(f.post_attn_norm) for f in w.family]
        self.post_mlp = [nw(f.post_mlp_norm) for f in w.family]
        self.final_norm = nw(w.final_norm)
        self.act = fam.activation(c)
        self.embed_scale = fam.embed_scale(c, dec.dtype, dec.device)
        self.tables = []  # per table: cos, signed sin [T, rot] in the model's dtype
        for cos, sin in fam.rope_tables(c, dec.max_context):
            cos, sin = cos.to(dec.device, dec.dtype), sin.to(dec.device, dec.dtype)
            self.tables.append((cos, signed_sin(sin)))
        # LongRoPE: a prompt that ends past the original context rotates every row by the long factors
        self.cut = fam.longrope_cut(c)
        long = fam.long_table(c, dec.max_context)
        self.long = None if long is None else (long[0].to(dec.device, dec.dtype),
                                               signed_sin(long[1].to(dec.device, dec.dtype)))
        self.layer_table = [fam.layer_table(c, i) for i in range(c.num_layers)]
        self.windows = [fam.layer_window(c, i) for i in range(c.num_layers)]

    def install(self) -> None:
        """Replace the decoder's Llama stages with these (instance attributes: no per-step branch)."""
        d = self.dec
        d.embed, d.before_attention, d.after_attention = self.embed, self.before_attention, self.after_attention
        d.head, d.head_logits, d.norm_logits = self.head, self.head_logits, self.norm_logits
        d.scale = fam.attention_scale(self.cfg)
        d.layer_windows = self.windows
        d.family = self

    # ---- decode stages ----
    def embed(self, st: StepState, input_ids: torch.Tensor) -> None:
        st.h = self.embed_rows(input_ids)
        st.delta = None

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        h = quant_ops.embedding(ids, self.dec.w.embed)
        return h if self.embed_scale is None else h * self.embed_scale

    def qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's q [N, Hq, D] and k [N, Hkv, D] (q/k-normed and rotated) and v of the residual
        rows h, whose RoPE rows are cos / ssin [N, rot]."""
        c, n = self.cfg, h.shape[0]
        qkv = self.dec.project(self.norm(h, self.attn_norm[i]), i, "qkv")
        q = qkv[:, : c.q_size].view(n, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size: c.q_size + c.kv_size].view(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].view(n, c.num_kv_heads, c.head_dim)
        if self.q_norm[i] is not None:
            q, k = self.norm(q, self.q_norm[i]), self.norm(k, self.k_norm[i])
        return fam.apply_rope_part(q, cos, ssin), fam.apply_rope_part(k, cos, ssin), v

    def before_attention(self, i: int, st: StepState, positions: torch.Tensor, slot_ids: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if i == 0 or st.rope is None:  # this step's rows of every table, taken once
            st.rope = tuple(t for cos, ssin in self.tables for t in (cos[positions], ssin[positions]))
        j = 2 * self.layer_table[i]
        q, k, v = self.qkv(i, st.h, st.rope[j], st.rope[j + 1])
        st.q = q
        k_cache[slot_ids, positions] = k
        v_cache[slot_ids, positions] = v

    def after_attention(self, i: int, st: StepState, attn_out: torch.Tensor) -> None:
        st.h = self.finish_layer(i, st.h, attn_out.reshape(attn_out.shape[0], -1))

    def finish_layer(self, i: int, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The residual after layer i's o projection of a [N, Hq*D] and its MLP."""
        o = self.dec.project(a, i, "o")
        if self.post_attn[i] is not None:
            o = self.norm(o, self.post_attn[i])
        h = h + o
        g, u = self.dec.project(self.norm(h, self.mlp_norm[i]), i, "gate_up").chunk(2, dim=-1)
        m = self.dec.project(self.act(g) * u, i, "down")
        if self.post_mlp[i] is not None:
            m = self.norm(m, self.post_mlp[i])
        return h + m

    def head(self, st: StepState, greedy: bool = False, sample: SampleArgs | None = None) -> None:
        x = self.norm(st.h, self.final_norm)
        pick = self.dec._cpu_pick
        if greedy and pick is not None:  # the cap is monotonic: the pick is the capped logits' too
            logits, st.tokens = pick.pick(x)
            st.logits = fam.softcap(logits, self.cfg.final_softcap)
        else:
            st.logits = self.head_logits(x)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        dec = self.dec
        raw = dec._cpu_head(x) if dec._cpu_head is not None else quant_ops.logits(x, dec.w.lm_head)
        return fam.softcap(raw, self.cfg.final_softcap)

    def norm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of residual rows h: the final norm, the LM head, the cap."""
        return self.head_logits(self.norm(h, self.final_norm))

    # ---- prefill (plain path) ----
    def prefill_rows(self, prompts: list[tuple[torch.Tensor, int]], k_caches: list[torch.Tensor],
                     v_caches: list[torch.Tensor], first: list[int] | None = None,
                     last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """prefill._unfused_rows for these families (the same contract)."""
        from fgchat.engine.model.prefill import cpu_prefill_rows, write_and_attend

        c, dec = self.cfg, self.dec
        lens = [int(ids.shape[0]) for ids, _ in prompts]
        first = first or [0] * len(prompts)
        starts = [sum(lens[:j]) for j in range(len(lens))]
        ids = torch.cat([p[0] for p in prompts])
        pos = torch.cat([torch.arange(p0, p0 + t, device=ids.device) for p0, t in zip(first, lens)])
        real = ids.shape[0]
        n = cpu_prefill_rows(real) if dec.pads_prefill_rows else real
        if n > real:  # padding rows: token 0 at position 0; row-wise work only, never written or returned
            ids, pos = F.pad(ids, (0, n - real)), F.pad(pos, (0, n - real))
        rope = [(cos[pos], ssin[pos]) for cos, ssin in self.tables]
        if self.long is not None:
            for s0, t, p0 in zip(starts, lens, first):
                if p0 + t > self.cut:
                    rows = slice(s0, s0 + t)
                    rope[0][0][rows], rope[0][1][rows] = self.long[0][pos[rows]], self.long[1][pos[rows]]
        h = self.embed_rows(ids)
        last = torch.tensor([s0 + t - 1 for s0, t in zip(starts, lens)], device=h.device)
        for i in range(c.num_layers):
            q, k, v = self.qkv(i, h, *rope[self.layer_table[i]])
            window = self.windows[i]
            a = write_and_attend(q, k, v, prompts, starts, lens, first, k_caches[i], v_caches[i],
                                 lambda qr, kr, vr: attend_rows(qr, kr, vr, dec.scale, window))
            a = a.reshape(n, c.q_size)
            if last_only and i == c.num_layers - 1:
                h, a = h[last], a[last]
            h = self.finish_layer(i, h, a)
        if last_only:
            return (h if c.num_layers else h[last]), torch.arange(len(lens), device=h.device)
        return h[:real], last


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Rows q [t, Hq, D] at the last t of the n positions of k / v [n, Hkv, D], causal and aligned
    to the end; with window > 0 a row at position p sees positions (p - window, p] only."""
    from fgchat.engine.model.prefill import _attend_after

    t, n = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    if not window or n <= window:  # the window cuts nothing
        return _attend_after(q, k, v, scale, gqa)
    kp = torch.arange(n, device=q.device)[None, :]
    qp = torch.arange(n - t, n, device=q.device)[:, None]
    allowed = (kp <= qp) & (kp > qp - window)
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=allowed, scale=scale,
                                          enable_gqa=gqa)[0].transpose(0, 1)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dec: Decoder, i: int, window: int,
                       spans: list[tuple[int, int]] | None, batch: int, after: tuple[int, int] | None,
                       k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
    """Layer i's attention in the fused prefill (prefill._fused_layers, its arguments) where a
    row may see past the layer's `window`: each prompt's rows q [n, Hq, D] attend causally to
    their last `window` positions (attend_rows) -> [n, Hq*D]; padding rows attend within their
    prompt's padded span and are never read."""
    c, n = dec.cfg, q.shape[0]
    if after is not None:
        slot, first = after
        a = attend_rows(q, k_caches[i][slot, :first + n], v_caches[i][slot, :first + n], dec.scale, window)
        return a.reshape(n, c.q_size)
    if spans is None:
        t = n // batch
        spans = [(j * t, t) for j in range(batch)]
    a = torch.zeros((n, c.num_heads, c.head_dim), dtype=q.dtype, device=q.device)
    for s0, t in spans:
        r = slice(s0, s0 + t)
        a[r] = attend_rows(q[r], k[r], v[r], dec.scale, window)
    return a.reshape(n, c.q_size)
