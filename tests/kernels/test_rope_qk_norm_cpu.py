"""kernels.fused.rope_kv_write with Qwen3's per-head q/k RMSNorm (QK_NORM) under Triton's
interpreter (CPU): the q rows it returns and the K rows it writes to the cache (and to k_out)
against a float64 composition of RMSNorm then RoPE on the same inputs, in float32 and bf16; the
V rows copied unchanged; a program per head and per row give the same bits; the torch composition
the plain stages run (ops.rms_norm, then RoPE rounded as torch does) agrees to an ulp. The GPU run
is in tests/gpu/test_gpu_qwen3_fused.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

import interpreter_rounding  # noqa: E402

from fgchat.engine.kernels.fused import rope_kv_write  # noqa: E402
from fgchat.engine.model.ops import rms_norm, rotate_half  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU file covers CUDA")
RNE = interpreter_rounding.install()
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not RNE, reason="no RNE patch"))]
EPS = 1e-6


def _inputs(dtype: torch.dtype, hq: int, hkv: int, d: int, t: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).double() / d))
    emb = torch.arange(t).double()[:, None] * inv[None]
    emb = torch.cat([emb, emb], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    # heads of very different scales (the norm removes them), one with a large channel
    qkv = torch.randn(rows, hq + 2 * hkv, d, generator=g) * torch.logspace(-2, 2, hq + 2 * hkv)[None, :, None]
    qkv[:, 0, 3] = 400.0
    qkv = qkv.reshape(rows, -1).to(dtype)
    qn = (torch.rand(d, generator=g) + 0.5).to(dtype)
    kn = (torch.rand(d, generator=g) * 2).to(dtype)
    return cos, sin, qkv, qn, kn


def _reference(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, s: torch.Tensor):
    """float64 RMSNorm of each head row of x [N, H, D] by w, then RoPE: (a, b) with the result
    a + b = xn * cos + rotate_half(xn) * sin."""
    xd = x.double()
    xn = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    return xn * c, rotate_half(xn) * s


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_with_qk_norm_against_float64(dtype):
    hq, hkv, d, t, rows = 4, 2, 32, 48, 3
    cos, sin, qkv, qn, kn = _inputs(dtype, hq, hkv, d, t, rows, 1)
    pos, slots = torch.tensor([0, 17, 47]), torch.tensor([1, 0, 1])
    kc = torch.full((2, t, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    k_out = torch.full((rows, hkv, d), float("nan"), dtype=dtype)
    q = rope_kv_write(qkv, cos, sin, pos, slots, kc, vc, hq, hkv, d, k_out=k_out, qk_norm=(qn, kn), norm_eps=EPS)
    c, s = cos[pos].double()[:, None, :], sin[pos].double()[:, None, :]
    x = qkv.view(rows, hq + 2 * hkv, d)
    # each input rounding (the normed row, its weight's product) is <= eps/2 relative, RoPE's three
    # roundings add eps/2 of |a|, |b| and |a + b|
    u = torch.finfo(dtype).eps
    for got, xs, w in ((q, x[:, :hq], qn), (kc[slots, pos], x[:, hq: hq + hkv], kn)):
        a, b = _reference(xs, w, c, s)
        bound = u * (1.6 * (a.abs() + b.abs()) + 0.6 * (a + b).abs()) + 1e-30
        err = (got.double() - (a + b)).abs()
        assert (err <= bound).all(), (dtype, float((err - bound).max()))
    assert torch.equal(kc[slots, pos], k_out)
    assert torch.equal(vc[slots, pos], x[:, hq + hkv:])
    assert kc.isnan().sum() == (2 * t - rows) * hkv * d  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_with_qk_norm_same_bits_per_head_or_per_row_and_near_torch(dtype):
    """A program per head and per row (the head block padded past Hq + Hkv) write the same bits;
    the plain stages' torch composition (ops.rms_norm, then RoPE) is within an ulp of them."""
    hq, hkv, d, t, rows = 3, 1, 32, 16, 4
    cos, sin, qkv, qn, kn = _inputs(dtype, hq, hkv, d, t, rows, 2)
    pos, slots = torch.tensor([0, 1, 9, 15]), torch.tensor([0, 0, 0, 1])
    got = []
    for hb in (1, 8):
        kc = torch.zeros((2, t, hkv, d), dtype=dtype)
        vc = kc.clone()
        q = rope_kv_write(qkv, cos, sin, pos, slots, kc, vc, hq, hkv, d, heads_per_program=hb,
                          qk_norm=(qn, kn), norm_eps=EPS)
        got.append((q, kc, vc))
    for a, b in zip(*got):
        assert torch.equal(a, b)
    q, kc, _ = got[0]
    x = qkv.view(rows, hq + 2 * hkv, d)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    for out, xs, w in ((q, x[:, :hq], qn), (kc[slots, pos], x[:, hq: hq + hkv], kn)):
        xn = rms_norm(xs, w, EPS)
        t1, t2 = xn * c, rotate_half(xn) * s
        want = t1 + t2  # torch rounds each product and the sum
        # the norm's float32 scale may differ in its last bits (sum order, 1 / sqrt against rsqrt):
        # two ulps of each term, one of the sum
        ulps = torch.finfo(dtype).eps * (2 * (t1.float().abs() + t2.float().abs()) + want.float().abs())
        err = (out.float() - want.float()).abs()
        assert (err <= ulps + 1e-30).all(), (dtype, float((err - ulps).max()))
        if dtype == torch.bfloat16:  # the scale's last bits rarely move a bf16 rounding
            assert (out == want).float().mean() >= 0.95
