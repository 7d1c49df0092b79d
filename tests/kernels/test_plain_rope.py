"""The plain decode path's RoPE: one rolled rotation of q and k together, the step's cos / signed
sin rows taken once, against ops.apply_rope (HF's rotate_half form) bit for bit."""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.model.ops import apply_rope, apply_rope_rolled, rms_norm, signed_sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rolled_rotation_has_rotate_halfs_bits(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 12, 64, generator=g) * 30).to(dtype)  # large activations too
    cos, sin = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(dtype)
    assert torch.equal(apply_rope_rolled(x, cos, signed_sin(sin)), apply_rope(x, cos, sin))


def test_plain_step_rotates_q_and_k_as_per_head_rope(tiny_model_dirs):
    """Every layer's q and cached k of a batch-3 plain step equal apply_rope on that layer's own
    q / k rows at each lane's position (rows taken once per step, not per layer)."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.model.decoder import StepState

    eng = Engine(EngineConfig(model=str(tiny_model_dirs["llama"]), device="cpu", max_context=64, dtype="bfloat16"))
    dec, c = eng.decoder, eng.cfg
    st = StepState()
    ids, pos, slots = torch.tensor([5, 9, 40]), torch.tensor([3, 17, 30]), torch.tensor([2, 0, 1])
    dec.embed(st, ids)
    for i in range(c.num_layers):
        h = st.h.clone()
        dec.before_attention(i, st, pos, slots, eng.cache.k[i], eng.cache.v[i])
        qkv = dec.project(rms_norm(h, dec.w.layers[i].attn_norm, c.rms_eps), i, "qkv")
        q = qkv[:, : c.q_size].view(3, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size: c.q_size + c.kv_size].view(3, c.num_kv_heads, c.head_dim)
        cos, sin = dec.cos[pos], dec.sin[pos]
        assert torch.equal(st.q, apply_rope(q, cos, sin)), i
        assert torch.equal(eng.cache.k[i][slots, pos], apply_rope(k, cos, sin)), i
        st.h = h + 0.5 * i  # the next layer sees other rows (the rotation rows stay the step's)
        attn = torch.zeros(3, c.num_heads * c.head_dim, dtype=h.dtype)
        dec.after_attention(i, st, attn)
