"""Phi-3 on the fused stages (partial RoPE in rope_kv_write; LongRoPE's per-position tables in
decode, the long rows for a prompt that ends past the original context in prefill) on a GPU.

- the kernel at Phi-4-mini's head (128 dims, 96 rotated) in bf16 against the float32 rotation,
  the 32 passed dims bit for bit;
- float32: greedy tokens of every mode (eager, piecewise, full) equal transformers' float32 on a
  tiny random Phi-3 (head dim 64, rotary 32, LongRoPE from position 32), batch 1 and 2, prompts
  below and past the original context; the engine runs the fused Triton kernels (no "plain torch
  stages" line) and mega is unavailable with its reason;
- bf16: the start-up check passes on the fused kernels; every mode gives the same tokens;
- the phi-4-mini preset's random weights (bf16, head dim 128, rotary 96) in every mode against
  the float32 reference, batch 1 and 2; then each mode's decode time per token at batch 1 and 8
  of the fused stages beside the plain ones (printed).

Run: pytest -m gpu tests/gpu/test_gpu_phi3_fused.py -s (prints what it measured)
"""

from __future__ import annotations

import pytest
import torch

import gpu_runs
import tiny_models
from fgchat.engine.core import Engine, EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = ("eager", "piecewise", "full")
PROMPTS = (5, 7, 40)  # the last past the original context of 32
NEW = 24


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return tiny_models.build_model(tmp_path_factory.mktemp("gpu_phi3_fused") / "phi3", "phi3", hidden=256, layers=3,
                                   heads=4, kv_heads=2, head_dim=64, intermediate=512, seed=47)


def test_rope_kv_write_partial_at_phi_4_mini_head():
    from fgchat.engine.kernels.fused import rope_kv_write

    hq, hkv, d, rot, t, rows = 24, 8, 128, 96, 64, 5
    g = torch.Generator().manual_seed(3)
    inv = 1.0 / (1e4 ** (torch.arange(0, rot, 2).double() / rot))
    emb = torch.arange(t).double()[:, None] * inv[None]
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos().to("cuda", torch.bfloat16), emb.sin().to("cuda", torch.bfloat16)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to("cuda", torch.bfloat16)
    pos = torch.tensor([0, 9, 31, 63, 40], device="cuda")
    slots = torch.zeros(rows, dtype=torch.int64, device="cuda")
    kc = torch.zeros((1, t, hkv, d), dtype=torch.bfloat16, device="cuda")
    vc = kc.clone()
    q = rope_kv_write(qkv, cos, sin, pos, slots, kc, vc, hq, hkv, d)
    x = qkv.view(rows, hq + 2 * hkv, d).double()
    c, s = cos[pos].double()[:, None], sin[pos].double()[:, None]
    for got, xs in ((q, x[:, :hq]), (kc[0, pos], x[:, hq:hq + hkv])):
        xr = xs[..., :rot]
        want = xr * c + torch.cat((-xr[..., rot // 2:], xr[..., :rot // 2]), -1) * s
        err = float((got[..., :rot].double() - want).abs().max())
        print(f"partial RoPE bf16 at d {d} rot {rot}: max error {err:.4f}")
        assert err <= 0.04 * float(want.abs().max())
        assert torch.equal(got[..., rot:].double(), xs[..., rot:])
    assert torch.equal(vc[0, pos].double(), x[:, hq + hkv:])


def _assert_fused(eng: Engine, label: str) -> None:
    gpu_runs.assert_fused_line(eng, label, "partial RoPE", MODES)
    dec = eng.decoder
    assert dec.family is None and not dec.rope_in_attention
    assert dec.rope_sets[0][0].shape[1] == eng.cfg.rotary_dim < eng.cfg.head_dim


def test_float32_every_mode_matches_transformers(phi3_dir):
    eng = Engine(EngineConfig(model=str(phi3_dir), device="cuda", dtype="float32", max_context=512))
    _assert_fused(eng, "phi3 tiny float32")
    assert eng.decoder.rope_long is not None
    prompts = [gpu_runs.prompt(n, 900 + n, eng.cfg.vocab_size) for n in PROMPTS]
    gpu_runs.assert_modes_match_transformers(eng, phi3_dir, prompts, NEW, "phi3", MODES)


def test_bf16_fused_passes_the_startup_check_and_modes_agree(phi3_dir):
    eng = Engine(EngineConfig(model=str(phi3_dir), device="cuda", dtype="bfloat16", max_context=512))
    gpu_runs.assert_startup_check_passes(eng, "phi3 tiny bf16")
    _assert_fused(eng, "phi3 tiny bf16")
    prompts = [gpu_runs.prompt(n, 950 + n, eng.cfg.vocab_size) for n in PROMPTS]
    gpu_runs.assert_modes_agree(eng, prompts, NEW, MODES)


def test_preset_phi_4_mini_every_mode_against_the_reference_and_its_step_time():
    eng = Engine(EngineConfig(preset="phi-4-mini", device="cuda", dtype="bfloat16", max_context=2048))
    gpu_runs.assert_startup_check_passes(eng, "phi-4-mini")
    _assert_fused(eng, "phi-4-mini bf16")
    prompt = gpu_runs.prompt(600, 7, eng.cfg.vocab_size)
    gpu_runs.assert_preset_modes_match_the_reference(eng, prompt, MODES)
    gpu_runs.print_step_times(eng, gpu_runs.plain_twin("phi-4-mini"), MODES, prompt, "phi-4-mini")
