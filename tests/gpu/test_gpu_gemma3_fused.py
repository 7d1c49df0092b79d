"""Gemma 3 on the fused stages ((1 + w) norms before and after each sublayer in add_rms_norm, the
q/k norm in rope_kv_write, the GELU(tanh) gate, the embedding scale, windowed layers with their own
RoPE base, query_pre_attn_scalar) on a GPU.

- float32: greedy tokens of every mode (eager, piecewise, full) equal transformers' float32 on a
  tiny random Gemma 3 without a final softcap (head dim 64, window 8, layers 0 and 2 windowed),
  batch 1 and 2, prompts past the window; the engine runs the fused Triton kernels (no "plain
  torch stages" line) and mega is unavailable with its reason;
- bf16: the start-up check passes on the fused kernels; every mode gives the same tokens;
- the gemma-3-1b preset's random weights (bf16, head dim 256, window 512) in every mode against
  the float32 reference at 600-token prompts, batch 1 and 2; then each mode's decode time per
  token at batch 1 and 8 of the fused stages beside the plain ones (printed).

Run: pytest -m gpu tests/gpu/test_gpu_gemma3_fused.py -s (prints what it measured)
"""

from __future__ import annotations

import pytest
import torch

import gpu_runs
import tiny_models
from fgchat.engine.core import Engine, EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = ("eager", "piecewise", "full")
PROMPTS = (5, 13, 30)  # the last two past the window of 8
NEW = 24


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return tiny_models.build_model(tmp_path_factory.mktemp("gpu_gemma3_fused") / "gemma3", "gemma3", hidden=256,
                                   layers=3, heads=4, kv_heads=2, head_dim=64, intermediate=512, seed=43,
                                   softcap=None)


def _assert_fused(eng: Engine, label: str) -> None:
    gpu_runs.assert_fused_line(eng, label, "q/k norm", MODES)
    st = eng.decoder.fused_stages
    assert st.qk_norms is not None and st.one_round and st.gelu
    assert eng.decoder.layer_windows and not eng.decoder.rope_in_attention


def test_float32_every_mode_matches_transformers(gemma_dir):
    eng = Engine(EngineConfig(model=str(gemma_dir), device="cuda", dtype="float32", max_context=512))
    _assert_fused(eng, "gemma3 tiny float32")
    prompts = [gpu_runs.prompt(n, 700 + n, eng.cfg.vocab_size) for n in PROMPTS]
    gpu_runs.assert_modes_match_transformers(eng, gemma_dir, prompts, NEW, "gemma3", MODES)


def test_bf16_fused_passes_the_startup_check_and_modes_agree(gemma_dir):
    eng = Engine(EngineConfig(model=str(gemma_dir), device="cuda", dtype="bfloat16", max_context=512))
    gpu_runs.assert_startup_check_passes(eng, "gemma3 tiny bf16")
    _assert_fused(eng, "gemma3 tiny bf16")
    prompts = [gpu_runs.prompt(n, 800 + n, eng.cfg.vocab_size) for n in PROMPTS]
    gpu_runs.assert_modes_agree(eng, prompts, NEW, MODES)


def test_preset_gemma_3_1b_every_mode_against_the_reference_and_its_step_time():
    eng = Engine(EngineConfig(preset="gemma-3-1b", device="cuda", dtype="bfloat16", max_context=2048))
    gpu_runs.assert_startup_check_passes(eng, "gemma-3-1b")
    _assert_fused(eng, "gemma-3-1b bf16")
    prompt = gpu_runs.prompt(600, 5, eng.cfg.vocab_size)  # past the 512 window
    gpu_runs.assert_preset_modes_match_the_reference(eng, prompt, MODES)
    gpu_runs.print_step_times(eng, gpu_runs.plain_twin("gemma-3-1b"), MODES, prompt, "gemma-3-1b")
