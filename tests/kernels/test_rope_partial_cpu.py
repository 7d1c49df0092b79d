"""kernels.fused.rope_kv_write with partial RoPE (tables narrower than the head: Phi-3's
partial_rotary_factor) under Triton's interpreter (CPU): q and the K rows written to the cache
and k_out against a float64 rotation of the first rot dims (pairs (i, i + rot/2), HF's partial
rotary) with the other dims passed, at Phi-4-mini's proportions (rot = 3/4 of the head: neither
half a power of two) and at a power-of-two half; with the q/k norm over the whole head before it;
table_rows picking other rows of the tables than the positions; V copied and nothing else
written. GPU: tests/gpu/test_gpu_phi3_fused.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

import interpreter_rounding  # noqa: E402

from fgchat.engine.kernels.fused import rope_kv_write  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU file covers CUDA")
RNE = interpreter_rounding.install()
EPS = 1e-6


def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """float64: x [N, H, D] RMS-normed by w over the whole head (w None: not), then its first
    rot = cos.shape[-1] dims rotated by cos / sin [N, rot]."""
    xd = x.double()
    if w is not None:
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    rot, h = cos.shape[-1], cos.shape[-1] // 2
    c, s = cos.double()[:, None], sin.double()[:, None]
    xr = xd[..., :rot]
    turned = torch.cat((-xr[..., h:], xr[..., :h]), dim=-1)
    return torch.cat((xr * c + turned * s, xd[..., rot:]), dim=-1)


@pytest.mark.parametrize("d,rot", [(32, 24), (16, 8)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not RNE, reason="no RNE"))])
def test_partial_rope_rotates_the_first_dims_and_passes_the_rest(d, rot, norm, dtype):
    hq, hkv, t, rows = 3, 1, 20, 4
    g = torch.Generator().manual_seed(d + rot)
    inv = 1.0 / (1e4 ** (torch.arange(0, rot, 2).double() / rot))
    emb = torch.arange(2 * t).double()[:, None] * inv[None]
    emb = torch.cat((emb, emb), -1) * torch.linspace(1.0, 1.3, 2 * t).double()[:, None]  # rows past t differ
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = (torch.randn(rows, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    weights = ((torch.rand(d, generator=g) + 0.5).to(dtype), (torch.rand(d, generator=g) + 0.5).to(dtype))
    pos, slots = torch.tensor([0, 5, 19, 11]), torch.tensor([1, 0, 1, 0])
    table = pos + torch.tensor([0, t, 0, t])  # rows 1 and 3 read the second half of the tables
    kc = torch.full((2, t, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    k_out = torch.empty((rows, hkv, d), dtype=dtype)
    got = []
    for hb in (1, 4):  # a head per program, a row per program: the same bits
        q = rope_kv_write(qkv, cos, sin, pos, slots, kc, vc, hq, hkv, d, k_out=k_out, heads_per_program=hb,
                          qk_norm=weights if norm else None, norm_eps=EPS, table_rows=table)
        got.append((q.clone(), kc[slots, pos].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*got))
    q, k = got[0]
    x = qkv.view(rows, hq + 2 * hkv, d)
    u = torch.finfo(dtype).eps
    for out, xs, w in ((q, x[:, :hq], weights[0]), (k, x[:, hq:hq + hkv], weights[1])):
        want = _reference(xs, cos[table], sin[table], w if norm else None)
        # each rounding (normed row, weight product, two products, their sum) is half an ulp
        err = (out.double() - want).abs()
        assert (err <= 4 * u * (want.abs() + 1.0)).all(), float(err.max())
        if not norm:  # the passed dims are the inputs' bits
            assert torch.equal(out[..., rot:], xs[..., rot:])
    assert torch.equal(k_out, k)
    assert torch.equal(vc[slots, pos], x[:, hq + hkv:])
    assert int(kc.isnan().sum()) == (2 * t - rows) * hkv * d  # nothing else written


def test_tables_wider_than_the_head_are_refused():
    qkv = torch.zeros(1, 3 * 8)
    table = torch.zeros(4, 10)
    kc = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="do not fit"):
        rope_kv_write(qkv, table, table, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                      kc, kc.clone(), 1, 1, 8)
