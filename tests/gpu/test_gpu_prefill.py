"""Fused prefill (Triton kernels + SDPA on strided cache views) vs the unfused torch prefill on a GPU.

Run on the H200 (skipped without CUDA): pytest -m gpu tests/gpu/test_gpu_prefill.py
"""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.kv_cache import KVCache
from fgchat.engine.model.config import parse_config
from fgchat.engine.model.decoder import Decoder, random_weights
from fgchat.engine.model.prefill import bucket_for
from small_decoders import as_float32

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

T, CTX, SLOT = 300, 1024, 5
CONFIGS = {  # name: (architecture, heads, kv_heads, head_dim)
    "gqa": ("LlamaForCausalLM", 8, 2, 64),
    "mha": ("LlamaForCausalLM", 4, 4, 128),
    "gqa-bias": ("Qwen2ForCausalLM", 12, 2, 64),
}


def build(name: str, dtype=torch.bfloat16):
    arch, heads, kv_heads, d = CONFIGS[name]
    cfg = parse_config(dict(architectures=[arch], vocab_size=1000, hidden_size=512,
                            intermediate_size=1024, num_hidden_layers=3, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, head_dim=d, rope_theta=10000.0,
                            max_position_embeddings=4096, rms_norm_eps=1e-5))
    w = random_weights(cfg, torch.device("cuda"), dtype, seed=len(name))
    for lw in w.layers:  # larger than the default init: peaked attention, logits far from ties
        lw.wqkv.mul_(4)
        lw.w_gate_up.mul_(2)
    return cfg, w


def run(cfg, w, fused: bool, ids: torch.Tensor):
    dec = Decoder(cfg, w, CTX, fused=fused)
    cache = KVCache(cfg, CTX, torch.device("cuda"), w.embed.dtype)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
    all_l = dec.prefill(ids, SLOT, cache.k, cache.v, all_logits=True)
    last = dec.prefill(ids, SLOT, cache.k, cache.v)
    torch.cuda.synchronize()
    return all_l, last, cache


def ids_of(cfg, n=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n,), generator=g).cuda()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_prefill_matches_unfused(name):
    """Fused and unfused bf16 prefill agree, and the fused one is no farther from the float32
    result of the same weights than the unfused one (bf16 rounding differs, never the math)."""
    cfg, w = build(name)
    ids = ids_of(cfg)
    ua, ul, uc = run(cfg, w, False, ids)
    fa, fl, fc = run(cfg, w, True, ids)
    ra, _, rc = run(cfg, as_float32(w), False, ids)
    assert fa.shape == ua.shape == (T, cfg.vocab_size) and fa.dtype == torch.float32
    assert fl.shape == (cfg.vocab_size,)
    assert torch.isfinite(fa).all() and torch.isfinite(fl).all()
    scale = ra.abs().max().item()
    ef, eu = (fa - ra).abs(), (ua - ra).abs()
    info = dict(fused_mean=ef.mean().item(), unfused_mean=eu.mean().item(), fused_max=ef.max().item(),
                unfused_max=eu.max().item(), diff_max=(fa - ua).abs().max().item(), scale=scale)
    assert info["fused_mean"] <= 1.5 * info["unfused_mean"] + 1e-3 * scale, info
    assert info["fused_max"] <= 2.0 * info["unfused_max"] + 1e-2 * scale, info
    assert info["diff_max"] <= 0.1 * scale, info
    assert (fl - ul).abs().max().item() <= 0.1 * scale
    # the last row alone (padded to its bucket: other attention kernels than the exact rows may
    # run) is as close to float32 as the unfused last row
    assert (fl - ra[-1]).abs().max().item() <= 2.0 * (ul - ra[-1]).abs().max().item() + 1e-2 * scale
    ref_tok = ra.argmax(-1)
    agree_f = (fa.argmax(-1) == ref_tok).float().mean().item()
    agree_u = (ua.argmax(-1) == ref_tok).float().mean().item()
    assert agree_f >= agree_u - 0.03, (agree_f, agree_u)

    for i, (kf, ku, kr) in enumerate(zip(fc.k + fc.v, uc.k + uc.v, rc.k + rc.v)):
        a, b, r = kf[SLOT, :T].float(), ku[SLOT, :T].float(), kr[SLOT, :T]
        assert torch.isfinite(a).all(), i
        ef, eu = (a - r).abs(), (b - r).abs()
        kv = dict(layer=i % cfg.num_layers, v=i >= cfg.num_layers, fused_mean=ef.mean().item(),
                  unfused_mean=eu.mean().item(), fused_max=ef.max().item(), unfused_max=eu.max().item(),
                  scale=r.abs().max().item())
        assert kv["fused_mean"] <= 1.5 * kv["unfused_mean"] + 1e-3 * kv["scale"], kv
        assert kv["fused_max"] <= 2.0 * kv["unfused_max"] + 1e-2 * kv["scale"], kv
        written = torch.zeros(kf.shape[:2], dtype=torch.bool, device="cuda")
        written[SLOT, :bucket_for(T, CTX)] = True  # the prompt's rows and its bucket's padding
        assert torch.isnan(kf[~written]).all(), i  # nothing outside the slot's rows touched


@pytest.mark.parametrize("padded", [True, False], ids=["padded-sdpa", "sdpa-per-prompt"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_pass_prefill_of_several_prompts_matches_float32(name, padded, monkeypatch):
    """prefill_many_fused (the round's prompts stacked; attention as one SDPA over the
    right-padded prompts, or prompt by prompt) against each prompt prefilled alone by the
    unfused path in float32 from the same weights: as close as the bf16 unfused path alone is;
    every prompt's K/V rows written, nothing else."""
    from fgchat.engine.model import prefill as pf
    from fgchat.engine.model.prefill import prefill_many_fused

    monkeypatch.setattr(pf, "PAD_SHORT_TMAX", 10**9 if padded else 0)
    monkeypatch.setattr(pf, "PAD_WASTE_LIMIT", 0.0)

    cfg, w = build(name)
    lens_slots = [(7, 6), (300, 1), (129, 3), (1, 0)]
    prompts = [(ids_of(cfg, n, seed=10 + n), s) for n, s in lens_slots]
    dec = Decoder(cfg, w, CTX, fused=True)
    cache = KVCache(cfg, CTX, torch.device("cuda"), w.embed.dtype)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
    got = prefill_many_fused(dec, prompts, cache.k, cache.v)
    torch.cuda.synchronize()
    ref_dec, plain = Decoder(cfg, as_float32(w), CTX, fused=False), Decoder(cfg, w, CTX, fused=False)
    rcache = KVCache(cfg, CTX, torch.device("cuda"), torch.float32)
    pcache = KVCache(cfg, CTX, torch.device("cuda"), w.embed.dtype)
    written = torch.zeros(cache.k[0].shape[:2], dtype=torch.bool, device="cuda")
    for (ids, slot), g in zip(prompts, got):
        want = ref_dec.prefill(ids, slot, rcache.k, rcache.v)
        bf16 = plain.prefill(ids, slot, pcache.k, pcache.v)
        scale = want.abs().max().item()
        assert g.dtype == torch.float32 and g.shape == (cfg.vocab_size,) and torch.isfinite(g).all()
        err, err_plain = (g - want).abs().max().item(), (bf16 - want).abs().max().item()
        assert err <= 2.0 * err_plain + 1e-2 * scale, (slot, err, err_plain, scale)
        n = ids.shape[0]
        written[slot, :n] = True
        for kc, pc, rc in zip(cache.k + cache.v, pcache.k + pcache.v, rcache.k + rcache.v):
            a, b, r = kc[slot, :n].float(), pc[slot, :n].float(), rc[slot, :n]
            e, e_plain = (a - r).abs().max().item(), (b - r).abs().max().item()
            assert e <= 2.0 * e_plain + 1e-2 * r.abs().max().item(), (slot, e, e_plain)
    assert all(torch.isnan(t[~written]).all() for t in cache.k + cache.v)


def test_fused_prefill_runs_a_fused_attention_backend():
    """Our strided q/k/v views with enable_gqa are eligible for flash and for cuDNN, and the
    default dispatch picks one of them (same bits as restricted to those two), not math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg, w = build("gqa")
    ids = ids_of(cfg, 512, seed=1)
    default, _, _ = run(cfg, w, True, ids)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        fast, _, _ = run(cfg, w, True, ids)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        flash, _, _ = run(cfg, w, True, ids)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cudnn, _, _ = run(cfg, w, True, ids)
    assert torch.equal(default, fast) or torch.equal(default, flash)
    scale = default.abs().max().item()
    assert (flash - default).abs().max().item() <= 0.05 * scale
    assert (cudnn - default).abs().max().item() <= 0.05 * scale


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (8, 8, 128), (12, 2, 64)])
@pytest.mark.parametrize("t", [1, 300, 1024])
def test_causal_attention_vs_float32_math(hq, hkv, d, t):
    """The backend SDPA picks for our views, against float32 math on expanded heads."""
    import torch.nn.functional as F

    from fgchat.engine.kernels.attention.base import cache_heads_first
    from fgchat.engine.model.prefill import heads_first, sdpa_causal

    g = torch.Generator(device="cuda").manual_seed(t + hq)
    q = torch.randn(t, hq, d, device="cuda", generator=g).bfloat16()
    kc = torch.randn(4, 2048, hkv, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn(4, 2048, hkv, d, device="cuda", generator=g).bfloat16()
    got = sdpa_causal(heads_first(q), cache_heads_first(kc, 2, t), cache_heads_first(vc, 2, t), d**-0.5)
    k = kc[2, :t].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
    v = vc[2, :t].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, is_causal=True, scale=d**-0.5)
    ref = ref.transpose(0, 1).reshape(t, hq * d)
    assert got.shape == (t, hq * d) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_fused_prefill_float32_and_lengths():
    """float32 (GQA heads expanded for the efficient kernel), T=1, and a T beyond the cache."""
    cfg, w = build("gqa", torch.float32)
    for n in (1, 2, 77):
        ids = ids_of(cfg, n, seed=n)
        ua, _, uc = run(cfg, w, False, ids)
        fa, _, fc = run(cfg, w, True, ids)
        torch.testing.assert_close(fa, ua, rtol=2e-3, atol=2e-3 * ua.abs().max().item())
        torch.testing.assert_close(fc.k[-1][SLOT, :n], uc.k[-1][SLOT, :n], rtol=2e-3, atol=2e-3)
    dec = Decoder(cfg, w, CTX, fused=True)
    cache = KVCache(cfg, CTX, torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError):
        dec.prefill(ids_of(cfg, CTX + 1), 0, cache.k, cache.v)
