"""The fused elementwise kernels under Triton's interpreter (CPU) against float64, on rows with
massive activation channels (1e4-6e4) as real models carry them. The GPU runs of the same checks,
projections and attention included, are in tests/gpu/test_gpu_outliers.py; this file keeps CI (no GPU)
watching the kernels' arithmetic. bf16 needs round-to-nearest in the interpreter
(tests/interpreter_rounding.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

import interpreter_rounding  # noqa: E402

from fgchat.engine.kernels.fused import add_rms_norm, rope_kv_write, silu_mul  # noqa: E402
from fgchat.engine.model.ops import rotate_half  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU file covers CUDA")
RNE = interpreter_rounding.install()
DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not RNE, reason="no RNE patch"))]


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def outlier_rows(rows: int, n: int, seed: int, top: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    chans = [n // 4 * i + 7 for i in range(4)]
    x[:, chans] = torch.linspace(1e4, top, 4) * torch.tensor([1.0, -1.0, 1.0, -1.0])
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_float32_residual_with_outliers(dtype):
    """The fused path's form: residual in float32, delta in the model dtype, output in w's dtype."""
    rows, n = 3, 576
    h = outlier_rows(rows, n, 1, 5e4)  # float32 residual
    d = (torch.randn(rows, n, generator=torch.Generator().manual_seed(2)) * 30).to(dtype)
    w = torch.rand(n, generator=torch.Generator().manual_seed(3)).add(0.5).to(dtype)
    h_out, y = add_rms_norm(h, d, w, 1e-5, residual_dtype=torch.float32)
    assert h_out.dtype == torch.float32 and y.dtype == dtype
    exact = h.double() + d.double()
    assert ((h_out.double() - exact).abs() <= exact.abs() * 2**-24 + 1e-30).all()
    hr = h_out.double()
    ref = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert ((y.double() - ref).abs() <= ref.abs() * 2.5 * eps(dtype) + 1e-7).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_model_dtype_residual_with_outliers(dtype):
    rows, n = 2, 576
    h = outlier_rows(rows, n, 4, 5e4).to(dtype)
    d = (torch.randn(rows, n, generator=torch.Generator().manual_seed(5)) * 30).to(dtype)
    w = torch.ones(n, dtype=dtype)
    h_out, y = add_rms_norm(h, d, w, 1e-5)
    exact = h.double() + d.double()
    assert torch.equal(h_out, (h.float() + d.float()).to(dtype))  # one rounding, to nearest
    assert ((h_out.double() - exact).abs() <= exact.abs() * eps(dtype) / 2 + 1e-30).all()
    hr = h_out.double()
    ref = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert ((y.double() - ref).abs() <= ref.abs() * 2.5 * eps(dtype) + 1e-7).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_large_activations(dtype):
    g = torch.Generator().manual_seed(7)
    gate, up = torch.randn(2, 256, generator=g) * 8, torch.randn(2, 256, generator=g) * 4
    gate[:, :8] = torch.linspace(-50, 50, 8)
    up[:, :8] = 1000.0
    gu = torch.cat([gate, up], dim=-1).to(dtype)
    got = silu_mul(gu)
    gd, ud = gu.double().chunk(2, dim=-1)
    ref = F.silu(gd) * ud
    tiny = torch.finfo(dtype).smallest_normal
    assert ((got.double() - ref).abs() <= ref.abs() * 2.5 * eps(dtype) + ud.abs() * tiny + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_outliers(dtype):
    hq, hkv, d, t, rows = 3, 1, 64, 64, 3
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    emb = torch.arange(t).double()[:, None] * inv[None]
    emb = torch.cat([emb, emb], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = outlier_rows(rows, (hq + 2 * hkv) * d, 9, 3e4).to(dtype)
    pos, slots = torch.tensor([0, 5, 63]), torch.tensor([1, 0, 1])
    kc = torch.full((2, t, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    q = rope_kv_write(qkv, cos, sin, pos, slots, kc, vc, hq, hkv, d)
    c, s = cos[pos].double()[:, None, :], sin[pos].double()[:, None, :]
    for got, x in ((q, qkv[:, : hq * d].view(rows, hq, d)), (kc[slots, pos], qkv[:, hq * d: (hq + hkv) * d].view(rows, hkv, d))):
        a, b = x.double() * c, rotate_half(x.double()) * s
        bound = eps(dtype) * (a.abs() + b.abs() + (a + b).abs()) * 1.01 + 1e-6
        assert ((got.double() - (a + b)).abs() <= bound).all()
    assert torch.equal(vc[slots, pos], qkv[:, (hq + hkv) * d:].view(rows, hkv, d))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(3, 1), (4, 2)])
def test_rope_kv_write_same_bits_per_head_or_per_row(dtype, hq, hkv):
    """A program per head (decode) and a program per row of every head (prefill; the head block
    padded past Hq + Hkv) write the same q, K and V bits and touch nothing else."""
    d, t, rows = 64, 64, 5
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    emb = torch.arange(t).double()[:, None] * inv[None]
    emb = torch.cat([emb, emb], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = outlier_rows(rows, (hq + 2 * hkv) * d, 11, 3e4).to(dtype)
    pos, slots = torch.tensor([0, 1, 2, 40, 63]), torch.tensor([1, 1, 1, 0, 2])
    got = []
    for hb in (1, 2, 8):
        kc = torch.full((3, t, hkv, d), float("nan"), dtype=dtype)
        vc = kc.clone()
        k_out = torch.full((rows, hkv, d), float("nan"), dtype=dtype)
        q = rope_kv_write(qkv, cos, sin, pos, slots, kc, vc, hq, hkv, d, k_out=k_out, heads_per_program=hb)
        got.append((q, kc, vc, k_out))
    for other in got[1:]:
        for a, b in zip(got[0], other):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    q, kc, vc, k_out = got[0]
    assert torch.equal(kc[slots, pos], k_out) and torch.equal(vc[slots, pos], qkv[:, (hq + hkv) * d:].view(rows, hkv, d))
    assert kc.isnan().sum() == (3 * t - rows) * hkv * d  # nothing else written
