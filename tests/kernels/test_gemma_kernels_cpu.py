"""The fused kernels' Gemma 3 forms under Triton's interpreter (CPU), each against the torch
composition the plain stages run (model.families: gemma_norm with its float32 1 + w, rounded once;
F.gelu(approximate="tanh")): add_rms_norm's one-round norm, its norm of the delta before the add
(whole and as split-K partials) and its embedding scale; rope_kv_write's one-round q/k norm; the
GELU(tanh) gate of silu_mul and of gemv.project_glu. bf16 (RNE patch) within an ulp of the torch
results, float32 within its rounding. The GPU run: tests/gpu/test_gpu_gemma3_fused.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

import interpreter_rounding  # noqa: E402

from fgchat.engine.kernels import fused as fk  # noqa: E402
from fgchat.engine.kernels.gemv import ProjConfig, project, project_glu  # noqa: E402
from fgchat.engine.model.families import apply_rope_part, gemma_norm, gemma_scale  # noqa: E402
from fgchat.engine.model.ops import signed_sin  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU file covers CUDA")
RNE = interpreter_rounding.install()
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not RNE, reason="no RNE patch"))]
EPS = 1e-6


def _near(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16: within an ulp of each wanted value; float32 (where sums in another order and tanh
    from exp differ by more ulps): within 4e-6 of the values' largest magnitude."""
    assert got.dtype == want.dtype and got.shape == want.shape
    w, diff = want.float(), (got.float() - want.float()).abs()
    if want.dtype == torch.float32:
        return float(diff.max()) <= 4e-6 * float(w.abs().max())
    spacing = torch.finfo(want.dtype).eps * torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-30))))
    return bool((diff <= spacing).all())


def _rows(seed: int, rows: int, n: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 3])
def test_add_rms_norm_gemma_norms_the_delta_then_the_sum(dtype, parts):
    rows, n = 3, 96
    h = _rows(1, rows, n, torch.float32, 4.0)  # the fused residual stream is float32
    w, dw = (_rows(s, 1, n, dtype, 0.3)[0] for s in (2, 3))
    if parts == 1:
        delta = _rows(4, rows, n, dtype, 30.0)
        d = delta
    else:
        delta = torch.randn(parts, rows, n, generator=torch.Generator().manual_seed(5)) * 10.0
        d = ((delta[0] + delta[1]) + delta[2]).to(dtype)  # the projection's own rounding
    got_h, got_y = fk.add_rms_norm(h, delta, gemma_scale(w), EPS, residual_dtype=torch.float32, out_dtype=dtype,
                                   one_round=True, delta_norm=gemma_scale(dw))
    dn = gemma_norm(d, gemma_scale(dw), EPS)
    want_h = h + dn.float()
    want_y = gemma_norm(want_h, gemma_scale(w), EPS).to(dtype)  # float32 statistics and scale, one rounding
    assert got_h.dtype == torch.float32 and got_y.dtype == dtype
    # the delta's norm may differ by an ulp (its float32 statistics summed in another order)
    assert _near(got_h.to(dtype), want_h.to(dtype))
    assert _near(got_y, want_y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_scales_the_embedding_rows_first(dtype):
    rows, n = 2, 64
    e = _rows(6, rows, n, dtype)
    w = _rows(7, 1, n, dtype, 0.3)[0]
    scale = float(torch.tensor(n ** 0.5).to(dtype))  # families.embed_scale: a value of the model's dtype
    got_h, got_y = fk.add_rms_norm(e, None, gemma_scale(w), EPS, residual_dtype=torch.float32, out_dtype=dtype,
                                   one_round=True, in_scale=scale)
    want_h = e * torch.tensor(scale, dtype=dtype)  # HF: embeddings times the scale in their dtype
    assert torch.equal(got_h, want_h.float())
    assert _near(got_y, gemma_norm(want_h, gemma_scale(w), EPS))
    with pytest.raises(ValueError, match="one_round"):
        fk.add_rms_norm(e, None, w, EPS, in_scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_gemma_qk_norm_is_the_plain_stages_within_an_ulp(dtype):
    hq, hkv, d, t, rows = 4, 2, 32, 24, 3
    g = torch.Generator().manual_seed(8)
    inv = 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.arange(t).float()[:, None] * inv[None]
    emb = torch.cat([emb, emb], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = (torch.randn(rows, (hq + 2 * hkv) * d, generator=g) * 5).to(dtype)
    qn, kn = ((torch.rand(d, generator=g) - 0.5).to(dtype) for _ in range(2))
    pos, slots = torch.tensor([0, 9, 23]), torch.tensor([1, 0, 1])
    kc = torch.full((2, t, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    q = fk.rope_kv_write(qkv, cos, sin, pos, slots, kc, vc, hq, hkv, d, qk_norm=(gemma_scale(qn), gemma_scale(kn)),
                         norm_eps=EPS, norm_one_round=True)
    x = qkv.view(rows, hq + 2 * hkv, d)
    c, s = cos[pos], signed_sin(sin[pos])
    want_q = apply_rope_part(gemma_norm(x[:, :hq], gemma_scale(qn), EPS), c, s)
    want_k = apply_rope_part(gemma_norm(x[:, hq:hq + hkv], gemma_scale(kn), EPS), c, s)
    assert _near(q, want_q) and _near(kc[slots, pos], want_k)
    assert torch.equal(vc[slots, pos], x[:, hq + hkv:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_gate_of_silu_mul_and_project_glu_is_torchs(dtype):
    m, i, k = 3, 40, 64
    g = torch.Generator().manual_seed(9)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(2 * i, k, generator=g) / 2).to(dtype)  # gate sums over a wide range: both tails
    cfg = ProjConfig(16, 64)
    gu = project(x, w, cfg)
    want = (F.gelu(gu[:, :i], approximate="tanh") * gu[:, i:]).to(dtype)
    got = fk.silu_mul(gu, gelu=True)
    assert _near(got, want)
    assert torch.equal(project_glu(x, w, cfg, gelu=True), got)  # the same products, the same activation
    assert not torch.equal(fk.silu_mul(gu), got)
