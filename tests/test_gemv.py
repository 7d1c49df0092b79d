"""The skinny projection kernel (Triton; its interpreter on CPU) against torch.

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

from fgchat.engine.gemv import ProjConfig, pick_config, project, wins_over_cublas  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(DEV), w.to(DEV)


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [(1, 48, 96, ProjConfig(16, 64)), (5, 40, 100, ProjConfig(16, 64)), (8, 64, 256, None),
     (16, 17, 33, ProjConfig(16, 64)), (2, 32, 1024, None)],
)
def test_projection_matches_torch(m, n, k, cfg):
    x, w = _inputs(m, n, k, m * n + k)
    torch.testing.assert_close(project(x, w, cfg), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_rows_do_not_depend_on_batch_size():
    x, w = _inputs(8, 64, 256, 11)
    y8 = project(x, w)
    for r in (0, 5):
        assert torch.equal(project(x[r : r + 1].contiguous(), w)[0], y8[r])


def test_rejects_more_rows_than_the_kernel_tile():
    x, w = _inputs(17, 16, 32, 0)
    with pytest.raises(ValueError, match="at most 16 rows"):
        project(x, w)


def test_config_and_routing_depend_on_shape_only():
    assert pick_config(2048, 2048).block_k == 512
    assert pick_config(576, 576).block_k == 128  # K not a multiple of 512: masked 128-wide tiles
    assert wins_over_cublas(torch.empty(2048, 2048)) and not wins_over_cublas(torch.empty(2048, 8192))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_decoder_step_matches_unfused(tiny_model_dirs, family):
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.step import StepProgram

    eng = Engine(EngineConfig(model=str(tiny_model_dirs[family]), device="cpu", max_context=64,
                              dtype="float32"))
    fused = StepProgram(Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True),
                        eng.cache, eng.bufs, eng.attention)
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


def test_float32_output_holds_the_input_dtype_rounding():
    x, w = _inputs(3, 48, 96, 5)
    x16, w16 = x.half(), w.half()
    y = project(x16, w16, ProjConfig(16, 64), out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert torch.equal(y, project(x16, w16, ProjConfig(16, 64)).float())
