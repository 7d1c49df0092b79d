"""The float32 reference (model.reference's contract) for Qwen3, Gemma 3 and Phi-3: plain torch,
every product in float32, each layer's weights upcast only while it runs. Its RoPE tables are
its own, computed in float32 from the config (model.families.rope_tables), not the decoder's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fgchat.engine.model import families as fam
from fgchat.engine.model.config import ModelConfig
from fgchat.engine.model.decoder import DecoderWeights
from fgchat.engine.model.ops import signed_sin

HEAD_CHUNK_ROWS = 16384
F32 = torch.float32


class _Ref:
    def __init__(self, cfg: ModelConfig, w: DecoderWeights, length: int) -> None:
        self.c, self.w = cfg, w
        self.tables = [(cos.to(w.embed.device), signed_sin(sin).to(w.embed.device))
                       for cos, sin in fam.rope_tables(cfg, length)]
        self.act = fam.activation(cfg)
        self.scale = fam.attention_scale(cfg)

    def norm(self, x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        return fam.norm_fn(self.c)(x, fam.norm_weight(self.c, wt.to(F32)))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.w.embed).to(F32)
        return h * self.c.hidden_size ** 0.5 if self.c.gemma_norms else h

    def qkv(self, i: int, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, lw, fw, n = self.c, self.w.layers[i], self.w.family[i], h.shape[0]
        qkv = F.linear(self.norm(h, lw.attn_norm), lw.wqkv.to(F32), None if lw.bqkv is None else lw.bqkv.to(F32))
        q = qkv[:, : c.q_size].view(n, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size: c.q_size + c.kv_size].view(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].view(n, c.num_kv_heads, c.head_dim)
        if fw.q_norm is not None:
            q, k = self.norm(q, fw.q_norm), self.norm(k, fw.k_norm)
        cos, ssin = self.tables[fam.layer_table(c, i)]
        cos, ssin = cos[pos], ssin[pos]
        return fam.apply_rope_part(q, cos, ssin), fam.apply_rope_part(k, cos, ssin), v

    def finish(self, i: int, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        lw, fw = self.w.layers[i], self.w.family[i]
        o = F.linear(a, lw.wo.to(F32))
        if fw.post_attn_norm is not None:
            o = self.norm(o, fw.post_attn_norm)
        h = h + o
        g, u = F.linear(self.norm(h, lw.mlp_norm), lw.w_gate_up.to(F32)).chunk(2, dim=-1)
        m = F.linear(self.act(g) * u, lw.w_down.to(F32))
        if fw.post_mlp_norm is not None:
            m = self.norm(m, fw.post_mlp_norm)
        return h + m

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h, self.w.final_norm)
        head = self.w.lm_head
        out = torch.cat([F.linear(x, head[r: r + HEAD_CHUNK_ROWS].to(F32))
                         for r in range(0, head.shape[0], HEAD_CHUNK_ROWS)], dim=1)
        return fam.softcap(out, self.c.final_softcap)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q [t, Hq, D] over keys / vals [n, Hkv, D] where allowed [t, n] -> [t, Hq * D]."""
        g = self.c.num_heads // self.c.num_kv_heads
        keys, vals = keys.repeat_interleave(g, dim=1), vals.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, keys) * self.scale
        p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", p, vals).reshape(q.shape[0], self.c.q_size)


def _allowed(qpos: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    ok = kpos[None, :] <= qpos[:, None]
    return ok & (kpos[None, :] > qpos[:, None] - window) if window else ok


@torch.inference_mode()
def reference_logits(cfg: ModelConfig, w: DecoderWeights, ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits [T, V] of the token ids [T] at positions 0..T-1."""
    t = ids.shape[0]
    r = _Ref(cfg, w, t)
    cut, long = fam.longrope_cut(cfg), fam.long_table(cfg, t)
    if cut is not None and t > cut:  # a prompt past the original context: the long factors for all rows
        r.tables[0] = (long[0].to(ids.device), signed_sin(long[1]).to(ids.device))
    pos = torch.arange(t, device=ids.device)
    h = r.embed(ids)
    for i in range(cfg.num_layers):
        q, k, v = r.qkv(i, h, pos)
        h = r.finish(i, h, r.attend(q, k, v, _allowed(pos, pos, fam.layer_window(cfg, i))))
    return r.logits(h)


@torch.inference_mode()
def reference_decode_step(cfg: ModelConfig, w: DecoderWeights, ids: list[int], positions: list[int],
                          slots: list[int], k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]
                          ) -> torch.Tensor:
    """Float32 logits [B, V] of one decode step (reference.reference_decode_step's contract); a
    windowed layer attends to the last `window` positions of the row's context only."""
    dev = w.embed.device
    r = _Ref(cfg, w, max(positions) + 1)
    pos = torch.tensor(positions, dtype=torch.int64, device=dev)
    h = r.embed(torch.tensor(ids, dtype=torch.int64, device=dev))
    for i, (kc, vc) in enumerate(zip(k_cache, v_cache)):
        q, k, v = r.qkv(i, h, pos)
        rows = []
        for j, (s, t) in enumerate(zip(slots, positions)):
            keys = torch.cat((kc[s, :t].to(F32), k[j: j + 1]))
            vals = torch.cat((vc[s, :t].to(F32), v[j: j + 1]))
            allowed = _allowed(pos[j: j + 1], torch.arange(t + 1, device=dev), fam.layer_window(cfg, i))
            rows.append(r.attend(q[j: j + 1], keys, vals, allowed))
        h = r.finish(i, h, torch.cat(rows))
    return r.logits(h)
