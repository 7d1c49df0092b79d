"""The fused projection kernel (Triton, run by its interpreter on CPU) against torch compositions.

GPU runs of the same kernel in bf16 at the real model shapes are in tests/test_gpu_fused.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

from fgchat.engine.gemv import ProjConfig, pick_config, project  # noqa: E402
from fgchat.engine.model.decoder import rms_norm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(m: int, n: int, k: int, gated: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, d = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)
    gamma = torch.rand(k, generator=g) + 0.5
    w = torch.randn(2 * n if gated else n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    return [t.to(DEV) for t in (x, d, gamma, w, b)]


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [(1, 48, 96, ProjConfig(16, 64)), (5, 40, 100, ProjConfig(16, 64)), (8, 64, 256, None), (16, 17, 33, ProjConfig(16, 64))],
)
def test_norm_bias_projection_matches_torch(m, n, k, cfg):
    x, d, gamma, w, b = _inputs(m, n, k, False, m * n + k)
    h, y = project(x, w, delta=d, norm_weight=gamma, eps=1e-5, bias=b, config=cfg)
    assert torch.equal(h, x + d)  # the residual stream, rounded as torch's add
    ref = F.linear(rms_norm(x + d, gamma, 1e-5), w, b)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (3, 40, 100)])
def test_gated_projection_is_silu_gate_times_up(m, n, k):
    x, d, gamma, w, _ = _inputs(m, n, k, True, k)
    _, y = project(x, w, delta=d, norm_weight=gamma, eps=1e-6, gated=True, config=ProjConfig(16, 64))
    g, u = F.linear(rms_norm(x + d, gamma, 1e-6), w).chunk(2, dim=-1)
    torch.testing.assert_close(y, F.silu(g) * u, rtol=1e-5, atol=1e-5)


def test_plain_projection_returns_input_and_float32_logits():
    x, _, _, w, _ = _inputs(2, 64, 128, False, 3)
    h, y = project(x, w, out_dtype=torch.float32)
    assert h is x and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_rows_do_not_depend_on_batch_size():
    x, d, gamma, w, _ = _inputs(8, 64, 256, False, 11)
    _, y8 = project(x, w, delta=d, norm_weight=gamma)
    for r in (0, 5):
        _, y1 = project(x[r : r + 1].contiguous(), w, delta=d[r : r + 1].contiguous(), norm_weight=gamma)
        assert torch.equal(y1[0], y8[r])


def test_rejects_more_rows_than_the_kernel_tile():
    x, _, _, w, _ = _inputs(17, 16, 32, False, 0)
    with pytest.raises(ValueError, match="at most 16 rows"):
        project(x, w)


def test_config_depends_on_shape_only():
    assert pick_config(128256, 2048, False) == pick_config(128256, 2048, False)
    assert pick_config(128256, 2048, False).block_n == 64  # a wide head gets wide column tiles
    assert pick_config(576, 576, False).block_n == 16  # a narrow one keeps programs for the SMs


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_decoder_step_matches_unfused(tiny_model_dirs, family):
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.step import StepProgram

    eng = Engine(EngineConfig(model=str(tiny_model_dirs[family]), device="cpu", max_context=64,
                              dtype="float32"))
    fused = StepProgram(Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True),
                        eng.cache, eng.bufs, eng.attention)
    assert fused.dec.fused_proj
    for t in eng.cache.k + eng.cache.v:
        t.normal_()
    for b in (1, 3):
        eng.bufs.stage(list(range(5, 5 + b)), [9, 20, 30][:b], [4, 0, 7][:b], [0.0] * b, [1.0] * b,
                       [0] * b, [0] * b)
        eng.program.max_len_hint = fused.max_len_hint = 31
        ref = eng.program.run_eager(b, do_sample=False)
        ref_logits, ref_k = ref.logits.clone(), [k.clone() for k in eng.cache.k]
        out = fused.run_eager(b, do_sample=False)
        torch.testing.assert_close(out.logits, ref_logits, rtol=1e-4, atol=1e-4)
        for k, rk in zip(eng.cache.k, ref_k):
            torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
