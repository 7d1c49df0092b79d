"""The projection that normalises its own input (gemv.project_norm*: add + RMSNorm in the
projection's prologue) against the two launches it replaces (fused.add_rms_norm, then the
projection) and against float32 torch. Triton's interpreter on CPU; the same kernel on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

from fgchat.engine.kernels.fused import add_rms_norm  # noqa: E402
from fgchat.engine.kernels.gemv import (  # noqa: E402
    Norm,
    ProjConfig,
    project,
    project_argmax,
    project_glu,
    project_logits,
    project_norm,
    project_norm_argmax,
    project_norm_logits,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter sums a row in one order in both kernels; a GPU's reduction layout may differ
# between the norm kernel and the projection's prologue by an ulp of the statistics
EXACT = DEV == "cpu"
EPS = 1e-5
# the interpreter's tl.dot cannot take bf16 operands (numpy has no bf16): float16 and float32 on CPU
DTYPES = [torch.bfloat16, torch.float16] if DEV == "cuda" else [torch.float16, torch.float32]
LOW = DTYPES[0]


def residual(m: int, k: int, seed: int, dtype: torch.dtype, outlier: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, k, generator=g) * 3
    if outlier:
        h[:, 5] = outlier  # a massive activation channel, as real models carry
    return h.to(DEV, dtype)


def delta_of(kind: str, m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "none":
        return None
    if kind == "dense":
        return torch.randn(m, k, generator=g).to(DEV, dtype)
    return torch.randn(int(kind[-1]), m, k, generator=g).to(DEV)  # "parts3": float32 slabs


def reference(h, d, nw, w, residual_dtype, glu=False):
    """float32 torch: (h + delta, the projection of rms_norm(h + delta) * nw)."""
    r = h.float()
    if d is not None:
        r = r + (d.float().sum(0) if d.dim() == 3 else d.float())
    x = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()
    if glu:
        i = w.shape[0] // 2
        return r, F.silu(x @ w[:i].float().T) * (x @ w[i:].float().T)
    return r, x @ w.float().T


CASES = [  # m, n, k, delta, residual float32, config
    (1, 48, 96, "none", False, ProjConfig(16, 64)),
    (3, 40, 100, "dense", False, ProjConfig(16, 64)),
    (8, 64, 256, "parts3", True, None),
    (5, 32, 128, "parts2", True, ProjConfig(32, 64, 4, 3, swap=True)),
    (16, 17, 200, "dense", True, ProjConfig(16, 64)),
]


@pytest.mark.parametrize("m,n,k,kind,res32,cfg", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_projection_equals_norm_then_projection(m, n, k, kind, res32, cfg, dtype):
    h = residual(m, k, m + n + k, torch.float32 if res32 else dtype, outlier=2.5e4 if res32 else 0.0)
    d = delta_of(kind, m, k, n, dtype)
    g = torch.Generator().manual_seed(k)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEV, dtype)
    rdt = torch.float32 if res32 else None
    h_out, y = project_norm(Norm(h, d, nw, EPS, rdt), w, cfg)
    h_want, x = add_rms_norm(h, d, nw, EPS, residual_dtype=rdt)
    y_want = project(x, w, cfg)
    assert h_out.dtype == h_want.dtype and y.dtype == dtype and y.shape == (m, n)
    if d is None:
        assert h_out is h
    else:
        assert h_out.data_ptr() != h.data_ptr()
        assert torch.equal(h_out, h_want)  # the residual add is elementwise: same bits anywhere
    if EXACT:
        assert torch.equal(y, y_want)
    else:
        torch.testing.assert_close(y.float(), y_want.float(), rtol=2e-2, atol=2e-2)
    r32, y32 = reference(h, d, nw, w, rdt)
    scale = y32.abs().max().item()
    assert (y.float() - y32).abs().max().item() <= 0.03 * scale
    assert (y_want.float() - y32).abs().max().item() <= 0.03 * scale  # the reference is a fair one


@pytest.mark.parametrize("kind", ["dense", "parts3"])
def test_norm_glu_equals_norm_then_glu(kind):
    m, i, k, dtype = 4, 40, 128, LOW
    h = residual(m, k, 7, torch.float32)
    d = delta_of(kind, m, k, 3, dtype)
    g = torch.Generator().manual_seed(1)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, dtype)
    w = (torch.randn(2 * i, k, generator=g) / k**0.5).to(DEV, dtype)
    cfg = ProjConfig(16, 64)
    h_out, act = project_norm(Norm(h, d, nw, EPS, torch.float32), w, cfg, glu=True)
    _, x = add_rms_norm(h, d, nw, EPS, residual_dtype=torch.float32)
    want = project_glu(x, w, cfg)
    assert act.shape == (m, i)
    if EXACT:
        assert torch.equal(act, want)
    _, ref = reference(h, d, nw, w, torch.float32, glu=True)
    assert (act.float() - ref).abs().max().item() <= 0.03 * ref.abs().max().item()


def test_norm_head_logits_and_argmax():
    m, n, k, dtype = 3, 300, 128, LOW
    h = residual(m, k, 11, torch.float32, outlier=2.5e4)
    d = delta_of("parts2", m, k, 5, dtype)
    g = torch.Generator().manual_seed(2)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEV, dtype)
    cfg = ProjConfig(64, 64)
    norm = Norm(h, d, nw, EPS, torch.float32)
    h1, logits = project_norm_logits(norm, w, cfg)
    h2, logits2, tokens = project_norm_argmax(norm, w, cfg)
    _, x = add_rms_norm(h, d, nw, EPS, residual_dtype=torch.float32)
    want = project_logits(x, w, cfg)
    want2, want_tok = project_argmax(x, w, cfg)
    assert logits.dtype == torch.float32 and torch.equal(h1, h2)
    assert torch.equal(logits, logits2) and torch.equal(tokens, logits.argmax(-1))
    if EXACT:
        assert torch.equal(logits, want) and torch.equal(tokens, want_tok)
    _, ref = reference(h, d, nw, w, torch.float32)
    assert (logits - ref).abs().max().item() <= 0.03 * ref.abs().max().item()


def test_norm_rejects_a_split_and_bad_shapes():
    from fgchat.engine.kernels import gemv

    h = residual(2, 64, 1, LOW)
    nw = torch.ones(64, device=DEV, dtype=LOW)
    w = torch.randn(32, 64, device=DEV).to(LOW)
    with pytest.raises(ValueError, match="unsplit"):
        gemv._launch(None, w, ProjConfig(16, 32), torch.float32, False, 2, norm=Norm(h, None, nw, EPS))
    with pytest.raises(ValueError, match="weight"):
        project_norm(Norm(h, None, nw[:32], EPS), w)
    with pytest.raises(ValueError, match="delta"):
        project_norm(Norm(h, torch.zeros(2, 2, 64, device=DEV, dtype=LOW), nw, EPS), w)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decode_step_with_norm_in_projection(tiny_model_dirs, family, monkeypatch):
    """FGCHAT_NORM_IN_PROJECTION's step against the default fused step (the same bits under the
    interpreter) and the unfused one, greedy and sampled; no add_rms_norm launch is left where a
    projection took it in (qwen2's biased qkv keeps its own)."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.kernels import fused as fk
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.step import StepProgram, Variant
    from fgchat.protocol.tuning import Tuning

    eng = Engine(EngineConfig(model=str(tiny_model_dirs[family]), device="cpu", max_context=64,
                              dtype="float32"))
    programs = {name: StepProgram(Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True,
                                          tuning=Tuning(norm_in_projection=on)), eng.cache, eng.bufs, eng.attention)
                for name, on in (("fused", False), ("norm_in", True))}
    stages = programs["norm_in"].dec.fused_stages
    assert stages.norm_gate_up and stages.norm_head and stages.norm_qkv == (family == "llama")
    norms = []
    real = fk.add_rms_norm
    monkeypatch.setattr(fk, "add_rms_norm", lambda *a, **k: norms.append(1) or real(*a, **k))
    for t in eng.cache.k + eng.cache.v:
        t.normal_()
    for b in (1, 3):
        for variant in (Variant.GREEDY, Variant.SAMPLED):
            eng.bufs.stage(list(range(5, 5 + b)), [9, 20, 30][:b], [4, 0, 7][:b], [0.8] * b, [0.9] * b,
                           [0] * b, [1, 2, 3][:b])
            out = {}
            for name, prog in (("plain", eng.program), *programs.items()):
                prog.max_len_hint = 31
                cache_k = [k.clone() for k in eng.cache.k]
                norms.clear()
                r = prog.run_eager(b, variant=variant)
                out[name] = (r.logits.clone(), r.tokens.clone(), [k.clone() for k in eng.cache.k], len(norms))
                for k, saved in zip(eng.cache.k, cache_k):  # every program steps from the same cache
                    k.copy_(saved)
            (fl, ft, fk_, _), (nl, nt, nk, n_norms), (pl, _, pk, _) = out["fused"], out["norm_in"], out["plain"]
            assert torch.equal(nl, fl) and torch.equal(nt, ft), (b, variant)
            assert all(torch.equal(a, c) for a, c in zip(nk, fk_))
            torch.testing.assert_close(nl, pl, rtol=1e-4, atol=1e-4)
            assert n_norms == (eng.cfg.num_layers if family == "qwen2" else 0), n_norms
