"""Qwen3 on the fused stages (the q/k norm inside kernels.fused.rope_kv_write) on a GPU.

- the kernel against a float64 composition of RMSNorm then RoPE (bf16, head dims 64 and 128);
- float32: greedy tokens of every mode (eager, piecewise, full) equal transformers' float32 on
  tiny random Qwen3 models (head dims 64 and 128), batch 1 and 2; the engine runs the fused
  Triton kernels (no "plain torch stages" line) and mega is unavailable with its reason;
- bf16: the start-up check passes on the fused kernels; every mode gives the same tokens;
- the qwen3-0.6b preset's random weights (bf16) in every mode against the float32 reference, and
  the decode time per token at batch 1 and 8 in full mode of the fused stages beside the plain
  ones (printed).

Run: pytest -m gpu tests/gpu/test_gpu_qwen3_fused.py -s (prints what it measured)
"""

from __future__ import annotations

import pytest
import torch

import gpu_runs
import tiny_models
from fgchat.engine.core import Engine, EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = ("eager", "piecewise", "full")
PROMPTS = (5, 11, 19)
NEW = 24


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_qwen3_fused")
    return {d: tiny_models.build_model(root / f"qwen3_{d}", "qwen3", hidden=256, layers=3, heads=4, kv_heads=2,
                                       head_dim=d, intermediate=512, seed=41 + d)
            for d in (64, 128)}


def _assert_fused(eng: Engine, label: str) -> None:
    gpu_runs.assert_fused_line(eng, label, "q/k norm", MODES)
    assert eng.decoder.fused_stages.qk_norms is not None and not eng.decoder.rope_in_attention


@pytest.mark.parametrize("d", [64, 128])
def test_rope_kv_write_qk_norm_against_float64(d):
    from fgchat.engine.kernels.fused import rope_kv_write
    from fgchat.engine.model.ops import rotate_half

    dev, dtype, hq, hkv, t, rows, eps = "cuda", torch.bfloat16, 16, 8, 256, 5, 1e-6
    g = torch.Generator(device=dev).manual_seed(d)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).double() / d))
    emb = torch.arange(t, device=dev).double()[:, None] * inv[None]
    emb = torch.cat([emb, emb], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = (torch.randn(rows, hq + 2 * hkv, d, generator=g, device=dev) * 30).reshape(rows, -1).to(dtype)
    qn = (torch.rand(d, generator=g, device=dev) + 0.5).to(dtype)
    kn = (torch.rand(d, generator=g, device=dev) * 2).to(dtype)
    pos = torch.tensor([0, 1, 100, 200, 255], device=dev)
    slots = torch.tensor([0, 1, 1, 2, 0], device=dev)
    kc = torch.full((3, t, hkv, d), float("nan"), dtype=dtype, device=dev)
    vc = kc.clone()
    q = rope_kv_write(qkv, cos, sin, pos, slots, kc, vc, hq, hkv, d, qk_norm=(qn, kn), norm_eps=eps)
    x = qkv.view(rows, hq + 2 * hkv, d).double()
    c, s = cos[pos].double()[:, None, :], sin[pos].double()[:, None, :]
    u = torch.finfo(dtype).eps
    worst = 0.0
    for got, xs, w in ((q, x[:, :hq], qn), (kc[slots, pos], x[:, hq: hq + hkv], kn)):
        xn = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        a, b = xn * c, rotate_half(xn) * s
        bound = u * (1.6 * (a.abs() + b.abs()) + 0.6 * (a + b).abs()) + 1e-30
        err = (got.double() - (a + b)).abs()
        worst = max(worst, float((err / bound).max()))
    print(f"\nrope_kv_write QK_NORM d={d}: worst error / bound {worst:.3f}")
    assert worst <= 1.0
    assert torch.equal(vc[slots, pos], qkv.view(rows, -1, d)[:, hq + hkv:])


@pytest.mark.parametrize("d", [64, 128])
def test_float32_every_mode_matches_transformers(dirs, d):
    eng = Engine(EngineConfig(model=str(dirs[d]), device="cuda", dtype="float32", max_context=512))
    _assert_fused(eng, f"qwen3 tiny d={d} float32")
    prompts = [gpu_runs.prompt(n, 500 + n, eng.cfg.vocab_size) for n in PROMPTS]
    gpu_runs.assert_modes_match_transformers(eng, dirs[d], prompts, NEW, f"qwen3 d={d}", MODES)


@pytest.mark.parametrize("d", [64, 128])
def test_bf16_fused_passes_the_startup_check_and_modes_agree(dirs, d):
    eng = Engine(EngineConfig(model=str(dirs[d]), device="cuda", dtype="bfloat16", max_context=512))
    gpu_runs.assert_startup_check_passes(eng, f"qwen3 tiny d={d} bf16")
    _assert_fused(eng, f"qwen3 tiny d={d} bf16")
    prompts = [gpu_runs.prompt(n, 600 + n, eng.cfg.vocab_size) for n in PROMPTS]
    gpu_runs.assert_modes_agree(eng, prompts, NEW, MODES)


def test_preset_qwen3_0_6b_every_mode_against_the_reference_and_its_step_time():
    """Each mode checked against the float32 reference step (engine.modes) at 600-token prompts,
    batch 1 and 2; then the decode time per token at batch 1 and 8 in full mode, fused beside
    plain (printed)."""
    eng = Engine(EngineConfig(preset="qwen3-0.6b", device="cuda", dtype="bfloat16", max_context=2048))
    gpu_runs.assert_startup_check_passes(eng, "qwen3-0.6b")
    _assert_fused(eng, "qwen3-0.6b bf16")
    prompt = gpu_runs.prompt(600, 5, eng.cfg.vocab_size)
    gpu_runs.assert_preset_modes_match_the_reference(eng, prompt, MODES)
    gpu_runs.print_step_times(eng, gpu_runs.plain_twin("qwen3-0.6b"), ("full",), prompt, "qwen3-0.6b")
