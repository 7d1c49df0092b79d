"""Gemma 3 on the fused stages (model.fused_step: (1 + w) norms in kernels.fused.add_rms_norm,
also after attention and after the MLP; the q/k norm in rope_kv_write; the GELU(tanh) gate; the
embedding scale; windowed layers with their own RoPE base; query_pre_attn_scalar), Triton kernels
under the interpreter on CPU: a tiny random Gemma 3 (no final softcap, as Gemma 3's configs; window
8, layers 0 and 2 windowed) built with transformers' classes, prompts past the window prefilled and
decoded a few greedy steps at batch 2 by a fused decoder, against the plain family stages
(model.family_stages) on the same weights and transformers' float32 greedy tokens: float32 tokens
equal and logits within float32 rounding; bf16 logits no further from float32 than the plain bf16
stages' (within bf16 rounding). Each Gemma op taken out of the fused stages moves the logits far
past that tolerance. Also the routing and mega's refusal. GPU: tests/gpu/test_gpu_gemma3_fused.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")
pytest.importorskip("transformers")

import family_runs  # noqa: E402
import interpreter_rounding  # noqa: E402
import tiny_models  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU file covers CUDA")
RNE = interpreter_rounding.install()
STEPS = 3
PROMPTS = ([5, 17, 33, 90, 201, 7, 11, 12, 13, 14], [300, 12, 44, 45, 46, 8])  # 10 > window 8; 6 + steps
SLOTS = (2, 5)
TOL = 1e-4


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return tiny_models.build_model(tmp_path_factory.mktemp("gemma3_fused") / "gemma3", "gemma3", layers=3,
                                   seed=37, softcap=None)


def _engine(path, dtype: str):
    return family_runs.cpu_engine(path, dtype)


def _decode(dec, eng, cache, steps: int = STEPS) -> tuple[list[list[int]], list[torch.Tensor]]:
    return family_runs.decode(dec, eng, cache, PROMPTS, SLOTS, steps)


def _fused(eng, breaks=None, steps: int = STEPS, rows: int = len(PROMPTS)):
    """A fused decoder's run on the engine's weights over the first `rows` prompts (breaks(dec): an
    edit that takes an op out)."""
    dec, cache = family_runs.fused_decoder(eng)
    assert dec.family is None and dec.fused_stages.qk_norms is not None and dec.fused_stages.one_round
    if breaks is not None:
        breaks(dec)
    return family_runs.decode(dec, eng, cache, PROMPTS[:rows], SLOTS[:rows], steps)


@pytest.fixture(scope="module")
def float32_runs(gemma_dir):
    eng = _engine(gemma_dir, "float32")
    assert eng.decoder.family is not None and not eng.decoder.fused
    return eng, _decode(eng.decoder, eng, eng.cache), _fused(eng)


def test_fused_gemma3_float32_equals_the_plain_stages_and_transformers(gemma_dir, float32_runs):
    _, plain, fused = float32_runs
    family_runs.assert_float32_equal(gemma_dir, plain, fused, PROMPTS, STEPS, TOL)


def _no_scale(dec):
    dec.fused_stages.embed_scale = None


def _no_post_norms(dec):
    st = dec.fused_stages
    st.post_attn = [None] * len(st.post_attn)
    st.post_mlp = [None] * len(st.post_mlp)


def _silu(dec):
    dec.fused_stages.gelu = False


def _one_rope_base(dec):
    st = dec.fused_stages
    st.layer_table = [0] * len(st.layer_table)


def _no_window(dec):
    dec.layer_windows = None


def _plain_scale(dec):
    dec.scale = dec.cfg.head_dim ** -0.5


def _weights_without_one(dec):
    st = dec.fused_stages
    st.attn_norms = [w - 1.0 for w in st.attn_norms]


@pytest.mark.parametrize("breaks", [_no_scale, _no_post_norms, _silu, _one_rope_base, _no_window, _plain_scale,
                                    _weights_without_one])
def test_each_gemma_op_taken_out_fails_the_comparison(float32_runs, breaks):
    """The prefill of the prompt longer than the window by each broken variant."""
    eng, (_, want), _ = float32_runs
    family_runs.assert_taken_out_fails(_fused(eng, breaks, steps=0, rows=1), want[0][:1], breaks.__name__, TOL)


@pytest.mark.skipif(not RNE, reason="no RNE patch")
def test_fused_gemma3_bf16_logits_within_bf16_of_float32(gemma_dir, float32_runs):
    """bf16: each path's own greedy run compared step by step while its tokens agree with float32's."""
    eng = _engine(gemma_dir, "bfloat16")
    family_runs.assert_bf16_near_float32(float32_runs[1], _decode(eng.decoder, eng, eng.cache), _fused(eng))


def test_routing_puts_gemma3_on_the_fused_stages_unless_it_caps_its_logits():
    from fgchat.engine.model.config import parse_config
    from fgchat.engine.model.families import fused_note, fused_serves, uses_family_stages

    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
                architectures=["Gemma3ForCausalLM"], sliding_window=8)
    gemma = parse_config(base)
    capped = parse_config(dict(base, final_logit_softcapping=30.0))
    assert fused_serves(gemma) and fused_note(gemma) is None
    assert uses_family_stages(gemma) and not uses_family_stages(gemma, fused=True)  # reference / CPU: plain
    assert not fused_serves(capped) and "plain torch stages" in fused_note(capped)


def test_mega_kernel_refuses_gemma3_with_its_reason(gemma_dir):
    from fgchat.engine.kernels.megakernel import DecodeLayers

    with pytest.raises(ValueError, match="Gemma 3"):
        DecodeLayers(*family_runs.fused_decoder(_engine(gemma_dir, "bfloat16")))
