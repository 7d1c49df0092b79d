"""Prefill on CPU: the unfused path against transformers and against decode steps; the fused
path (Triton kernels run by the interpreter, TRITON_INTERPRET=1) against the unfused one."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fgchat.engine.kv_cache import KVCache
from fgchat.engine.loader import load_model
from fgchat.engine.model.decoder import Decoder, StepState
from fgchat.engine.model.prefill import causal_attention
from small_decoders import run_interpreted

CPU = torch.device("cpu")


def prompt_of(n: int, seed: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)


def setup(path: Path, max_context: int = 256):
    m = load_model(str(path), CPU, torch.float32)
    dec = Decoder(m.cfg, m.weights, max_context, fused=False)
    cache = KVCache(m.cfg, max_context, CPU, torch.float32)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))  # unwritten memory must never matter
    return m.cfg, dec, cache


@pytest.fixture(scope="module")
def tiny_mha(tmp_path_factory) -> Path:
    import tiny_models

    return tiny_models.build_model(tmp_path_factory.mktemp("mha") / "m", "llama", heads=4,
                                   kv_heads=4, seed=11)


@pytest.mark.parametrize("which", ["llama", "qwen2", "mistral", "mha"])
def test_prefill_matches_transformers(tiny_model_dirs, tiny_mha, which):
    transformers = pytest.importorskip("transformers")
    path = tiny_mha if which == "mha" else tiny_model_dirs[which]
    cfg, dec, cache = setup(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompt_of(37, 4, cfg.vocab_size)
    with torch.no_grad():
        hf = ref(ids[None]).logits[0]
    all_l = dec.prefill(ids, 2, cache.k, cache.v, all_logits=True)
    last = dec.prefill(ids, 5, cache.k, cache.v)
    assert all_l.dtype == torch.float32 and all_l.shape == (37, cfg.vocab_size)
    torch.testing.assert_close(all_l, hf, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, hf[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, all_l[-1], rtol=1e-5, atol=1e-5)


def decode_steps(dec: Decoder, ids: torch.Tensor, start: int, slot: int, cache: KVCache) -> torch.Tensor:
    """Logits of positions start..T-1, one decode step each (batch of 1) through the stages."""
    from fgchat.engine.kernels.attention.torch_ref import TorchDecodeAttention

    c, attn = dec.cfg, TorchDecodeAttention()
    out = torch.zeros(1, c.num_heads, c.head_dim)
    rows = []
    for p in range(start, ids.shape[0]):
        pos, slots = torch.tensor([p]), torch.tensor([slot])
        st = StepState()
        dec.embed(st, ids[p : p + 1])
        for i in range(c.num_layers):
            dec.before_attention(i, st, pos, slots, cache.k[i], cache.v[i])
            attn(st.q, cache.k[i], cache.v[i], slots.int(), (pos + 1).int(), out, dec.scale)
            dec.after_attention(i, st, out)
        dec.head(st)
        rows.append(st.logits[0])
    return torch.stack(rows)


@pytest.mark.parametrize("which", ["llama", "mha"])
def test_prefill_matches_decode_steps(tiny_model_dirs, tiny_mha, which):
    """Prefill of a prefix + decode steps == prefill of the whole: logits and the cache."""
    path = tiny_mha if which == "mha" else tiny_model_dirs[which]
    cfg, dec, cache = setup(path)
    ids = prompt_of(30, 6, cfg.vocab_size)
    full = dec.prefill(ids, 1, cache.k, cache.v, all_logits=True)
    dec.prefill(ids[:17], 4, cache.k, cache.v)
    with torch.inference_mode():
        steps = decode_steps(dec, ids, 17, 4, cache)
    torch.testing.assert_close(steps, full[17:], rtol=1e-4, atol=1e-4)
    for i in range(cfg.num_layers):
        torch.testing.assert_close(cache.k[i][4, :30], cache.k[i][1, :30], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[i][4, :30], cache.v[i][1, :30], rtol=1e-5, atol=1e-5)


def test_prefill_writes_only_its_slot(tiny_llama):
    cfg, dec, cache = setup(tiny_llama)
    ids = prompt_of(23, 8, cfg.vocab_size)
    logits = dec.prefill(ids, 6, cache.k, cache.v)
    assert torch.isfinite(logits).all()
    for t in cache.k + cache.v:
        assert torch.isfinite(t[6, :23]).all()
        written = torch.zeros(t.shape[:2], dtype=torch.bool)
        written[6, :23] = True
        assert torch.isnan(t[~written]).all()


@pytest.mark.parametrize("which", ["llama", "qwen2", "mha"])
def test_prefill_many_is_each_prompt_prefilled_alone(tiny_model_dirs, tiny_mha, which):
    from fgchat.engine.model.prefill import prefill_many

    path = tiny_mha if which == "mha" else tiny_model_dirs[which]
    cfg, dec, alone_cache = setup(path)
    _, _, many_cache = setup(path)
    prompts = [(prompt_of(n, 30 + n, cfg.vocab_size), slot) for n, slot in ((5, 3), (40, 0), (1, 7), (17, 2))]
    alone = [dec.prefill(ids, slot, alone_cache.k, alone_cache.v) for ids, slot in prompts]
    together = prefill_many(dec, prompts, many_cache.k, many_cache.v)
    assert len(together) == len(prompts)
    for a, b in zip(alone, together):
        assert b.shape == a.shape and b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)  # larger products: other rounding
        assert int(b.argmax()) == int(a.argmax())
    for ta, tb in zip(alone_cache.k + alone_cache.v, many_cache.k + many_cache.v):
        written = ~torch.isnan(ta[..., 0, 0])
        assert torch.equal(written, ~torch.isnan(tb[..., 0, 0]))  # the same rows, nothing else
        torch.testing.assert_close(tb[written], ta[written], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):  # the fused (CUDA) path prefills one prompt per graph
        prefill_many(SimpleNamespace(fused=True), prompts, many_cache.k, many_cache.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4), (6, 1)])
def test_causal_attention_matches_sdpa(dtype, hq, hkv):
    """Strided views in, [T, Hq*D] out; float32 GQA takes the expanded-heads route."""
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    t, d = 19, 16
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    kv = torch.randn(3, 40, 2 * hkv, d, generator=g).to(dtype)  # a cache-like parent tensor
    k, v = kv[1, :t, :hkv], kv[1, :t, hkv:]
    got = causal_attention(q, k, v, d**-0.5)
    kr = k.repeat_interleave(hq // hkv, dim=1).float()
    vr = v.repeat_interleave(hq // hkv, dim=1).float()
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), kr.transpose(0, 1),
                                         vr.transpose(0, 1), is_causal=True, scale=d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (t, hq * d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.transpose(0, 1).reshape(t, hq * d), rtol=tol, atol=tol)


FUSED_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, "tests")
    from small_decoders import scaled_weights, small_config
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.kv_cache import KVCache

    out = []
    for heads, kv_heads, bias, dtype in json.loads(sys.argv[1]):
        dtype = getattr(torch, dtype)
        cfg = small_config(heads, kv_heads, bias)
        w = scaled_weights(cfg, dtype)
        res = {}
        ids = torch.randint(0, 300, (33,), generator=torch.Generator().manual_seed(1))
        for fused in (False, True):
            dec = Decoder(cfg, w, 64, fused=fused)
            cache = KVCache(cfg, 64, torch.device("cpu"), dtype)
            for t in cache.k + cache.v:
                t.fill_(float("nan"))
            all_l = dec.prefill(ids, 3, cache.k, cache.v, all_logits=True)
            last = dec.prefill(ids, 3, cache.k, cache.v)
            res[fused] = (all_l, last, cache)
        (ua, ul, uc), (fa, fl, fc) = res[False], res[True]
        assert fl.shape == ul.shape and fa.shape == ua.shape and fa.dtype == torch.float32
        kv = max((a[3, :33].float() - b[3, :33].float()).abs().max().item()
                 for a, b in zip(fc.k + fc.v, uc.k + uc.v))
        kv_scale = max(b[3, :33].float().abs().max().item() for b in uc.k + uc.v)
        # other slots untouched; slot 3 rows [33, 64) hold the padding of bucket 64 (finite)
        untouched = all(torch.isnan(t[torch.arange(8) != 3]).all().item() and
                        torch.isfinite(t[3, 33:]).all().item() for t in fc.k + fc.v)
        try:
            Decoder(cfg, w, 64, fused=True).prefill(torch.zeros(65, dtype=torch.long), 0, fc.k, fc.v)
            too_long = "no error"
        except ValueError:
            too_long = "ValueError"
        out.append(dict(all=(fa - ua).abs().max().item(), last=(fl - ul).abs().max().item(),
                        last_vs_all=(fl - fa[-1]).abs().max().item(), scale=ua.abs().max().item(),
                        kv=kv, kv_scale=kv_scale, untouched=untouched, too_long=too_long,
                        finite=bool(torch.isfinite(fa).all())))
    print("RESULT " + json.dumps(out))
    """
)


def test_fused_prefill_matches_unfused_interpreted():
    """The fused path's Triton kernels under the interpreter on CPU, vs the unfused path."""
    pytest.importorskip("triton")
    cases = [(4, 2, False, "float32"), (4, 4, False, "float32"), (6, 2, True, "float32"),
             (4, 2, False, "bfloat16")]
    for case, r in zip(cases, run_interpreted(FUSED_SCRIPT, cases)):
        assert r["finite"] and r["untouched"] and r["too_long"] == "ValueError", (case, r)
        if case[3] == "float32":
            tol = 1e-5 * max(r["scale"], 1.0)
            assert r["all"] <= tol and r["last"] <= tol, (case, r)
            assert r["kv"] <= 1e-5 * max(r["kv_scale"], 1.0), (case, r)
        else:  # bf16: kernels round like torch to within an ulp here and there
            assert r["all"] <= 0.05 * r["scale"] and r["last"] <= 0.05 * r["scale"], (case, r)
            assert r["kv"] <= 0.02 * r["kv_scale"], (case, r)
        assert r["last_vs_all"] <= 1e-5 * max(r["scale"], 1.0), (case, r)


def test_batch_bucket_takes_short_prompts_with_little_padding():
    """The batch route pads every prompt to the longest one's bucket: two or more prompts, that
    bucket at most BATCH_MAX_T tokens and within the cache, few rows or little padding."""
    from fgchat.engine.model.prefill import batch_bucket

    assert batch_bucket([32] * 8, 4096) == 32
    assert batch_bucket([5, 31, 17], 4096) == 32
    assert batch_bucket([33, 2], 4096) == 64
    assert batch_bucket([200, 250, 256, 3], 4096) == 256  # 1024 rows: small enough
    assert batch_bucket([256, 3, 3, 3, 3, 3, 3, 3], 4096) is None  # 2048 rows for 277 tokens
    assert batch_bucket([256] * 8, 4096) == 256  # 2048 rows, no padding
    assert batch_bucket([257, 10], 4096) == 384
    assert batch_bucket([512] * 8, 4096) == 512
    assert batch_bucket([513, 10], 4096) is None  # past BATCH_MAX_T
    assert batch_bucket([40], 4096) is None  # one prompt: the one-prompt graphs
    assert batch_bucket([40, 0], 4096) is None
    assert batch_bucket([40, 50], 48) is None  # the bucket would not fit the cache
